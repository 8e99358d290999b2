"""The README's one results table and one plot, from committed benchmark results (no GPU, no server).

    python -m benchmarks.readme_results          # writes docs/results.png, prints the Markdown table

Two runs on one H100, both `benchmarks.driver` side by side (plain decoding = `none`, SGLang's builtin DFLASH, ours
adaptive), greedy; their READMEs say how they were run:
- SmolLM2-135M-Instruct with the drafter we ship (real weights, real prompts): tok/s averaged over the gsm,
  HumanEval and MT-Bench sets at each concurrency (`results/smollm2-run8-h100/fourway`);
- the Qwen3-8B shape with random weights (`results/ttft-qwen3-8b-h100`, c = 1..128, plain run again last): a drafter
  that never guesses right, so it shows what a step costs, not a speedup.
tests/test_readme.py checks that README.md carries `table()` as printed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOT = ROOT / "docs" / "results.png"
METHODS = (("none", "plain decoding"), ("builtin", "SGLang's builtin DFLASH"), ("ours", "ours (adaptive)"))


@dataclass(frozen=True)
class Run:
    label: str  # what the pair is, for the table and the panel title
    summary: str  # summary.json under benchmarks/results
    note: str  # one line under the panel title


RUNS = (
    Run("SmolLM2-135M-Instruct + our drafter", "smollm2-run8-h100/fourway/summary.json",
        "real weights; mean of gsm, HumanEval, MT-Bench prompts"),
    Run("Qwen3-8B shape, random weights", "ttft-qwen3-8b-h100/summary.json",
        "acceptance ~1: the cost of a step, not a speedup"),
)


def load(run: Run) -> tuple[dict, dict[int, dict[str, float]]]:
    """(env of the run, {concurrency: {method: mean greedy output tok/s over its datasets}})."""
    summary = json.loads((RESULTS / run.summary).read_text())
    per_c: dict[int, dict[str, list[float]]] = {}
    for row in summary["rows"]:
        if row["temperature"] != 0:
            continue
        for method, _ in METHODS:
            per_c.setdefault(row["concurrency"], {}).setdefault(method, []).append(
                row["methods"][method]["output_tok_s"])
    return summary["env"], {c: {m: sum(v) / len(v) for m, v in ms.items()} for c, ms in sorted(per_c.items())}


def device_and_date(env: dict) -> str:
    return f"{env['device'].split(',')[0]}, {env['date_utc'][:10]}"


def table() -> str:
    rows = ["| pair (device, date) | concurrency | plain tok/s | builtin tok/s | ours tok/s | ours / plain | "
            "ours / builtin |", "|---|---|---|---|---|---|---|"]
    for run in RUNS:
        env, per_c = load(run)
        for c, tok_s in per_c.items():
            rows.append(f"| {run.label} ({device_and_date(env)}) | {c} | {tok_s['none']:,.0f} | "
                        f"{tok_s['builtin']:,.0f} | {tok_s['ours']:,.0f} | {tok_s['ours'] / tok_s['none']:.2f} | "
                        f"{tok_s['ours'] / tok_s['builtin']:.2f} |")
    return "\n".join(rows) + "\n"


def plot(out: Path = PLOT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RUNS), figsize=(11, 4.2))
    for ax, run in zip(axes, RUNS):
        env, per_c = load(run)
        cs = list(per_c)
        for (method, name), marker in zip(METHODS, "osD"):
            ax.plot(cs, [per_c[c][method] for c in cs], marker=marker, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{run.label}\n{run.note}\n{device_and_date(env)}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(f"wrote {plot().relative_to(ROOT)}\n")
    print(table(), end="")
