"""Which prefills are slow, and does a kernel compile at that moment? A time-to-first-token probe (issue #34 item 1).

    python -m benchmarks.ttft_probe --target T --draft D [--dummy] --methods none,ours --out DIR \
        [driver arguments: --common-args ...]

``bench`` reports TTFT percentiles per concurrency level; a level whose requests arrive together is one or two
prefill batches, so its p50 can be one slow batch. This probe sends fixed groups of prompts (each group at once,
then waits for it), one new-token request per prompt (``max_new_tokens`` 1: its latency is the TTFT), twice per
group shape, and after every group lists the kernels Triton compiled meanwhile: each server gets its own fresh
``TRITON_CACHE_DIR``, where every compile leaves a directory with the kernel's name. A group that is slow the
first time and fast the second, with a kernel compiled in between, is a just-in-time compile on the request path.

Output: ``DIR/ttft_probe.json`` and ``.md`` (per method and group: TTFT of each request, kernels compiled),
``DIR/<method>.server.log.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import threading
import time
from pathlib import Path

from sglang_dflash.testing import Server

from . import driver
from .profile_step import _post

# (name, prompt lengths sent together); every shape runs twice in a row (first and second time)
GROUPS = [
    ("1 x 128", [128]),
    ("1 x 128, same prompt (radix hit)", None),
    ("8 x 128", [128] * 8),
    ("7 x 73", [73] * 7),
    ("1 x 515", [515]),
    ("1 x 517", [517]),
    ("16 x 128", [128] * 16),
    ("3 x 1000", [1000] * 3),
]


def compiled_kernels(cache: Path) -> set[str]:
    """Names of the kernels in a Triton cache dir (one sub-directory per compile, a JSON with the name inside)."""
    names = set()
    if not cache.exists():
        return names
    for meta in cache.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        names.add(f"{meta.parent.name[:8]}:{meta.stem}")
    return names


def send_group(url: str, prompts: list[list[int]]) -> list[float]:
    """All prompts at once, one new token each; each request's latency in ms."""
    out = [0.0] * len(prompts)

    def one(i):
        t0 = time.perf_counter()
        _post(url + "/generate", {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": 1,
                                                                             "temperature": 0}}, timeout=300)
        out[i] = (time.perf_counter() - t0) * 1e3

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def probe_method(args, dargs, method: str, out: Path) -> dict:
    log, cache = out / f"{method}.server.log", out / f"triton-{method}"
    shutil.rmtree(cache, ignore_errors=True)
    env = driver.server_env(dargs, method)
    env["TRITON_CACHE_DIR"] = str(cache)
    srv = Server(driver.server_argv(dargs, method), log, dargs.port, dargs.host, env)
    rng = random.Random(0)
    rows = []
    try:
        srv.start()
        try:
            print(f"[ttft] {method}: healthy after {srv.wait_healthy(dargs.wait_s, poll_s=2.0):.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as e:
            return {"skipped": str(e).splitlines()[0], "log_tail": srv.log_tail()}
        seen = compiled_kernels(cache)
        last = None
        for name, lens in GROUPS:
            for attempt in ("first", "second"):
                prompts = (last if lens is None else
                           [[rng.randrange(100, args.vocab) for _ in range(n)] for n in lens])
                ms = send_group(srv.url, prompts)
                now = compiled_kernels(cache)
                rows.append({"group": name, "attempt": attempt, "ttft_ms": [round(x, 1) for x in ms],
                             "new_kernels": sorted(now - seen)})
                seen = now
                last = prompts[:1]
                print(f"[ttft] {method} {name} ({attempt}): max {max(ms):.1f} ms, "
                      f"{len(rows[-1]['new_kernels'])} kernels compiled", flush=True)
    finally:
        srv.stop(dargs.stop_wait_s)
    if log.exists():
        with open(log, "rb") as src, gzip.open(str(log) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        log.unlink()
    return {"groups": rows}


def markdown(results: dict) -> str:
    lines = []
    for method, r in results.items():
        lines += [f"## {method}", ""]
        if "groups" not in r:
            lines += [f"skipped: {r.get('skipped')}", ""]
            continue
        lines += ["| group | attempt | TTFT ms (max) | TTFT ms (each) | kernels compiled meanwhile |",
                  "|---|---|---|---|---|"]
        for g in r["groups"]:
            each = " ".join(f"{x:.0f}" for x in g["ttft_ms"])
            lines.append(f"| {g['group']} | {g['attempt']} | {max(g['ttft_ms']):.1f} | {each} | "
                         f"{', '.join(g['new_kernels']) or '-'} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,ours")
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    args, rest = p.parse_known_args(argv)
    dargs = driver.parser().parse_args(rest)
    out = Path(dargs.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for method in args.methods.split(","):
        results[method] = probe_method(args, dargs, method, out)
        (out / "ttft_probe.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "ttft_probe.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
