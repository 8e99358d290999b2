"""Milliseconds per decode step from SGLang servers' own logs, without a profiler.

    python -m benchmarks.step_times DIR/none.server.log.gz DIR/ours.server.log.gz ... [--bs 1 8]

SGLang logs a "Decode batch" line every ``decode_log_interval`` (40) decode steps, with the running requests, the
mean accept length (speculative workers) and the generated tokens per second. One step then takes
``1000 / (gen throughput / accept len / bs)`` ms. Per log and batch size this prints 1000 / the median steps per
second over its lines, leaving out lines under ``--min-tok-s`` (idle windows between requests). A profiler's per-launch overhead changes
wall times between traces; these numbers come from the servers as they served (benchmarks/results/
fastpath-smollm2-h100, drafter-run6-smollm2-h100).
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
from pathlib import Path

DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+).*?(?:accept len: ([\d.]+).*?)?"
                         r"gen throughput \(token/s\): ([\d.]+)")


def step_ms(lines, min_tok_s: float = 50.0) -> dict[int, dict]:
    """{bs: {"ms": ms per step (1000 / median steps per second), "lines": log lines}} from a server log's lines."""
    per_bs: dict[int, list[float]] = {}
    for line in lines:
        m = DECODE_LINE.search(line)
        if not m or float(m.group(3)) <= min_tok_s:
            continue
        bs, accept, tok_s = int(m.group(1)), float(m.group(2) or 1.0), float(m.group(3))
        per_bs.setdefault(bs, []).append(tok_s / accept / bs)  # steps per second
    return {bs: {"ms": 1000.0 / statistics.median(v), "lines": len(v)} for bs, v in sorted(per_bs.items())}


def read_log(path: str | Path) -> list[str]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return f.readlines()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="server logs (.log or .log.gz); the name before .server.log labels a row")
    p.add_argument("--bs", type=int, nargs="+", default=[1, 8], help="batch sizes to report")
    p.add_argument("--min-tok-s", type=float, default=50.0)
    args = p.parse_args(argv)
    print("| log | " + " | ".join(f"bs {b} ms (lines)" for b in args.bs) + " |")
    print("|---|" + "---|" * len(args.bs))
    for log in args.logs:
        times = step_ms(read_log(log), args.min_tok_s)
        cells = [f"{times[b]['ms']:.2f} ({times[b]['lines']})" if b in times else "-" for b in args.bs]
        print(f"| {Path(log).name.split('.server.log')[0]} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
