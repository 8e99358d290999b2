"""Tiny target + drafter checkpoints for the serving tests (built once per session, cached under a temp dir)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TRAIN_PROMPT_SEED = 123  # the drafters of these pairs are trained on random_prompts(48, vocab, seed=123)
VOCAB_SPECIALS = 5  # ids 0..4 are special tokens (see sglang_dflash.testing.checkpoints.SPECIALS)


def random_prompts(n: int, vocab: int, seed: int, lo: int = 4, hi: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SPECIALS, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _build(root: Path, name: str, make_info, train_steps: int = 0, **target_kw) -> tuple[Path, Path, dict]:
    """Target + drafter checkpoint dirs under root (cached: info.json marks a finished build) and the stub libcuda."""
    from sglang_dflash.testing import build_stub_libcuda, save_drafter_dir, save_tiny_target
    from sglang_dflash.targets.tiny import tiny_drafter
    from sglang_dflash.train.loop import greedy_continuations, train_drafter

    target_dir, draft_dir = root / f"{name}target", root / f"{name}draft"
    info_file = root / f"{name}info.json"
    build_stub_libcuda(root / "stub")
    if info_file.is_file():
        return target_dir, draft_dir, json.loads(info_file.read_text())
    torch.manual_seed(0)
    target = save_tiny_target(target_dir, peak=8.0, **target_kw)
    drafter = tiny_drafter(target.config, mask_token_id=4, num_layers=1, block_size=16)
    losses = []
    if train_steps:
        seqs = greedy_continuations(target, random_prompts(48, target.config.vocab_size, seed=TRAIN_PROMPT_SEED),
                                    max_new_tokens=64)
        losses = train_drafter(drafter, target, seqs, steps=train_steps, lr=3e-3, progress=False)
    save_drafter_dir(drafter, target_dir, draft_dir)
    info = make_info(target, drafter, losses)
    info_file.write_text(json.dumps(info))
    return target_dir, draft_dir, info


def build_pair(root: Path, train_steps: int = 300) -> tuple[Path, Path, dict]:
    """A float32 tiny Qwen3 target with peaky logits and a drafter trained on its greedy continuations."""
    return _build(root, "", lambda target, drafter, losses: {
        "vocab": target.config.vocab_size, "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None}, train_steps=train_steps)


def build_gemma3_pair(root: Path, train_steps: int = 300) -> tuple[Path, Path, dict]:
    """A float32 tiny Gemma-3 target (tied embeddings: SGLang 0.5.17's Gemma3ForCausalLM always computes logits
    with embed_tokens) and a drafter trained like build_pair's, whose config carries input_embedding_scale =
    sqrt(hidden) as tiny_drafter_config sets it for Gemma targets. Trained so that the server commits several
    tokens per step, which is the only way multi-token commits through the sliding-window layers get exercised
    (with the untrained drafter every step committed exactly 1 token). The cache name carries "trained": a stale
    untrained build under an old name is not reused."""
    return _build(root, "gemma3_trained_", lambda target, drafter, losses: {
        "vocab": target.config.vocab_size, "input_embedding_scale": drafter.config.input_embedding_scale,
        "model_type": target.config.model_type, "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None}, train_steps=train_steps, arch="gemma3",
        tie_word_embeddings=True)


def build_family_pair(root: Path, arch: str, train_steps: int = 300) -> tuple[Path, Path, dict]:
    """A float32 tiny target of another family (sglang_dflash.targets.tiny: qwen2, mistral, phi3, ...) and a drafter, trained
    like build_pair's when train_steps > 0 (so that verify steps commit several tokens) or left random (enough to
    drive forwards, e.g. for the capture check). Cached per family and step count."""
    return _build(root, f"{arch}_{train_steps}_", lambda target, drafter, losses: {
        "vocab": target.config.vocab_size, "arch": type(target).__name__,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None},
        train_steps=train_steps, arch=arch)
