"""Whose Python does a host-bound decode step wait for? A sampling profile (py-spy) of the scheduler under load.

    python -m benchmarks.host_profile --target T --draft D --methods none,builtin,ours-fixed --concurrency 1 \
        --seconds 25 --out DIR [--py-spy /path/py-spy] [driver arguments: --common-args ...]

The torch profiler (``profile_step``) times annotated ranges, but its per-launch overhead inflates every step and it
cannot see inside SGLang's functions. py-spy samples the Python stacks of the running server from outside, at a
fixed rate, with no instrumentation: for each method the server starts, ``--concurrency`` closed-loop greedy
requests keep it in decode (``profile_step.Load``), and ``py-spy record --pid <scheduler> --nonblocking`` samples
the scheduler process for ``--seconds`` (attaching needs ptrace rights: root, or CAP_SYS_PTRACE).

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
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

from sglang_dflash.testing import Server

from . import driver
from .profile_step import Load, _post, add_load_args
from .step_times import read_log, step_ms

LOOP_PREFIX = "event_loop"  # Scheduler.event_loop_overlap / event_loop_normal (and their PP / disagg variants)


def _function(frame: str) -> str:
    """'name (path/file.py:123)' -> 'name (file.py)': one key per function, whatever line was running."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({Path(path).name})" if path else name


def _is_loop(frame: str) -> bool:
    """py-spy names methods by class: 'Scheduler.event_loop_overlap (scheduler.py:1773)'."""
    return frame.partition(" (")[0].rsplit(".", 1)[-1].startswith(LOOP_PREFIX)


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
        at = next((i for i, f in enumerate(frames) if _is_loop(f)), None)
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


def scheduler_pid(root: int) -> int | None:
    """The scheduler process among the server's descendants (SGLang titles it ``sglang::scheduler``)."""
    import psutil

    for proc in psutil.Process(root).children(recursive=True):
        try:
            title = " ".join(proc.cmdline()) + " " + proc.name()
        except psutil.Error:
            continue
        if "scheduler" in title.lower():
            return proc.pid
    return None


def profile_method(args, dargs, method: str, out: Path) -> dict:
    raw, log = out / f"{method}.pyspy.txt", out / f"{method}.server.log"
    srv = Server(driver.server_argv(dargs, method), log, dargs.port, dargs.host, driver.server_env(dargs, method))
    c = int(args.concurrency)
    try:
        srv.start()
        try:
            print(f"[host] {method}: healthy after {srv.wait_healthy(args.wait_s, poll_s=2.0):.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as e:
            return {"skipped": str(e).splitlines()[0], "log_tail": srv.log_tail()}
        pid = scheduler_pid(srv.pid)
        # attached after start-up (sampling every process through start-up fell behind and stalled it);
        # --nonblocking: the scheduler is never paused for a sample, so the step times stay the server's own
        target = ["--pid", str(pid)] if pid else ["--pid", str(srv.pid), "--subprocesses"]
        load = Load(srv.url, c, args.prompt_len, args.max_new_tokens, args.vocab)
        load.start()
        try:
            time.sleep(args.warmup_s)
            subprocess.run([args.py_spy, "record", *target, "--rate", str(args.rate), "--format", "raw",
                            "--nonblocking", "--duration", str(int(args.seconds)), "-o", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=args.seconds + 120)
        finally:
            load.close()
    finally:
        try:
            _post(srv.url + "/abort_request", {"abort_all": True}, timeout=10)
        except Exception:
            pass
        srv.stop(dargs.stop_wait_s)
    if not raw.exists():
        return {"skipped": "py-spy wrote no samples", "log_tail": srv.log_tail()}
    result = with_step_time(summarise(parse_raw(raw.read_text(errors="replace").splitlines()), args.top), log, c)
    for path in (raw, log):  # keep them, compressed
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
    return result


def with_step_time(result: dict, log: Path | None, concurrency: int) -> dict:
    """The summary plus the server's own ms per decode step at this batch size (``step_times``), where logged."""
    times = step_ms(read_log(log)) if log is not None and log.exists() else {}
    if concurrency in times:
        result["step_ms"], result["step_log_lines"] = times[concurrency]["ms"], times[concurrency]["lines"]
    return result


def write_results(out: Path, results: dict) -> None:
    (out / "host_profile.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "host_profile.md").write_text(markdown(results))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="none,builtin,ours-fixed")
    p.add_argument("--concurrency", default="1")
    p.add_argument("--seconds", type=float, default=20.0, help="sampling window under load")
    p.add_argument("--warmup-s", type=float, default=8.0, help="load before sampling starts")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--top", type=int, default=60)
    add_load_args(p)
    p.add_argument("--summarise", nargs="*", help="only summarise these stored py-spy files (no servers) into --out")
    args, rest = p.parse_known_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    if args.summarise:  # re-read stored samples (and the server log beside each, for the step time)
        for f in map(Path, args.summarise):
            opener = gzip.open if f.suffix == ".gz" else open
            with opener(f, "rt", errors="replace") as fh:
                method = f.name.split(".pyspy")[0]
                results[method] = with_step_time(summarise(parse_raw(fh), args.top),
                                                 f.with_name(method + ".server.log.gz"), int(args.concurrency))
        write_results(out, results)
    else:
        dargs = driver.parser().parse_args(rest + ["--out", args.out])
        for method in args.methods.split(","):
            results[method] = profile_method(args, dargs, method, out)
            write_results(out, results)  # after every method: a later failure keeps the earlier ones
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
