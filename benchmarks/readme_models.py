"""The README's Models table: one row per launch preset, from committed results only (no GPU, no server).

    python -m benchmarks.readme_models          # prints the Markdown table

Two sources per preset: the seed smoke job's record (`results/seed-recipes/<recipe>.json`, benchmarks/seed_recipes.py:
the preset's own command with --dummy), and earlier runs of the preset's shape with the driver's flags (EARLIER:
summary.json files of benchmarks.driver runs). A preset with neither says "not run on a GPU yet".
tests/test_readme.py checks that README.md carries `table()` as printed here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .seed_recipes import RECIPES, device_and_date, load_records, server_log, start_failure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SEED = RESULTS / "seed-recipes"
PRESETS = ("qwen3-8b", "llama3.1-8b-instruct", "gemma-4-26b-a4b-it", "gemma-4-31b-it", "qwen3.5-35b-a3b",
           "gpt-oss-20b", "smollm2-135m", "gemma-3-270m")
_REDRAWN = ("weights re-drawn like a model's (outputs depend on the prompt): builtin and ours part from plain "
            "decoding alike, for reasons in SGLang and in the random MoE network (the folder's README)")
_TIES = ("weights re-drawn like a model's: Gaussian logits tie in bf16 every ~20 tokens, so plain decoding at another "
         "batch shape parts from itself as every worker does (the folder's README)")
# runs of a preset's shape before the smoke job (the driver's flags, not the preset's): (folder, what differs)
EARLIER = {
    "qwen3-8b": (("fastpath-qwen3-8b-h100/2026-11-25-kernel/two-wave", ""), ("fa4-draft-h100/fa4", "draft fa4"),
                 ("tp2", "--tp-size 2")),
    "gemma-4-26b-a4b-it": (("fastpath-gemma-4-26b-a4b-h100/2026-11-25", "draft triton"),
                           ("floor-h200/gemma-4-26b-a4b-it", _REDRAWN)),
    "qwen3.5-35b-a3b": (("hybrid-moe/qwen3.5-35b-a3b", ""),
                        ("floor-h200/qwen3.5-35b-a3b-replay", "replay commit (SGLANG_DFLASH_REPLAY_SSM=1); " + _TIES),
                        ("floor-qwen3.5-replay-chain-h200/floor", "replay commit (now the default), chain weights")),
    "llama3.1-8b-instruct": (("floor-h200/llama3.1-8b-instruct", _TIES),),
    "gpt-oss-20b": (("hybrid-moe/gpt-oss-20b", ""), ("hybrid-moe/gpt-oss-20b-adaptive", ""),
                    ("floor-h200/gpt-oss-20b", _REDRAWN)),
    "smollm2-135m": (("smollm2-run8-h100/fourway", "real weights and prompts, bf16: outputs part at near-ties, as "
                                                   "plain decoding's own do between batch sizes (gpu_e2e_smollm2)"),),
}


def target(preset: str) -> str:
    value = re.search(r"^TARGET=(.*)$", (ROOT / "launch" / f"{preset}.sh").read_text(), re.M).group(1)
    return value.rsplit("/", 1)[-1] if "$" in value else value


def _not_started(folder: Path, method: str, reason: str) -> str:
    status, why = start_failure(reason, server_log(folder, method))
    return f"{method} {status} ({why[:120]})"


def earlier_run(folder: str, what: str) -> str:
    s = json.loads((RESULTS / folder / "summary.json").read_text())
    spec = [m for m in s["methods"] if m != s["baseline"]]
    equal = ", ".join(f"{m} {c['exact']}/{c['compared']}" for m in spec
                      for c in [{k: sum(d[k] for d in s["crosscheck"].get(m, {}).values())
                                 for k in ("exact", "compared")}] if c["compared"])
    drafts = sorted({(s["servers"][m] or {}).get("speculative_draft_attention_backend") or "?" for m in spec})
    refused = "".join(f"; {_not_started(RESULTS / folder, m, why)}" for m, why in s["skipped"].items())
    weights = "random weights" if s["random_weights"] else "real weights"
    return (f"[{folder}](benchmarks/results/{folder}) {device_and_date(s['env'])}{', ' + what if what else ''}: "
            f"{', '.join(s['methods'])} served{refused}; greedy equal to plain ({weights}): {equal or '-'}; "
            f"draft {'/'.join(drafts)}")


def seed_run(rec: dict) -> str:
    head = f"`{rec['recipe']}`" + (f" {device_and_date(rec)}" if rec.get("device") else "") + f": {rec['status']}"
    parts = []
    for m, r in rec["methods"].items():
        if r["status"] in ("served", "served with errors"):
            eq = f", {r['greedy_equal'][0]}/{r['greedy_equal'][1]} equal" if r.get("greedy_equal") else ""
            parts.append(f"{m} {r['status']} in {r['healthy_s']:.0f} s{eq}, draft {r.get('draft_backend') or '-'}"
                         if m != "none" else f"none in {r['healthy_s']:.0f} s")
        else:
            parts.append(f"{m} {r['status']}: {r.get('reason', '')}")
    return head + (f" ({'; '.join(parts)})" if parts else "")


def table() -> str:
    records = load_records(SEED)
    rows = ["| preset | target | the preset's command on a GPU (seed smoke job, `--dummy`) | earlier runs of its "
            "shape (driver flags, not the preset's) |", "|---|---|---|---|"]
    for p in PRESETS:
        seed = [seed_run(records[r.key]) for r in RECIPES if r.preset == p and r.key in records]
        earlier = [earlier_run(*run) for run in EARLIER.get(p, ())]
        rows.append(f"| `{p}` | {target(p)} | {'<br>'.join(seed) or 'not run on a GPU yet'} | "
                    f"{'<br>'.join(earlier) or 'not run on a GPU yet'} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
