"""GPU micro-benchmark: our verify-attention kernel vs SGLang's triton extend kernel on the same TARGET_VERIFY inputs.

    python -m benchmarks.kernel_bench [--check] [--json OUT.json] [--shapes qwen3-8b,gemma4-global] [--quick]
    python -m benchmarks.kernel_bench --sweep [--widths 16,1] [--batches 1,8,32,64] [--contexts 256,1024,4096]

Inputs are what SGLang's triton backend hands its extend kernel for a verify of B = 16 tokens per request: q / k / v
of the block ([bs*B, H, D], bf16), the layer's KV pool, qo_indptr = arange * B, kv_indptr / kv_indices over each
request's cached prefix (the last ``window`` tokens for sliding layers). Times are GPU time per call from CUDA-graph
replays (``triton.testing.do_bench_cudagraph``; the serving path runs both kernels inside CUDA graphs), in us.
``GB/s`` = K/V bytes a single pass over the prefixes must read / our time (the bandwidth floor of the call).
``--check`` also compares outputs (ours vs SGLang's kernel; vs the torch reference on the smaller cases) and exits 1
on a mismatch larger than ``ATOL``.
``--sweep`` tunes instead: per case it times every tile of :func:`sweep_tiles` at the default split bound, every
split bound and split length at the default tile, and the best of each together; it checks each variant's output
against the default's and reports the default, the best and SGLang's kernel (its decode kernel for width 1: what a
plain decode step runs); at W > 1 it also checks the default's output against SGLang's extend kernel.
``--sweep --defaults`` times (and checks) only the default and SGLang's kernel over the same cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .bench import csv_ints

ATOL = 2e-2               # bf16 inputs, fp32 accumulation
BLOCK = 16                # verify width B
# name: (query heads, KV heads, head dim, sliding window (keys a query may look back) or None, attention sinks)
SHAPES = {
    "qwen3-8b": (32, 8, 128, None, False),
    "gemma4-sliding": (16, 8, 256, 1023, False),   # Gemma-4-26B-A4B sliding layers (window 1024)
    "gemma4-global": (16, 2, 512, None, False),    # its global layers
    # gpt-oss-20b: every layer has sinks (one bf16 logit per query head); layers alternate window 128 (SGLang's
    # sliding_window_size = window - 1) and full attention. Sink layers ran SGLang's extend kernel until issue #44.
    "gptoss-sliding": (64, 8, 64, 127, True),
    "gptoss-full": (64, 8, 64, None, True),
}
BATCHES = (1, 8, 32, 64)
CONTEXTS = (512, 2048, 8192, 32768)
SWEEP_CONTEXTS = (256, 1024, 4096)            # --sweep: the serving benchmarks' short contexts up to a long one
MAX_POOL_TOKENS = 64 * 8192 * 2               # skip (bs, ctx) pairs past this many cached tokens (memory, time)
REFERENCE_MAX_TOKENS = 8 * 8192               # the torch reference is checked up to this many cached tokens


def make_sinks(hq: int, device="cuda", seed=1):
    """Per-head sink logits as gpt-oss's triton path holds them (bf16), of the order of the scores (N(0, 1) here), so
    ``--check`` sees them matter."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(hq, device=device, generator=gen) * 2 + 1).to(torch.bfloat16)


def make_verify_inputs(bs: int, ctx: int, hq: int, hkv: int, d: int, window, device="cuda", seed=0, width=BLOCK):
    """The tensors SGLang's backend passes for a verify of ``width`` tokens per request over ``ctx`` cached tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kept = min(ctx, window) if window is not None else ctx        # SGLang's window metadata keeps the last `window`
    slots = bs * ctx + width * bs
    k_pool = torch.randn(slots, hkv, d, device=device, dtype=torch.bfloat16, generator=gen)
    v_pool = torch.randn(slots, hkv, d, device=device, dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(slots, device=device, generator=gen)    # scattered slots, as after many requests
    starts = torch.arange(bs, device=device) * ctx
    kv_indices = perm[(starts[:, None] + (ctx - kept) + torch.arange(kept, device=device)).reshape(-1)]
    n = bs * width
    return dict(
        q=torch.randn(n, hq, d, device=device, dtype=torch.bfloat16, generator=gen),
        k_extend=torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=gen),
        v_extend=torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16, generator=gen),
        k_buffer=k_pool, v_buffer=v_pool,
        qo_indptr=torch.arange(bs + 1, device=device, dtype=torch.int32) * width,
        kv_indptr=torch.arange(bs + 1, device=device, dtype=torch.int32) * kept,
        kv_indices=kv_indices.to(torch.int64),
    )


def run_case(name, bs, ctx, check: bool):
    import triton

    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_dflash.kernels.reference import verify_attention_reference
    from sglang_dflash.kernels.verify_attention import verify_attention

    hq, hkv, d, window, has_sinks = SHAPES[name]
    t = make_verify_inputs(bs, ctx, hq, hkv, d, window)
    sinks = make_sinks(hq) if has_sinks else None
    sm_scale = d ** -0.5
    window_left = window if window is not None else -1
    ours_out = torch.empty_like(t["q"])
    sgl_out = torch.empty_like(t["q"])

    def ours():
        verify_attention(**t, max_q_len=BLOCK, sm_scale=sm_scale, window_left=window_left, out=ours_out, sinks=sinks)

    def sglang():
        extend_attention_fwd(t["q"], t["k_extend"], t["v_extend"], sgl_out, t["k_buffer"], t["v_buffer"],
                             t["qo_indptr"], t["kv_indptr"], t["kv_indices"], None, True, None, BLOCK, 1.0, 1.0,
                             sm_scale, sliding_window_size=window_left, sinks=sinks)

    ours(), sglang()
    torch.cuda.synchronize()
    row = dict(shape=name, bs=bs, ctx=ctx, hq=hq, hkv=hkv, head_dim=d, window=window, sinks=has_sinks)
    if check:
        row["err_vs_sglang"] = (ours_out.float() - sgl_out.float()).abs().max().item()
        if bs * ctx <= REFERENCE_MAX_TOKENS:
            ref = verify_attention_reference(**t, sm_scale=sm_scale, window_left=window_left, sinks=sinks)
            row["err_vs_reference"] = (ours_out.float() - ref.float()).abs().max().item()
    row["ours_us"] = 1e3 * triton.testing.do_bench_cudagraph(ours, rep=50)
    row["sglang_us"] = 1e3 * triton.testing.do_bench_cudagraph(sglang, rep=50)
    row["speedup"] = row["sglang_us"] / row["ours_us"]
    kv_bytes = t["kv_indices"].numel() * hkv * d * 2 * 2                 # K and V, bf16
    row["ours_GBps"] = kv_bytes / (row["ours_us"] * 1e-6) / 1e9
    del t
    torch.cuda.empty_cache()
    return row


def sweep_tiles(width: int, group: int, d: int):
    """Tile candidates (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M as tile_config sets it, the rest varied."""
    from sglang_dflash.kernels.verify_attention import tile_config

    block_m = tile_config(width, group, d, d)[0]
    block_ns = (32, 64, 128) if d <= 128 else (16, 32, 64) if d <= 256 else (16, 32)
    return [(block_m, n, w, st) for n in block_ns for w in (4, 8) for st in (2, 3)]


SWEEP_SPLITS = [dict(max_splits=1)] + [dict(max_splits=s, split_min=m) for s in (2, 4, 8, 16, 32) for m in (64, 256)]


def _sglang_decode(t, hq: int, hkv: int, sm_scale: float, out, sinks=None):
    """SGLang's triton decode attention as a plain decode step runs it (its split count rule, 8 splits at most)."""
    import triton

    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    bs, dv = t["q"].shape[0], t["v_buffer"].shape[-1]
    max_splits = 8                                   # --triton-attention-num-kv-splits default
    logits = torch.empty((bs, hq, max_splits, dv), dtype=torch.float32, device="cuda")
    lse = torch.empty((bs, hq, max_splits), dtype=torch.float32, device="cuda")
    num_splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    seq_lens = (t["kv_indptr"][1:] - t["kv_indptr"][:-1]).to(torch.int32)
    cores = torch.cuda.get_device_properties(0).multi_processor_count
    get_num_kv_splits_triton[(1,)](num_splits, seq_lens, bs, 1, hq, hkv, max_splits, cores,
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(bs)))

    def run():
        decode_attention_fwd(t["q"], t["k_buffer"], t["v_buffer"], out, t["kv_indptr"], t["kv_indices"], logits,
                             lse, num_splits, max_splits, sm_scale, 1.0, 1.0, sinks=sinks)
    return run


def sweep_case(name: str, bs: int, ctx: int, width: int, compile_only: bool = False, variants: bool = True,
               rep: int = 30):
    """Our kernel's default, every tile (default splits), every split bound (default tile) and the best of each
    together, against SGLang's kernel, on one case. ``compile_only`` runs each variant once (fills Triton's cache)."""
    import triton

    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang_dflash.kernels.verify_attention import verify_attention

    hq, hkv, d, window, has_sinks = SHAPES[name]
    t = make_verify_inputs(bs, ctx, hq, hkv, d, window, width=width)
    sinks = make_sinks(hq) if has_sinks else None
    sm_scale = d ** -0.5
    window_left = window if window is not None else -1
    ref_out = torch.empty_like(t["q"])
    out = torch.empty_like(t["q"])

    def ours(dst, **kw):
        return lambda: verify_attention(**t, max_q_len=width, sm_scale=sm_scale, window_left=window_left, out=dst,
                                        sinks=sinks, **kw)

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return 0.0 if compile_only else 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep)

    row = dict(shape=name, bs=bs, ctx=ctx, width=width, default_us=timed(ours(ref_out)), variants=[], mismatches=[])

    def variant(**kw):
        try:
            us = timed(ours(out, **kw))
        except Exception as e:          # a tile past the shared-memory or register budget: skip it
            row["variants"].append(dict(kw, error=type(e).__name__))
            return None
        err = (out.float() - ref_out.float()).abs().max().item()
        row["variants"].append(dict(kw, us=us, err=err))
        if not err <= ATOL:
            row["mismatches"].append(kw)
        return us

    if variants:
        tiles = [(tile, variant(tile=tile)) for tile in sweep_tiles(width, hq // hkv, d)]
        splits = [(kw, variant(**kw)) for kw in SWEEP_SPLITS]
        if compile_only:
            return row
        best_tile = min((x for x in tiles if x[1] is not None), key=lambda x: x[1])[0]
        best_split = min((x for x in splits if x[1] is not None), key=lambda x: x[1])[0]
        variant(tile=best_tile, **best_split)
    row["best"] = min((v for v in row["variants"] if "us" in v), key=lambda v: v["us"],
                      default=dict(default=True, us=row["default_us"]))
    sgl_out = torch.empty_like(t["q"])
    if width == 1:
        row["sglang_decode_us"] = timed(_sglang_decode(t, hq, hkv, sm_scale, sgl_out, sinks))
    else:
        row["sglang_extend_us"] = timed(lambda: extend_attention_fwd(
            t["q"], t["k_extend"], t["v_extend"], sgl_out, t["k_buffer"], t["v_buffer"], t["qo_indptr"],
            t["kv_indptr"], t["kv_indices"], None, True, None, width, 1.0, 1.0, sm_scale,
            sliding_window_size=window_left, sinks=sinks))
        # the same function: our default's output against SGLang's (the decode kernel at W = 1 is not: in a plain
        # step the token's own K/V is in the pool, here it comes separately)
        row["err_vs_sglang"] = (ref_out.float() - sgl_out.float()).abs().max().item()
        if not compile_only and not row["err_vs_sglang"] <= ATOL:
            row["mismatches"].append("default vs sglang")
    del t
    torch.cuda.empty_cache()
    return row


def sweep_cases(args, names):
    batches = csv_ints(args.batches) if args.batches else BATCHES
    contexts = csv_ints(args.contexts) if args.contexts else SWEEP_CONTEXTS
    return [(name, bs, ctx, width) for name in names for width in csv_ints(args.widths) for bs in batches
            for ctx in contexts if bs * ctx <= MAX_POOL_TOKENS]


def sweep_main(args, names) -> int:
    cases = sweep_cases(args, names)
    if args.compile_shard:                  # "i/n": compile every n-th case from i, time nothing
        i, n = (int(x) for x in args.compile_shard.split("/"))
        for case in cases[i::n]:
            sweep_case(*case, compile_only=True, variants=not args.defaults)
        return 0
    rows = []
    print(f"# sweep: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'shape':15} {'W':>2} {'bs':>3} {'ctx':>6} {'default us':>10} {'best us':>8} {'sglang us':>9}  best")
    for case in cases:
        row = sweep_case(*case, variants=not args.defaults)
        rows.append(row)
        best = {k: v for k, v in row["best"].items() if k not in ("us", "err")}
        sgl = row.get("sglang_decode_us", row.get("sglang_extend_us"))
        print(f"{row['shape']:15} {row['width']:>2} {row['bs']:>3} {row['ctx']:>6} {row['default_us']:10.1f} "
              f"{row['best']['us']:8.1f} {sgl:9.1f}  {best}"
              + (f"  MISMATCH {row['mismatches']}" if row["mismatches"] else ""), flush=True)
        if args.json:                       # rewritten after every case: a cut-off run keeps what it measured
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 1 if any(r["mismatches"] for r in rows) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare outputs too; exit 1 on a mismatch > ATOL")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--quick", action="store_true", help="bs 1 and 32, contexts 2048 and 32768 only")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    ap.add_argument("--sweep", action="store_true", help="tune: tiles and split bounds per case (see above)")
    ap.add_argument("--defaults", action="store_true", help="--sweep: time only the default configuration (and "
                    "SGLang's kernel) per case")
    ap.add_argument("--widths", default="16", help="--sweep: query tokens per request, comma list")
    ap.add_argument("--batches", help="--sweep: batch sizes, comma list (default 1,8,32,64)")
    ap.add_argument("--contexts", help="--sweep: cached tokens per request, comma list (default 256,1024,4096)")
    ap.add_argument("--compile-shard", help="--sweep: I/N compiles every N-th case from I and times nothing (run N "
                    "of these in parallel first: the timed sweep then finds every kernel in Triton's cache)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU (none visible). Fix: run it on the GPU machine", file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}. Fix: pick from {list(SHAPES)}", file=sys.stderr)
        return 2
    if args.sweep:
        return sweep_main(args, names)
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
