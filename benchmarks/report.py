"""Turn the per-method JSON files of one run folder into summary.json, summary.md and PNG plots.

    python -m benchmarks.report RUN_DIR [--baseline none] [--title "..."]

Reads ``RUN_DIR/<method>.json`` (benchmarks.bench; a file with ``"skipped"`` records a method the driver could not
run) and ``RUN_DIR/<method>.outputs.jsonl.gz`` (greedy outputs). Writes:

- ``summary.json``: per method and level the bench numbers, ratios to the baseline and to ``builtin``, the greedy
  cross-check against the baseline, and (for speculative methods) the step-cost ratio
  ``tau * plain_tok_s / spec_tok_s`` with the throughput it implies at reference tau values;
- ``summary.md``: the tables;
- ``tokps_<dataset>_T<t>.png`` (output tok/s vs concurrency per method) and ``tau_per_dataset.png``.

Acceptance (tau) from random-weight runs is shown only as "steps" with a warning: it says nothing about a drafter.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from . import stats

ORDER = ("none", "builtin", "ours")
RERUN = "-rerun"  # benchmarks/driver.py: a method run again (--bracket)
REFERENCE_TAUS = (3.0, 5.0, 6.5, 8.0)  # anchors.md: MT-Bench ~4.3, HumanEval ~6.6, GSM8K ~6.6, MATH-500 ~7.8 (Qwen3-8B)


def load_run(run_dir: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(results by method, skipped-method records by method)."""
    results, skipped = {}, {}
    for f in sorted(run_dir.glob("*.json")):
        if f.name.startswith("summary"):
            continue
        d = json.loads(f.read_text())
        if "method" not in d:
            continue
        (skipped if d.get("skipped") else results)[d["method"]] = d
    return results, skipped


def load_outputs(run_dir: Path, method: str) -> dict[tuple, list[int]]:
    f = run_dir / f"{method}.outputs.jsonl.gz"
    if not f.exists():
        return {}
    out = {}
    with gzip.open(f, "rt") as fh:
        for line in fh:
            g = json.loads(line)
            out[(g["dataset"], g["uid"], g["turn"], g["concurrency"], g.get("rep", 0))] = g["ids"]
    return out


def methods_in_order(results: dict) -> list[str]:
    return [m for m in ORDER if m in results] + sorted(m for m in results if m not in ORDER)


def level_key(l: dict) -> tuple:
    return (l["dataset"], float(l["temperature"]), int(l["concurrency"]))


def build_summary(run_dir: Path, baseline: str = "none") -> dict:
    results, skipped = load_run(run_dir)
    methods = methods_in_order(results)
    by = {m: {level_key(l): l for l in results[m]["levels"]} for m in methods}
    random_weights = any(r.get("random_weights") for r in results.values())
    rows = []
    keys = sorted({k for m in methods for k in by[m]})
    for k in keys:
        row = {"dataset": k[0], "temperature": k[1], "concurrency": k[2], "methods": {}}
        base = by.get(baseline, {}).get(k)
        builtin = by.get("builtin", {}).get(k)
        for m in methods:
            l = by[m].get(k)
            if l is None:
                continue
            e = {x: l.get(x) for x in ("output_tok_s", "tau", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                                       "tpot_ms_p99", "latency_ms_p50", "errors", "requests", "output_tokens")}
            if base and m != baseline and base.get("output_tok_s") and l.get("output_tok_s"):
                e["vs_baseline"] = round(l["output_tok_s"] / base["output_tok_s"], 3)
                if l.get("tau"):
                    ratio = stats.step_cost_ratio(base["output_tok_s"], l["output_tok_s"], l["tau"])
                    e["step_cost_ratio"] = round(ratio, 3)
                    e["break_even_tau"] = round(ratio, 3)
                    e["implied_speedup"] = {str(t): round(stats.implied_speedup(ratio, t), 2) for t in REFERENCE_TAUS}
            if builtin and m not in ("builtin", baseline) and builtin.get("output_tok_s") and l.get("output_tok_s"):
                e["vs_builtin"] = round(l["output_tok_s"] / builtin["output_tok_s"], 3)
            row["methods"][m] = e
        rows.append(row)

    # greedy cross-check against the baseline, per method and dataset
    cross = {}
    base_out = load_outputs(run_dir, baseline)
    for m in methods:
        if m == baseline or not base_out:
            continue
        other = load_outputs(run_dir, m)
        for d in sorted({k[0] for k in base_out}):
            b = {k: v for k, v in base_out.items() if k[0] == d}
            o = {k: v for k, v in other.items() if k[0] == d}
            cross.setdefault(m, {})[d] = stats.crosscheck(b, o)

    # tau per dataset and temperature, token-weighted over all concurrency levels
    taus = {}
    for m in methods:
        for l in results[m]["levels"]:
            if not l.get("verify_steps"):
                continue
            t = taus.setdefault(m, {}).setdefault(f"{l['dataset']}|T={l['temperature']:g}", [0, 0])
            t[0] += l["output_tokens"]
            t[1] += l["verify_steps"]
    tau_table = {m: {k: round(a / b, 3) for k, (a, b) in v.items()} for m, v in taus.items()}

    # a method run again after the others (the driver's --bracket): its ratio to the first run is the run's drift
    drift = {}
    for m in methods:
        base_m = m[:-len(RERUN)] if m.endswith(RERUN) else None
        if base_m in by:
            r = [by[m][k]["output_tok_s"] / by[base_m][k]["output_tok_s"] for k in by[m]
                 if by[base_m].get(k) and by[base_m][k].get("output_tok_s") and by[m][k].get("output_tok_s")]
            if r:
                drift[m] = {"of": base_m, "min": round(min(r), 3), "max": round(max(r), 3), "levels": len(r)}

    first = results[methods[0]] if methods else {}
    return {"run_dir": str(run_dir), "baseline": baseline, "methods": methods, "random_weights": random_weights,
            "skipped": {m: s["skipped"] for m, s in skipped.items()},
            "env": first.get("env"), "servers": {m: results[m].get("server") for m in methods},
            "commands": {m: results[m].get("command") for m in methods},
            "driver": (json.loads((run_dir / "driver.json").read_text()) if (run_dir / "driver.json").exists()
                       else first.get("driver")),
            "notes": sorted({n for r in results.values() for n in r.get("notes", [])}),
            "rows": rows, "crosscheck": cross, "tau": tau_table, "drift": drift}


def _fmt(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(s: dict, title: str = "Benchmark") -> str:
    ms = s["methods"]
    spec = [m for m in ms if m != s["baseline"]]
    L = [f"# {title}", ""]
    env = s.get("env") or {}
    L.append(f"Date {env.get('date_utc')}; device {env.get('device')}; sglang {env.get('sglang')}, torch "
             f"{env.get('torch')}, transformers {env.get('transformers')}, sglang_dflash {env.get('sglang_dflash')}.")
    L.append("")
    if s["random_weights"]:
        L += ["**Random weights (dummy load): acceptance is meaningless here.** The tau column is the measured "
              "tokens per verify step (~1: only the bonus token survives) and is used only to derive the "
              "step-cost ratio = how many plain decode steps one speculative step costs; `x at tau=T` is the "
              "throughput over plain decoding that a drafter reaching tau T would give at that cost.", ""]
    for m, why in s["skipped"].items():
        L.append(f"- **{m}: not run** - {why}")
    for n in s["notes"]:
        L.append(f"- {n}")
    for m, d in (s.get("drift") or {}).items():
        L.append(f"- **Drift of this run:** `{m}` is `{d['of']}`'s server run again after the others; its tok/s is "
                 f"{d['min']:.2f}-{d['max']:.2f}x the first run's over {d['levels']} levels. Ratios between methods "
                 "inside that range are not results.")
    L.append("")
    head = ["dataset", "T", "c"] + [f"{m} tok/s" for m in ms]
    for m in spec:
        head += [f"{m} tau", f"{m}/{s['baseline']}"]
        if m not in ("builtin",) and "builtin" in ms:
            head.append(f"{m}/builtin")
        if s["random_weights"]:
            head += [f"{m} step cost", f"{m} x at tau=6.5"]
    L += ["## Throughput", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in s["rows"]:
        mm = r["methods"]
        cells = [r["dataset"], f"{r['temperature']:g}", str(r["concurrency"])]
        cells += [_fmt(mm.get(m, {}).get("output_tok_s")) for m in ms]
        for m in spec:
            e = mm.get(m, {})
            cells += [_fmt(e.get("tau"), 3), _fmt(e.get("vs_baseline"), 2) + ("x" if e.get("vs_baseline") else "")]
            if m not in ("builtin",) and "builtin" in ms:
                cells.append(_fmt(e.get("vs_builtin"), 2))
            if s["random_weights"]:
                cells += [_fmt(e.get("step_cost_ratio"), 2), _fmt((e.get("implied_speedup") or {}).get("6.5"), 2)]
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "## Latency (ms): TPOT p50 / p99, TTFT p50 / p99", "",
          "| dataset | T | c | " + " | ".join(f"{m} TPOT" for m in ms) + " | " + " | ".join(f"{m} TTFT" for m in ms)
          + " |", "|" + "---|" * (3 + 2 * len(ms))]
    for r in s["rows"]:
        mm = r["methods"]
        tp = [f"{_fmt(mm.get(m, {}).get('tpot_ms_p50'), 2)} / {_fmt(mm.get(m, {}).get('tpot_ms_p99'), 2)}" for m in ms]
        tt = [f"{_fmt(mm.get(m, {}).get('ttft_ms_p50'), 1)} / {_fmt(mm.get(m, {}).get('ttft_ms_p99'), 1)}" for m in ms]
        L.append(f"| {r['dataset']} | {r['temperature']:g} | {r['concurrency']} | " + " | ".join(tp + tt) + " |")
    if s["tau"]:
        L += ["", "## tau per dataset (token-weighted over all concurrencies)" +
              (" - random weights: NOT acceptance" if s["random_weights"] else ""), ""]
        cols = sorted({k for v in s["tau"].values() for k in v})
        L += ["| method | " + " | ".join(cols) + " |", "|" + "---|" * (1 + len(cols))]
        for m, v in s["tau"].items():
            L.append(f"| {m} | " + " | ".join(_fmt(v.get(c), 3) for c in cols) + " |")
    if s["crosscheck"]:
        L += ["", f"## Greedy cross-check against `{s['baseline']}` (same prompt, same concurrency)", "",
              "| method | dataset | compared | identical | mean common-prefix fraction | first mismatch |",
              "|---|---|---|---|---|---|"]
        for m, per in s["crosscheck"].items():
            for d, c in per.items():
                fm = c.get("first_mismatch")
                fm_s = "-" if not fm else f"{fm['key'][1]} turn {fm['key'][2]} c={fm['key'][3]} at token {fm['position']}"
                L.append(f"| {m} | {d} | {c['compared']} | {c['exact']} ({_fmt(c['exact_frac'], 3)}) | "
                         f"{_fmt(c['prefix_frac'], 3)} | {fm_s} |")
        L += ["", "Mismatches are leads, not verdicts: bf16 ties in the baseline's top-2 logits and the baseline's own "
              "batch non-invariance also change greedy outputs."]
    L += ["", "## Commands", ""]
    if not s.get("driver"):
        for m, c in s["commands"].items():
            L.append(f"- `{m}`: `{c}`")
    else:
        L.append(f"- driver: `{s['driver'].get('command')}`")
        for m, sc in (s["driver"].get("server_commands") or {}).items():
            L.append(f"  - {m} server: `{sc}`")
    return "\n".join(L) + "\n"


def plots(s: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    groups = sorted({(r["dataset"], r["temperature"]) for r in s["rows"]})
    for d, t in groups:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in s["methods"]:
            pts = [(r["concurrency"], r["methods"][m]["output_tok_s"]) for r in s["rows"]
                   if r["dataset"] == d and r["temperature"] == t and m in r["methods"]
                   and r["methods"][m].get("output_tok_s")]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{d}, T={t:g}" + (" (random weights: cost only)" if s["random_weights"] else ""))
        ax.grid(True, alpha=0.3)
        ax.legend()
        f = out / f"tokps_{d}_T{t:g}.png"
        fig.tight_layout()
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    if s["tau"]:
        cols = sorted({k for v in s["tau"].values() for k in v})
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(cols)), 4))
        w = 0.8 / max(len(s["tau"]), 1)
        for i, (m, v) in enumerate(s["tau"].items()):
            ax.bar([j + i * w for j in range(len(cols))], [v.get(c, 0) for c in cols], width=w, label=m)
        ax.set_xticks([j + w * (len(s["tau"]) - 1) / 2 for j in range(len(cols))])
        ax.set_xticklabels(cols, rotation=20)
        ax.set_ylabel("tau (tokens per verify step)")
        ax.set_title("tau per dataset" + (" - RANDOM WEIGHTS, not acceptance" if s["random_weights"] else ""))
        ax.legend()
        fig.tight_layout()
        f = out / "tau_per_dataset.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--baseline", default="none")
    p.add_argument("--title", default="Benchmark")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    s = build_summary(a.run_dir, a.baseline)
    (a.run_dir / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    (a.run_dir / "summary.md").write_text(markdown(s, a.title))
    files = []
    if not a.no_plots:
        try:
            files = plots(s, a.run_dir)
        except ImportError as e:  # the GPU image may lack matplotlib: plot later on another machine
            print(f"[report] no plots ({e}); run `python -m benchmarks.report {a.run_dir}` where matplotlib exists")
    print(f"[report] wrote {a.run_dir / 'summary.json'}, {a.run_dir / 'summary.md'}"
          + "".join(f", {f.name}" for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
