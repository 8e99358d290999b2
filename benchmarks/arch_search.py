"""Summarise a drafter architecture search (benchmarks/gpu_arch_search.sh): one row per drafter shape.

    python -m benchmarks.arch_search OUT      # OUT/<name>/{train/drafter, train/train_log.json, tau.json}

Writes OUT/summary.json, OUT/summary.md and OUT/arch_search.png (held-out block acceptance over training, and tau
per set), so shapes trained side by side for the same wall clock can be compared at a glance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def drafter_row(run: Path) -> dict:
    """The facts of one run: shape, size of the shipped files, training progress, held-out metrics and tau."""
    drafter = run / "train" / "drafter"
    row: dict = {"name": run.name}
    cfg_path = drafter / "config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        row.update(layers=cfg.get("num_hidden_layers"), mlp=cfg.get("intermediate_size"),
                   mb=round(sum(f.stat().st_size for f in drafter.glob("*.safetensors")) / 1e6, 1))
    log_path = run / "train" / "train_log.json"
    if log_path.exists():
        train = json.loads(log_path.read_text())["train"]
        last = train["history"][-1] if train.get("history") else {}
        row.update(steps=train.get("steps"), steps_per_s=train.get("steps_per_s"),
                   held_out_loss=last.get("held_out_loss"), held_out_block_accept=last.get("held_out_block_accept"),
                   history=train.get("history", []))
    tau_path = run / "tau.json"
    if tau_path.exists():
        for s, by_t in json.loads(tau_path.read_text())["results"].items():
            for t, r in by_t.items():
                row[f"tau {s} {t}"] = round(r["tau"], 3)
                if "greedy_equal" in r:
                    row.setdefault("greedy_equal", True)
                    row["greedy_equal"] &= bool(r["greedy_equal"])
    return row


def markdown(rows: list[dict]) -> str:
    taus = sorted({k for r in rows for k in r if k.startswith("tau ")})
    head = ["drafter", "layers", "MLP", "MB", "steps", "held-out loss", "held-out block accept", *taus, "greedy equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r.get("layers"), r.get("mlp"), r.get("mb"), r.get("steps"),
                 _f(r.get("held_out_loss")), _f(r.get("held_out_block_accept")), *(_f(r.get(t)) for t in taus),
                 r.get("greedy_equal")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _f(x) -> str | None:
    return None if x is None else f"{x:.2f}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    taus = sorted({k for r in rows for k in r if k.startswith("tau ")})
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        h = r.get("history") or []
        a.plot([p["step"] for p in h], [p["held_out_block_accept"] for p in h], marker="o", label=r["name"])
    a.set(xlabel="training step", ylabel="held-out block acceptance (tokens)", title="same data, same wall clock")
    a.legend()
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        b.bar([j + i * width for j in range(len(taus))], [r.get(t, 0) for t in taus], width, label=r["name"])
    b.set_xticks([j + 0.4 - width / 2 for j in range(len(taus))], [t[4:] for t in taus])
    b.set(ylabel="tau (held-out, reference engine)", title="tau per set")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    rows = [drafter_row(d) for d in sorted(out.iterdir()) if (d / "train").is_dir()]
    if not rows:
        raise SystemExit(f"{out}: no <name>/train run folders (benchmarks/gpu_arch_search.sh writes them)")
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(rows))
    plot(rows, out / "arch_search.png")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
