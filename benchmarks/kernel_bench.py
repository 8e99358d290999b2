"""GPU micro-benchmark: our verify-attention kernel vs SGLang's triton extend kernel on the same TARGET_VERIFY inputs.

    python -m benchmarks.kernel_bench [--check] [--json OUT.json] [--shapes qwen3-8b,gemma4-global] [--quick]

Inputs are what SGLang's triton backend hands its extend kernel for a verify of B = 16 tokens per request: q / k / v
of the block ([bs*B, H, D], bf16), the layer's KV pool, qo_indptr = arange * B, kv_indptr / kv_indices over each
request's cached prefix (the last ``window`` tokens for sliding layers). Times are GPU time per call from CUDA-graph
replays (``triton.testing.do_bench_cudagraph``; the serving path runs both kernels inside CUDA graphs), in us.
``GB/s`` = K/V bytes a single pass over the prefixes must read / our time (the bandwidth floor of the call).
``--check`` also compares outputs (ours vs SGLang's kernel; vs the torch reference on the smaller cases) and exits 1
on a mismatch larger than ``ATOL``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

ATOL = 2e-2               # bf16 inputs, fp32 accumulation
BLOCK = 16                # verify width B
# name: (query heads, KV heads, head dim, sliding window (keys a query may look back) or None)
SHAPES = {
    "qwen3-8b": (32, 8, 128, None),
    "gemma4-sliding": (16, 8, 256, 1023),      # Gemma-4-26B-A4B sliding layers (window 1024)
    "gemma4-global": (16, 2, 512, None),       # its global layers
}
BATCHES = (1, 8, 32, 64)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_POOL_TOKENS = 64 * 8192 * 2               # skip (bs, ctx) pairs past this many cached tokens (memory, time)
REFERENCE_MAX_TOKENS = 8 * 8192               # the torch reference is checked up to this many cached tokens


def make_verify_inputs(bs: int, ctx: int, hq: int, hkv: int, d: int, window, device="cuda", seed=0):
    """The tensors SGLang's backend passes for a verify of BLOCK tokens per request over ``ctx`` cached tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kept = min(ctx, window) if window is not None else ctx        # SGLang's window metadata keeps the last `window`
    slots = bs * ctx + BLOCK * bs
    k_pool = torch.randn(slots, hkv, d, device=device, dtype=torch.bfloat16, generator=gen)
    v_pool = torch.randn(slots, hkv, d, device=device, dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(slots, device=device, generator=gen)    # scattered slots, as after many requests
    starts = torch.arange(bs, device=device) * ctx
    kv_indices = perm[(starts[:, None] + (ctx - kept) + torch.arange(kept, device=device)).reshape(-1)]
    n = bs * BLOCK
    return dict(
        q=torch.randn(n, hq, d, device=device, dtype=torch.bfloat16, generator=gen),
        k_extend=torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=gen),
        v_extend=torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=gen),
        k_buffer=k_pool, v_buffer=v_pool,
        qo_indptr=torch.arange(bs + 1, device=device, dtype=torch.int32) * BLOCK,
        kv_indptr=torch.arange(bs + 1, device=device, dtype=torch.int32) * kept,
        kv_indices=kv_indices.to(torch.int64),
    )


def run_case(name, bs, ctx, check: bool):
    import triton

    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_dflash.kernels.reference import verify_attention_reference
    from sglang_dflash.kernels.verify_attention import verify_attention

    hq, hkv, d, window = SHAPES[name]
    t = make_verify_inputs(bs, ctx, hq, hkv, d, window)
    sm_scale = d ** -0.5
    window_left = window if window is not None else -1
    ours_out = torch.empty_like(t["q"])
    sgl_out = torch.empty_like(t["q"])

    def ours():
        verify_attention(**t, max_q_len=BLOCK, sm_scale=sm_scale, window_left=window_left, out=ours_out)

    def sglang():
        extend_attention_fwd(t["q"], t["k_extend"], t["v_extend"], sgl_out, t["k_buffer"], t["v_buffer"],
                             t["qo_indptr"], t["kv_indptr"], t["kv_indices"], None, True, None, BLOCK, 1.0, 1.0,
                             sm_scale, sliding_window_size=window_left)

    ours(), sglang()
    torch.cuda.synchronize()
    row = dict(shape=name, bs=bs, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, window=window)
    if check:
        row["err_vs_sglang"] = (ours_out.float() - sgl_out.float()).abs().max().item()
        if bs * ctx <= REFERENCE_MAX_TOKENS:
            ref = verify_attention_reference(**t, sm_scale=sm_scale, window_left=window_left)
            row["err_vs_reference"] = (ours_out.float() - ref.float()).abs().max().item()
    row["ours_us"] = 1e3 * triton.testing.do_bench_cudagraph(ours, rep=50)
    row["sglang_us"] = 1e3 * triton.testing.do_bench_cudagraph(sglang, rep=50)
    row["speedup"] = row["sglang_us"] / row["ours_us"]
    kv_bytes = t["kv_indices"].numel() * hkv * d * 2 * 2                 # K and V, bf16
    row["ours_GBps"] = kv_bytes / (row["ours_us"] * 1e-6) / 1e9
    del t
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare outputs too; exit 1 on a mismatch > ATOL")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="bs 1 and 32, contexts 2048 and 32768 only")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU (none visible). Fix: run it on the GPU machine", file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}. Fix: pick from {list(SHAPES)}", file=sys.stderr)
        return 2
    batches, contexts = ((1, 32), (2048, 32768)) if args.quick else (BATCHES, CONTEXTS)

    rows, bad = [], []
    header = f"{'shape':15} {'bs':>3} {'ctx':>6} {'ours us':>9} {'sglang us':>10} {'x':>6} {'GB/s':>6}"
    if args.check:
        header += f" {'err sgl':>8} {'err ref':>8}"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, B = {BLOCK}, bf16, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(header)
    for name in names:
        for bs in batches:
            for ctx in contexts:
                if bs * ctx > MAX_POOL_TOKENS:
                    continue
                row = run_case(name, bs, ctx, args.check)
                rows.append(row)
                line = (f"{name:15} {bs:>3} {ctx:>6} {row['ours_us']:9.1f} {row['sglang_us']:10.1f} "
                        f"{row['speedup']:6.2f} {row['ours_GBps']:6.0f}")
                if args.check:
                    errs = [row.get("err_vs_sglang"), row.get("err_vs_reference")]
                    line += "".join(f" {e:8.1e}" if e is not None else f" {'-':>8}" for e in errs)
                    if any(e is not None and not e <= ATOL for e in errs):
                        bad.append(row)
                        line += "  MISMATCH"
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), block=BLOCK, rows=rows), f, indent=1)
    if bad:
        print(f"{len(bad)} case(s) differ by more than {ATOL}: {[(r['shape'], r['bs'], r['ctx']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
