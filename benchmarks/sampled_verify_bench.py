"""Micro-benchmark of the sampled verify for batches without top-k / top-p / min-p: the dense definition
(processed_probs(filtered=False) over [N x B, V] + verify_sampled) against verify_sampled_logits (issue #10 item 3).

    python -m benchmarks.sampled_verify_bench [--device cpu|cuda] [--vocab 151936] [--shapes 32x16,128x4,1x16]
                                               [--dtypes float32,bfloat16] [--reps 5] [--json OUT.json]

Inputs: logits [N, B, V] (N requests, block size B) in the given dtype, drafts = the argmax of each row half the time
(so acceptance lengths vary), temperatures in [0.5, 1.5]. Time: median over --reps calls after one warm-up (CUDA:
events around each call, synchronised). Peak: extra memory of one call over its inputs; on CUDA
torch.cuda.max_memory_allocated, on CPU the growth of the process's peak RSS (ru_maxrss) in a fresh subprocess per
case, whose inputs are built without temporaries larger than themselves (CPU figures are resident pages, so
allocator slack can add or hide a few MiB).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from sglang_dflash.acceptance import verify_sampled, verify_sampled_logits
from sglang_dflash.sampling import SamplingTensors, processed_probs

RULES = ("dense", "logits")


def make_inputs(n: int, b: int, v: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(n, b, v, dtype=dtype, device=device)
    for i in range(n):  # row by row: no float32 temporary of the whole tensor (it would inflate the CPU peak)
        logits[i] = torch.randn(b, v, generator=g, device=device) * 3
    argmax = logits[:, :-1].argmax(dim=-1)
    random = torch.randint(v, argmax.shape, generator=g, device=device)
    drafts = torch.where(torch.rand(argmax.shape, generator=g, device=device) < 0.5, argmax, random)
    temperature = torch.rand(n, generator=g, device=device) + 0.5
    return drafts, logits, temperature


def run_rule(rule: str, drafts, logits, temperature):
    if rule == "logits":
        return verify_sampled_logits(drafts, logits, temperature)
    n, b, v = logits.shape
    s = SamplingTensors(temperature, torch.full_like(temperature, v, dtype=torch.int64), torch.ones_like(temperature),
                        torch.zeros_like(temperature)).repeat_interleave(b)
    probs = processed_probs(logits.reshape(n * b, v), s, filtered=False).view(n, b, v)
    return verify_sampled(drafts, probs)


def measure(rule: str, n: int, b: int, v: int, dtype: str, device: str, reps: int) -> dict:
    """One case in this process: extra peak memory of the first call (MiB), then the median time of reps calls (ms)."""
    torch.manual_seed(0)
    drafts, logits, temperature = make_inputs(n, b, v, getattr(torch, dtype), device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run_rule(rule, drafts, logits, temperature)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run_rule(rule, drafts, logits, temperature)
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # KiB on Linux
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_rule(rule, drafts, logits, temperature)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            run_rule(rule, drafts, logits, temperature)
            times.append((time.perf_counter() - t0) * 1e3)
    return {"rule": rule, "n": n, "b": b, "v": v, "dtype": dtype, "device": device, "ms": statistics.median(times),
            "peak_mib": peak, "logits_mib": logits.numel() * logits.element_size() / 2**20}


def measure_isolated(rule, n, b, v, dtype, device, reps) -> dict:
    """CPU peak RSS only grows, so each case runs in a fresh interpreter; CUDA cases run here."""
    if device == "cuda":
        return measure(rule, n, b, v, dtype, device, reps)
    out = subprocess.run([sys.executable, "-m", "benchmarks.sampled_verify_bench", "--child",
                          json.dumps([rule, n, b, v, dtype, device, reps])], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--shapes", default="32x16,128x4,1x16", help="N x B cases, comma separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return 0
    rows = []
    print(f"device={args.device} V={args.vocab} threads={torch.get_num_threads()} reps={args.reps}")
    print(f"{'N':>4} {'B':>3} {'rows':>5} {'dtype':>9} {'logits MiB':>10} | {'dense ms':>9} {'logits ms':>9} "
          f"{'speedup':>7} | {'dense peak MiB':>14} {'logits peak MiB':>15}")
    for shape in args.shapes.split(","):
        n, b = (int(x) for x in shape.lower().split("x"))
        for dtype in args.dtypes.split(","):
            old, new = (measure_isolated(r, n, b, args.vocab, dtype, args.device, args.reps) for r in RULES)
            rows += [old, new]
            print(f"{n:>4} {b:>3} {n * b:>5} {dtype:>9} {old['logits_mib']:>10.1f} | {old['ms']:>9.2f} "
                  f"{new['ms']:>9.2f} {old['ms'] / new['ms']:>6.1f}x | {old['peak_mib']:>14.1f} "
                  f"{new['peak_mib']:>15.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
