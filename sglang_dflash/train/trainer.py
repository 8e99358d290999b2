"""The training step and a small training loop: frozen target (features computed once per sequence or on the fly),
frozen embedding and lm_head shared with the target, trainable drafter."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..drafter import DFlashDrafter
from ..reference.target import HFTarget
from .blocks import build_blocks, decayed_block_loss, sample_anchors


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] prompt + the target's own response
    response_start: int  # position of the first response token
    features: torch.Tensor | None = None  # [T, K*H] target hidden states at target_layer_ids (cached)


def target_features(target: HFTarget, tokens: torch.Tensor) -> torch.Tensor:
    """Hidden states of the frozen target at the drafter's layers for a whole sequence, in one forward."""
    _, features = target.forward(tokens, 0, target.new_cache())
    return features.clone()  # out of inference mode, so autograd may save it


def drafter_loss(drafter: DFlashDrafter, seq: Sequence, target: HFTarget, num_anchors: int, gamma: float,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """One sequence, many anchors, one drafter forward."""
    cfg = drafter.config
    tokens = seq.tokens.to(target.device)
    features = seq.features if seq.features is not None else target_features(target, tokens)
    anchors = sample_anchors(seq.response_start, tokens.shape[0], num_anchors, generator).to(tokens.device)
    blocks = build_blocks(tokens, anchors, cfg.block_size, cfg.mask_token_id)
    context = drafter.project_context(features.to(target.device))[None]
    ctx_pos = torch.arange(tokens.shape[0], device=tokens.device)[None]
    embeds = drafter.block_embeddings(blocks.ids[None], target.embed_weight.detach())
    hidden = drafter(embeds, blocks.positions[None], context, ctx_pos, blocks.visible[None])
    logits = drafter.logits(hidden[0], target.lm_head_weight.detach())
    return decayed_block_loss(logits, blocks.labels, cfg.block_size, gamma)


def train_drafter(drafter: DFlashDrafter, target_model, sequences: list[Sequence], steps: int, lr: float = 3e-3,
                  num_anchors: int = 16, gamma: float = 7.0, seed: int = 0, progress: bool = True,
                  weight_decay: float = 0.0) -> list[float]:
    """Train `drafter` in place for `steps` steps (one sequence per step, cycling); returns the loss curve."""
    target = HFTarget(target_model, drafter.config.target_layer_ids)
    for p in target.model.parameters():
        p.requires_grad_(False)
    for s in sequences:
        if s.features is None:
            s.features = target_features(target, s.tokens.to(target.device))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    drafter.train()
    losses = []
    order = torch.randperm(len(sequences), generator=g).tolist()
    for step in tqdm(range(steps), disable=not progress, desc="train drafter"):
        seq = sequences[order[step % len(order)]]
        loss = drafter_loss(drafter, seq, target, num_anchors, gamma, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    drafter.eval()
    return losses


@torch.inference_mode()
def greedy_continuations(target_model, prompts: list[list[int]], max_new_tokens: int) -> list[Sequence]:
    """The target's own greedy responses: the drafter learns the target's distribution, not a dataset's."""
    from ..reference.engine import ReferenceEngine
    from ..sampling import SamplingParams

    results = ReferenceEngine(target_model).generate_target_only(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return [Sequence(torch.tensor(r.prompt_ids + r.output_ids), len(r.prompt_ids)) for r in results]
