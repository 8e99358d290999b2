"""Where does a decode step's time go? A torch-profiler trace of a loaded server, summarised per method.

    python -m benchmarks.profile_step --target T --draft D [--dummy] --methods ours,builtin,none \
        --concurrency 1,32 --steps 40 --out DIR

For each method the server (same arguments as ``benchmarks.driver``) is driven by ``--concurrency`` closed-loop
greedy requests that stay in decode; once they run, SGLang's ``/start_profile`` records ``--steps`` forward steps
(CPU + GPU). The trace is then reduced to what tells a slow step apart:

- wall time per step vs GPU busy time per step (a step that is GPU-bound has busy ~ wall; idle GPU means the host
  is the bottleneck: launches, Python, or a synchronisation that stops overlap scheduling from hiding them);
- host synchronisations (``cuda*Synchronize``, blocking copies) with the op and ``dflash.*`` phase around them;
- the kernels that take the GPU time, and the ``dflash.*`` phases (step, draft, verify, accept) on CPU and GPU;
- host time per step by annotated range: SGLang's scheduler loop (``scheduler.*``), its forward (``step[...]``) and
  our worker (``dflash.*``), which says whose Python a host-bound step waits for.

Output: ``DIR/profile_summary.json`` and ``DIR/profile_summary.md``; the raw traces stay in ``DIR/traces``.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures as cf
import gzip
import json
import random
import re
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from sglang_dflash.testing import Server

from . import driver

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CONTEXT_CATS = {"cpu_op", "user_annotation"}
HOST_RANGES = ("scheduler.", "dflash.", "step[")


def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    try:
        return json.loads(raw)
    except ValueError:
        return {"text": raw.decode(errors="replace")}


class Load:
    """``n`` closed-loop clients that keep requests in decode until stopped."""

    def __init__(self, url: str, n: int, prompt_len: int, max_new: int, vocab: int):
        self.url, self.n, self.prompt_len, self.max_new, self.vocab = url, n, prompt_len, max_new, vocab
        self.stop = threading.Event()
        self.pool = cf.ThreadPoolExecutor(n)
        self.futures = []

    def _client(self, k: int) -> None:
        rng = random.Random(k)
        while not self.stop.is_set():
            ids = [rng.randrange(100, self.vocab) for _ in range(self.prompt_len)]
            try:
                _post(self.url + "/generate", {"input_ids": ids, "sampling_params": {
                    "temperature": 0, "max_new_tokens": self.max_new, "ignore_eos": True}})
            except Exception:
                if self.stop.is_set():
                    return
                time.sleep(0.5)

    def start(self) -> None:
        self.futures = [self.pool.submit(self._client, k) for k in range(self.n)]

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------- trace analysis
def _union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered length and the idle gaps between covered stretches (all in microseconds)."""
    total, gaps, end = 0.0, [], None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, gaps


def summarise_trace(path: Path, steps: int) -> dict:
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"error": f"no GPU events in {path.name}"}
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    busy, gaps = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    kernels = defaultdict(lambda: [0, 0.0])
    for e in gpu:
        k = kernels[e["name"][:90]]
        k[0] += 1
        k[1] += e["dur"]
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]

    # context ops per host thread, sorted by start, to name what encloses a synchronisation
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in CONTEXT_CATS:
            by_thread[(e["pid"], e["tid"])].append(e)
    for v in by_thread.values():
        v.sort(key=lambda e: e["ts"])
    starts = {k: [e["ts"] for e in v] for k, v in by_thread.items()}

    def enclosing(e) -> list[str]:
        key = (e["pid"], e["tid"])
        v = by_thread.get(key, [])
        i = bisect.bisect_right(starts.get(key, []), e["ts"])
        names = [c["name"] for c in v[max(0, i - 400):i] if c["ts"] + c["dur"] >= e["ts"] + e["dur"]]
        return names[-4:]

    syncs = defaultdict(lambda: {"count": 0, "total_us": 0.0})
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    for e in runtime:
        if any(e["name"].startswith(n) for n in SYNC_NAMES) or (e["name"] == "cudaMemcpyAsync" and e["dur"] > 30):
            ctx = " < ".join(reversed(enclosing(e))) or "-"
            s = syncs[f"{e['name']} @ tid {e['tid']} in {ctx}"]
            s["count"] += 1
            s["total_us"] += e["dur"]
    launches = defaultdict(int)
    for e in runtime:
        if e["name"] in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                         "cudaLaunchKernelExC"):
            launches[e["name"]] += 1
    # CUDA graphs by size: GPU work items per replay (matched by correlation id) and the host time of its launch,
    # which grows with the graph (under the profiler much more than without it)
    graph_launch = {e["args"]["correlation"]: e for e in runtime
                    if e["name"] == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    nodes = defaultdict(int)
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        if c in graph_launch:
            nodes[c] += 1
    graphs = defaultdict(list)
    for c, n in nodes.items():
        graphs[n].append(graph_launch[c]["dur"])

    # dflash.* phases on CPU and GPU; and host time per step by annotated range: SGLang's scheduler loop
    # (scheduler.*), its forward (step[...]) and our worker (dflash.*), a range nested in another counting in both
    phases = defaultdict(lambda: {"cpu_us": [], "gpu_us": []})
    host = defaultdict(lambda: [0, 0.0])
    for e in events:
        name, cat = e["name"], e.get("cat")
        if name.startswith("dflash."):
            phases[name]["gpu_us" if cat == "gpu_user_annotation" else "cpu_us"].append(e["dur"])
        if cat == "user_annotation" and name.startswith(HOST_RANGES):
            h = host[re.sub(r"bs=\d+", "bs=N", name)]
            h[0] += 1
            h[1] += e["dur"]
    wall = t1 - t0
    return {
        "trace": path.name,
        "steps": steps,
        "wall_ms": wall / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_fraction": busy / wall if wall else None,
        "wall_ms_per_step": wall / 1e3 / steps,
        "gpu_busy_ms_per_step": busy / 1e3 / steps,
        "idle_gaps_over_50us": {"count": sum(g > 50 for g in gaps), "total_ms": sum(g for g in gaps if g > 50) / 1e3,
                                "largest_ms": sorted((round(g / 1e3, 3) for g in gaps), reverse=True)[:8]},
        "launches_per_step": {k: v / steps for k, v in launches.items()},
        "eager_launches_per_step": sum(v for k, v in launches.items() if k != "cudaGraphLaunch") / steps,
        "graphs": [{"nodes": n, "replays": len(d), "launch_host_ms_mean": sum(d) / len(d) / 1e3}
                   for n, d in sorted(graphs.items())],
        "top_kernels": [{"name": n, "count": c, "total_ms": t / 1e3, "ms_per_step": t / 1e3 / steps}
                        for n, (c, t) in top],
        "syncs": sorted(({"where": k, "count": v["count"], "total_ms": v["total_us"] / 1e3}
                         for k, v in syncs.items()), key=lambda d: -d["total_ms"])[:25],
        "host_ms_per_step": {n: {"count": c, "ms_per_step": t / 1e3 / steps}
                             for n, (c, t) in sorted(host.items(), key=lambda kv: -kv[1][1])},
        "phases": {k: {"n": len(v["cpu_us"]),
                       "cpu_ms_mean": (sum(v["cpu_us"]) / len(v["cpu_us"]) / 1e3) if v["cpu_us"] else None,
                       "gpu_ms_mean": (sum(v["gpu_us"]) / len(v["gpu_us"]) / 1e3) if v["gpu_us"] else None}
                   for k, v in sorted(phases.items())},
    }


def markdown(results: dict) -> str:
    lines = ["| method | wall ms/step | GPU busy ms/step | busy % | idle gaps > 50 us (ms total) | graph launches/step "
             "| eager launches/step | graphs: GPU nodes (host ms per launch) |", "|---|---|---|---|---|---|---|---|"]
    for m, r in results.items():
        if "wall_ms_per_step" not in r:
            lines.append(f"| {m} | {r.get('error') or r.get('skipped')} | | | | | | |")
            continue
        lines.append(f"| {m} | {r['wall_ms_per_step']:.2f} | {r['gpu_busy_ms_per_step']:.2f} | "
                     f"{100 * r['gpu_busy_fraction']:.0f} | {r['idle_gaps_over_50us']['total_ms']:.1f} | "
                     f"{r['launches_per_step'].get('cudaGraphLaunch', 0):.1f} | "
                     f"{r.get('eager_launches_per_step', 0):.1f} | "
                     + ", ".join(f"{g['nodes']} ({g['launch_host_ms_mean']:.2f})" for g in r.get("graphs", [])
                                 if g["replays"] >= r["steps"] // 2) + " |")
    for m, r in results.items():
        if "top_kernels" not in r:
            continue
        lines += ["", f"## {m}", "", "phases (ms, mean): " + ", ".join(
            f"{k} cpu {v['cpu_ms_mean'] or 0:.2f} / gpu {v['gpu_ms_mean'] or 0:.2f}" for k, v in r["phases"].items()),
            "", "host (ms per step, nested ranges count in each): " + ", ".join(
                f"{n} {h['ms_per_step']:.2f}" for n, h in list(r.get("host_ms_per_step", {}).items())[:10]),
            "", "| kernel | per step (ms) | count |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['count']} |" for k in r["top_kernels"][:12]]
        lines += ["", "| host synchronisation (where) | count | total ms |", "|---|---|---|"]
        lines += [f"| {s['where'][:160]} | {s['count']} | {s['total_ms']:.2f} |" for s in r["syncs"][:12]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main
def _wait_for_trace(tdir: Path, timeout_s: float) -> Path | None:
    """The first trace file once its size has stopped changing (the profiler writes it after the last step)."""
    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        found = sorted(tdir.rglob("*.trace.json*"))
        sizes = [f.stat().st_size for f in found]
        if found and all(sizes) and sizes == last:
            return found[0]
        last = sizes
        time.sleep(2)
    return None


def _profile_level(args, srv, method: str, c: int, tdir: Path) -> dict:
    """One profiled window under a steady load of ``c`` requests; the load is aborted afterwards so the next level
    starts from an empty batch."""
    load = Load(srv.url, c, args.prompt_len, args.max_new_tokens, args.vocab)
    load.start()
    try:
        time.sleep(args.warmup_s)
        _post(srv.url + "/start_profile", {"output_dir": str(tdir), "num_steps": args.steps,
                                           "activities": ["CPU", "GPU"], "with_stack": False,
                                           "record_shapes": False})
        trace = _wait_for_trace(tdir, 180)
        if trace is None:
            return {"error": "no trace written within 180 s", "log_tail": srv.log_tail()}
        print(f"[profile] {method} c={c}: trace {trace.name} ({trace.stat().st_size / 1e6:.1f} MB)", flush=True)
        err = "?"
        for _ in range(3):
            try:
                return {"concurrency": c, **summarise_trace(trace, args.steps)}
            except (EOFError, OSError, ValueError) as e:  # still being written
                err = f"{type(e).__name__}: {e}"
                time.sleep(5)
        return {"error": f"unreadable trace: {err}"}
    finally:
        load.close()
        try:
            _post(srv.url + "/abort_request", {"abort_all": True}, timeout=30)
        except Exception:  # an older server without abort_all: the leftovers finish on their own
            pass
        time.sleep(2)


def profile_method(args, dargs, method: str, out: Path) -> dict:
    """{"<method> c=<c>": summary} for every level of ``--concurrency``, all on one server start."""
    argv, env = driver.server_argv(dargs, method), driver.server_env(dargs, method)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    env["SGLANG_TORCH_PROFILER_DIR"] = str(out / "traces" / method)
    srv = Server(argv, out / f"profile_{method}.server.log", dargs.port, dargs.host, env)
    try:
        srv.start()
        try:
            print(f"[profile] {method}: healthy after {srv.wait_healthy(args.wait_s, poll_s=2.0):.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as e:  # the message ends with the server's log tail
            why = str(e).splitlines()[0]
            print(f"[profile] {method}: {why}", flush=True)
            return {f"{method} c={c}": {"skipped": why, "log_tail": srv.log_tail()} for c in levels}
        results = {}
        for c in levels:
            tdir = out / "traces" / method / f"c{c}"
            tdir.mkdir(parents=True, exist_ok=True)
            results[f"{method} c={c}"] = _profile_level(args, srv, method, c, tdir)
        return results
    finally:
        srv.stop(dargs.stop_wait_s)


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The options of the closed-loop load (``Load``) and the server wait, shared with ``host_profile``."""
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--wait-s", type=float, default=300)
    p.add_argument("--out", required=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="ours,builtin")
    p.add_argument("--concurrency", default="32", help="comma-separated levels, each profiled on the same server")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-s", type=float, default=12.0)
    add_load_args(p)
    p.add_argument("--summarise", nargs="*", help="only summarise these trace files (no servers)")
    args, rest = p.parse_known_args(argv)
    if args.summarise:
        print(json.dumps({f: summarise_trace(Path(f), args.steps) for f in args.summarise}, indent=1))
        return 0
    dargs = driver.parser().parse_args(rest + ["--out", args.out])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for method in args.methods.split(","):
        results.update(profile_method(args, dargs, method, out))
        (out / "profile_summary.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "profile_summary.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
