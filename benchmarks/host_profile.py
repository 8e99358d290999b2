"""Whose Python does a host-bound decode step wait for? A sampling profile (py-spy) of the scheduler under load.

    python -m benchmarks.host_profile --target T --draft D --methods none,builtin,ours-fixed --concurrency 1 \
        --seconds 25 --out DIR [--py-spy /path/py-spy] [driver arguments: --common-args ...]

The torch profiler (``profile_step``) times annotated ranges, but its per-launch overhead inflates every step and it
cannot see inside SGLang's functions. py-spy samples the Python stacks of the running server from outside, at a
fixed rate, with no instrumentation: for each method the server runs under ``py-spy record --subprocesses`` (it is
py-spy's child, so no ptrace permission beyond the default is needed), ``--concurrency`` closed-loop greedy
requests keep it in decode (``profile_step.Load``), then py-spy is stopped with SIGINT and writes its samples.

The summary keeps the scheduler's event loop only (samples whose stack passes through ``event_loop_*``) and gives,
per function, its inclusive and self share of the loop's samples. With the server's own decode-log step time
(``step_times``, same window) a share becomes host milliseconds per step. Startup and graph capture fall outside
the loop and are left out.

Output per method: ``DIR/<method>.pyspy.txt.gz`` (py-spy's raw collapsed stacks: a flamegraph tool reads them),
``DIR/<method>.server.log.gz``; and ``DIR/host_profile.json`` / ``.md`` for all methods.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

from sglang_dflash.testing import Server

from . import driver
from .profile_step import Load, _post
from .step_times import read_log, step_ms

LOOP_PREFIX = "event_loop"  # Scheduler.event_loop_overlap / event_loop_normal (and their PP / disagg variants)


def _function(frame: str) -> str:
    """'name (path/file.py:123)' -> 'name (file.py)': one key per function, whatever line was running."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({Path(path).name})" if path else name


def parse_raw(lines) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one 'frame;frame;...;frame COUNT' line per distinct stack, outermost frame first."""
    out = []
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def summarise(stacks: list[tuple[list[str], int]], top: int = 40) -> dict:
    """Inclusive and self samples per function inside the scheduler's event loop, as shares of the loop's samples."""
    inclusive, own, loop_total = Counter(), Counter(), 0
    for frames, n in stacks:
        at = next((i for i, f in enumerate(frames) if f.startswith(LOOP_PREFIX)), None)
        if at is None:
            continue
        loop_total += n
        inner = [_function(f) for f in frames[at + 1:]]
        for fn in set(inner):  # once per sample, however deep a recursion goes
            inclusive[fn] += n
        if inner:
            own[inner[-1]] += n
    if not loop_total:
        return {"loop_samples": 0, "functions": []}
    rows = [{"function": fn, "inclusive": round(c / loop_total, 4), "self": round(own[fn] / loop_total, 4)}
            for fn, c in inclusive.most_common(top)]
    return {"loop_samples": loop_total, "functions": rows}


def markdown(results: dict, top: int = 25) -> str:
    lines = []
    for method, r in results.items():
        if "functions" not in r:
            lines += [f"## {method}", "", f"skipped: {r.get('skipped', r)}", ""]
            continue
        ms = r.get("step_ms")
        lines += [f"## {method}", "", f"{r['loop_samples']} samples in the scheduler loop; step "
                  f"{ms:.2f} ms (decode log)" if ms else f"{r['loop_samples']} samples in the scheduler loop", "",
                  "| function | inclusive | self | inclusive ms/step |", "|---|---|---|---|"]
        for row in r["functions"][:top]:
            per_step = f"{row['inclusive'] * ms:.3f}" if ms else "-"
            lines.append(f"| `{row['function']}` | {row['inclusive']:.1%} | {row['self']:.1%} | {per_step} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def profile_method(args, dargs, method: str, out: Path) -> dict:
    raw = out / f"{method}.pyspy.txt"
    argv = [args.py_spy, "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw", "-o", str(raw),
            "--"] + driver.server_argv(dargs, method)
    log = out / f"{method}.server.log"
    srv = Server(argv, log, dargs.port, dargs.host, driver.server_env(dargs, method))
    c = int(args.concurrency)
    try:
        srv.start()
        try:
            print(f"[host] {method}: healthy after {srv.wait_healthy(args.wait_s, poll_s=2.0):.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as e:
            return {"skipped": str(e).splitlines()[0], "log_tail": srv.log_tail()}
        load = Load(srv.url, c, args.prompt_len, args.max_new_tokens, args.vocab)
        load.start()
        time.sleep(args.seconds)
        os.kill(srv.pid, signal.SIGINT)  # py-spy stops sampling and writes its file; the server keeps running
        for _ in range(60):
            if raw.exists() and raw.stat().st_size and srv.proc.poll() is not None:
                break
            time.sleep(1)
        load.close()
    finally:
        try:
            _post(srv.url + "/abort_request", {"abort_all": True}, timeout=10)
        except Exception:
            pass
        srv.stop(dargs.stop_wait_s)
    if not raw.exists():
        return {"skipped": "py-spy wrote no samples", "log_tail": srv.log_tail()}
    result = summarise(parse_raw(raw.read_text(errors="replace").splitlines()), args.top)
    times = step_ms(read_log(log))
    if c in times:
        result["step_ms"], result["step_log_lines"] = times[c]["ms"], times[c]["lines"]
    for path in (raw, log):  # keep them, compressed
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,builtin,ours-fixed")
    p.add_argument("--concurrency", default="1")
    p.add_argument("--seconds", type=float, default=25.0, help="sampling window under load (after /health)")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--wait-s", type=float, default=300)
    p.add_argument("--out", required=True)
    p.add_argument("--summarise", nargs="*", help="only summarise these raw py-spy files (no servers)")
    args, rest = p.parse_known_args(argv)
    if args.summarise:
        results = {}
        for f in args.summarise:
            opener = gzip.open if f.endswith(".gz") else open
            with opener(f, "rt", errors="replace") as fh:
                results[Path(f).name] = summarise(parse_raw(fh), args.top)
        print(markdown(results))
        return 0
    dargs = driver.parser().parse_args(rest + ["--out", args.out])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for method in args.methods.split(","):
        results[method] = profile_method(args, dargs, method, out)
        (out / "host_profile.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "host_profile.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
