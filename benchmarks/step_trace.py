"""Summarise a decode-step trace (SGLANG_DFLASH_STEP_TRACE=FILE on our server): what each width's steps cost.

    python -m benchmarks.step_trace trace.jsonl[.gz] [--json out.json] [--costs table.json]

Per (k, batch-size bucket): steps, median cycle of every step with one (no prefill inside), median of the cycles the
width controller attributed to the width (timed), the worker's own host time, and the table's last value. The
difference between "all cycles" and "timed" shows what the attribution rules leave out; the difference between the
table and the plain server's TPOT shows whether the policy prices k = 0 right.

The wall line splits the time from the first step to the last into decode cycles and cycles that held another
forward (a prefill), whose share says how much of a server's time its admissions take (gaps over IDLE_S, the server
idle between benchmark levels, are left out): 39-43% for the 8B shape's speculative servers with eager prefill,
36-38% with SGLang's prefill graphs (benchmarks/results/oracle-prefill-graphs-h200).

--costs writes the medians of the timed cycles as a fixed step-time table {k: {bucket: seconds}} for
SGLANG_DFLASH_STEP_COSTS: benchmark runs that load it make the same width choices from the same acceptance.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics

from sglang_dflash.serving.width_control import size_bucket


def _median(xs):
    return round(statistics.median(xs), 3) if xs else None


def summarise(rows: list[dict]) -> list[dict]:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[r["k"], size_bucket(r["bs"])].append(r)
    out = []
    # by bucket, then k, the tree (k = "tree", SGLANG_DFLASH_TREE) after the chain widths
    order = lambda kv: (kv[0][1], kv[0][0] == "tree", str(kv[0][0]).zfill(4))  # noqa: E731
    for (k, bucket), rs in sorted(groups.items(), key=order):
        after_same = [r["cycle_ms"] for r in rs if r["cycle_ms"] is not None and r["follows"] == [k, bucket]]
        out.append({
            "k": k, "bucket": bucket, "steps": len(rs),
            "cycle_ms_all": _median([r["cycle_ms"] for r in rs if r["cycle_ms"] is not None]),
            "cycle_ms_after_same_k": _median(after_same),
            "timed_ms": _median([r["timed_ms"] for r in rs if r["timed_ms"] is not None]),
            "host_ms": _median([r["host_ms"] for r in rs if r["host_ms"] is not None]),
            "table_ms_last": rs[-1]["table_ms"],
            "commit_mean": round(statistics.fmean(r["commit"] for r in rs if r["commit"] is not None), 3),
        })
    return out


IDLE_S = 0.5  # a gap between two steps longer than this is the server waiting for work, not a forward


def wall_split(rows: list[dict]) -> dict:
    """Seconds between consecutive steps, split by what the earlier one's cycle held: decode work alone
    (``cycle_ms`` set), or another forward too (``cycle_ms`` None: a prefill ran inside it); idle gaps left out."""
    decode = other = 0.0
    held = []
    for a, b in zip(rows, rows[1:]):
        gap = b["t"] - a["t"]
        if gap > IDLE_S:
            continue
        if a["cycle_ms"] is None:
            other += gap
            held.append(gap)
        else:
            decode += gap
    total = decode + other
    return {"busy_s": round(total, 3), "decode_s": round(decode, 3), "with_prefill_s": round(other, 3),
            "with_prefill_share": round(other / total, 3) if total else None, "with_prefill_cycles": len(held),
            "with_prefill_cycle_ms_median": _median([g * 1e3 for g in held])}


def step_costs(table: list[dict]) -> dict[str, dict[str, float]]:
    """{k: {bucket: seconds}} from the summary's timed medians (all cycles where a width was never timed)."""
    out: dict[str, dict[str, float]] = {}
    for t in table:
        ms = t["timed_ms"] if t["timed_ms"] is not None else t["cycle_ms_all"]
        if ms:
            out.setdefault(str(t["k"]), {})[str(t["bucket"])] = ms / 1e3
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", help="write the summary here too")
    ap.add_argument("--costs", help="write a fixed step-time table for SGLANG_DFLASH_STEP_COSTS here")
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open  # the committed traces are gzipped
    with opener(args.trace, "rt") as f:  # stdlib json: the GPU machine's interpreter has no orjson
        rows = [json.loads(line) for line in f if line.strip()]
    for head in (r for r in rows if "controls" in r):
        print(f"# {head['controls']}")
    steps = [r for r in rows if "k" in r]
    table = summarise(steps)
    wall = wall_split(steps)
    print(f"# wall: {wall['busy_s']} s of steps, {wall['decode_s']} s in decode cycles, {wall['with_prefill_s']} s "
          f"({wall['with_prefill_share']}) in {wall['with_prefill_cycles']} cycles that held a prefill "
          f"(median {wall['with_prefill_cycle_ms_median']} ms)")
    cols = list(table[0]) if table else []
    print(" | ".join(cols))
    for t in table:
        print(" | ".join(str(t[c]) for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
    if args.costs:
        with open(args.costs, "w") as f:
            json.dump(step_costs(table), f, indent=2)


if __name__ == "__main__":
    main()
