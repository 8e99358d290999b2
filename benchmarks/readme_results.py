"""The README's one results table and one plot, from committed benchmark results (no GPU, no server).

    python -m benchmarks.readme_results          # writes docs/results.png, prints the Markdown table

Two runs on one H100, both `benchmarks.driver` side by side (plain decoding = `none`, SGLang's builtin DFLASH, ours
adaptive), greedy; their READMEs say how they were run:
- SmolLM2-135M-Instruct with the drafter we ship (real weights, real prompts): tok/s averaged over the gsm,
  HumanEval and MT-Bench sets at each concurrency (`results/smollm2-run8-h100/fourway`);
- the Qwen3-8B shape with random weights (`results/ttft-qwen3-8b-h100`, c = 1..128, plain run again last): a drafter
  that never guesses right, so it shows what a step costs, not a speedup.
And the measured speedups at a stated acceptance (issue #45): oracle drafts on random-weight targets with the
decisive chain head (`results/oracle-chain-h200`, the folder's README): every cost of a real step, drafts that a
drafter of that acceptance would make, outputs equal to plain decoding; `oracle_table()`, docs/results-oracle.png.
tests/test_readme.py checks that README.md carries `table()` and `oracle_table()` as printed here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOT = ROOT / "docs" / "results.png"
ORACLE_PLOT = ROOT / "docs" / "results-oracle.png"
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

# the runs with level warm-up, one H200 each: with SGLang's prefill CUDA graphs (its default, the presets'; 64+
# requests per level, warm-up 128 / 64 tokens), then the earlier ones with eager prefill (16+ requests, warm-up 32)
ORACLE_RUNS = (
    Run("Qwen3-8B shape, tau 6.5", "oracle-prefill-graphs-h200/qwen3-8b-tau6.5/summary.json",
        "Qwen3-8B-DFlash-b16's published acceptance"),
    Run("Gemma-4-26B-A4B shape, tau 7.8", "oracle-prefill-graphs-h200/gemma-4-26b-a4b-tau7.8/summary.json",
        "the seed's tau; random routing"),
    Run("Qwen3-8B shape, tau 6.5, eager prefill", "oracle-chain-h200/run2-qwen3-8b-tau6.5/summary.json",
        "Qwen3-8B-DFlash-b16's published acceptance"),
    Run("Gemma-4-26B-A4B shape, tau 7.8, eager prefill", "oracle-chain-h200/run2-gemma-4-26b-a4b-tau7.8/summary.json",
        "the seed's tau; random routing"),
)
ORACLE_PLOTTED = ORACLE_RUNS[:2]  # the plot shows the runs as users serve (prefill graphs on)
ORACLE_METHODS = (("ours-oracle", "ours (adaptive)"), ("ours-fixed-oracle", "ours-fixed (k = 15)"),
                  ("ours-k7-oracle", "ours, k = 7 pinned"))


def load_oracle(run: Run) -> tuple[dict, dict[int, dict[str, tuple[float, float]]]]:
    """(env, {concurrency: {method: (tok/s over the mean of the two plain runs, realised tau)}})."""
    summary = json.loads((RESULTS / run.summary).read_text())
    per_c = {}
    for row in summary["rows"]:
        ms = row["methods"]
        plain = (ms["none"]["output_tok_s"] + ms["none-rerun"]["output_tok_s"]) / 2
        per_c[row["concurrency"]] = {m: (ms[m]["output_tok_s"] / plain, ms[m]["tau"]) for m, _ in ORACLE_METHODS
                                     if m in ms}
    return summary["env"], dict(sorted(per_c.items()))


def oracle_table() -> str:
    rows = ["| target shape, full-block tau (device, date) | concurrency | ours (adaptive) / plain | "
            "ours-fixed / plain | ours k = 7 / plain | realised tau (adaptive, fixed or k = 7) |",
            "|---|---|---|---|---|---|"]
    for run in ORACLE_RUNS:
        env, per_c = load_oracle(run)
        for c, m in per_c.items():
            ratio = lambda method: f"{m[method][0]:.2f}" if method in m else "-"  # noqa: E731
            other = m.get("ours-fixed-oracle", m.get("ours-k7-oracle"))
            rows.append(f"| {run.label} ({device_and_date(env)}) | {c} | {ratio('ours-oracle')} | "
                        f"{ratio('ours-fixed-oracle')} | {ratio('ours-k7-oracle')} | {m['ours-oracle'][1]:.2f}, "
                        f"{other[1]:.2f} |")
    return "\n".join(rows) + "\n"


def oracle_plot(out: Path = ORACLE_PLOT) -> Path:
    def draw(ax, per_c, cs):
        for i, ((method, name), marker) in enumerate(zip(ORACLE_METHODS, "osD")):
            if all(method in per_c[c] for c in cs):  # one colour per method in every panel
                ax.plot(cs, [per_c[c][method][0] for c in cs], marker=marker, color=f"C{i}", label=name)
        ax.axhline(1.0, color="grey", lw=1, ls="--", label="plain decoding")
        ax.legend(fontsize=8)

    return _panels(ORACLE_PLOTTED, load_oracle, draw, "tok/s over plain decoding", lambda run, env: (
        f"{run.label} ({run.note})\noracle drafts, real step costs, random weights\n{device_and_date(env)}"), out)


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
    def draw(ax, per_c, cs):
        for (method, name), marker in zip(METHODS, "osD"):
            ax.plot(cs, [per_c[c][method] for c in cs], marker=marker, label=name)

    return _panels(RUNS, load, draw, "output tokens / s",
                   lambda run, env: f"{run.label}\n{run.note}\n{device_and_date(env)}", out)


def _panels(runs, load_run, draw, ylabel: str, title, out: Path) -> Path:
    """One panel per run against the concurrency (log2 axis): draw(ax, per_c, concurrencies) plots its lines,
    title(run, env) names it; the figure is saved to out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(11, 4.2))
    for ax, run in zip(axes, runs):
        env, per_c = load_run(run)
        cs = list(per_c)
        draw(ax, per_c, cs)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title(run, env), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(f"wrote {plot().relative_to(ROOT)}, {oracle_plot().relative_to(ROOT)}\n")
    print(table(), end="")
    print()
    print(oracle_table(), end="")
