"""Training blocks: many anchors per sequence, one attention mask for all of them.

For an anchor at position a, the drafter sees the block [x_a, MASK x (B-1)] at positions a..a+B-1 and the target's
context rows of positions < a, exactly as at inference time (where x_a is the bonus token and the context is every
token the target has already processed). Blocks never see each other, so all anchors of a sequence train in one
forward pass. Labels: block position k (1..B-1) predicts x_{a+k}; position 0 (the given token) has no label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


def sample_anchors(response_start: int, seq_len: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted anchor positions in [response_start, seq_len - 2] (an anchor needs at least one label after it).

    response_start is the position of the first generated token: the first real block starts there, with the whole
    prompt as context. Draws without replacement while there are enough candidates, with replacement otherwise.
    """
    lo, hi = max(response_start, 1), seq_len - 2
    if hi < lo:
        raise ValueError(f"sequence of {seq_len} tokens with response_start={response_start} has no anchor "
                         "position: responses need at least 2 tokens")
    n = hi - lo + 1
    if n >= num_anchors:
        picks = torch.randperm(n, generator=generator)[:num_anchors]
    else:
        picks = torch.randint(n, (num_anchors,), generator=generator)
    return (picks + lo).sort().values


@dataclass
class Blocks:
    ids: torch.Tensor  # [A*B] block token ids: x_a then MASK
    positions: torch.Tensor  # [A*B]
    labels: torch.Tensor  # [A*B] next tokens, IGNORE at block position 0 and past the sequence end
    visible: torch.Tensor  # [A*B, T + A*B] bool: queries x (context keys ; block keys)


def build_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    """tokens [T], anchors [A] -> the A blocks laid out one after another, with their visibility mask."""
    t, a, b = tokens.shape[0], anchors.shape[0], block_size
    dev = tokens.device
    offset = torch.arange(b, device=dev)
    positions = (anchors[:, None] + offset[None, :])  # [A, B]
    ids = torch.full((a, b), mask_token_id, dtype=tokens.dtype, device=dev)
    ids[:, 0] = tokens[anchors]
    in_range = positions < t
    labels = torch.where(in_range, tokens[positions.clamp(max=t - 1)], torch.full_like(positions, IGNORE))
    labels[:, 0] = IGNORE
    block_of_query = torch.arange(a, device=dev).repeat_interleave(b)  # [A*B]
    sees_context = torch.arange(t, device=dev)[None, :] < anchors[block_of_query][:, None]  # strictly before x_a
    sees_block = block_of_query[:, None] == block_of_query[None, :]  # own block only
    return Blocks(ids.flatten(), positions.flatten(), labels.flatten(), torch.cat([sees_context, sees_block], 1))


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Loss weight of block position k: 0 for k = 0, exp(-(k-1)/gamma) for k >= 1. Early positions matter most:
    a draft token only counts if every token before it in the block was accepted."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def decayed_block_loss(logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float = 7.0
                       ) -> torch.Tensor:
    """Position-decayed cross-entropy over [N*B, V] logits laid out block after block (N blocks)."""
    ce = torch.nn.functional.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
    w = position_weights(block_size, gamma, logits.device).repeat(labels.shape[0] // block_size)
    w = w * (labels != IGNORE)
    return (ce * w).sum() / w.sum().clamp(min=1e-9)


# ---------------------------------------------------------------------------------------------- batches of sequences
@dataclass
class BatchBlocks:
    """A batch of S sequences (right-padded to T tokens), A anchors each, laid out block after block."""

    ids: torch.Tensor  # [S, A*B]
    positions: torch.Tensor  # [S, A*B]
    labels: torch.Tensor  # [S, A*B]
    visible: torch.Tensor  # [S, A*B, T + A*B] bool (dense mask; context keys first)
    anchors: torch.Tensor  # [S, A]


def build_batch(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, block_size: int,
                mask_token_id: int) -> BatchBlocks:
    """tokens [S, T] right-padded, lengths [S], anchors [S, A] -> the blocks of every sequence and one dense mask.

    Same rules as build_blocks, per sequence (vectorised over the batch): a block sees context strictly before its
    anchor (never padding, since anchors lie inside the sequence) and its own block; labels past a sequence's own end
    are IGNORE."""
    s, t = tokens.shape
    a, b, dev = anchors.shape[1], block_size, tokens.device
    positions = anchors[:, :, None] + torch.arange(b, device=dev)  # [S, A, B]
    ids = torch.full((s, a, b), mask_token_id, dtype=tokens.dtype, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    labels = tokens.gather(1, positions.clamp(max=t - 1).view(s, -1)).view(s, a, b)
    labels = torch.where(positions < lengths.view(s, 1, 1), labels, torch.full_like(labels, IGNORE))
    labels[:, :, 0] = IGNORE
    block_of_query = torch.arange(a, device=dev).repeat_interleave(b)  # [A*B]
    anchor_of_query = anchors[:, block_of_query]  # [S, A*B]
    sees_context = torch.arange(t, device=dev).view(1, 1, t) < anchor_of_query[:, :, None]  # strictly before x_a
    sees_block = (block_of_query[:, None] == block_of_query[None, :]).expand(s, -1, -1)  # own block only
    return BatchBlocks(ids.view(s, -1), positions.view(s, -1), labels.view(s, -1),
                       torch.cat([sees_context, sees_block], 2), anchors)


def flex_block_mask(anchors: torch.Tensor, block_size: int, context_len: int, device=None):
    """The same visibility as build_batch's dense mask, as a flex-attention BlockMask (no [Q, K] tensor is built):
    query q of sequence b belongs to block j = q // B; key k < T is context (visible iff k < anchors[b, j]), key
    k >= T is block position k - T (visible iff it is in block j)."""
    from torch.nn.attention.flex_attention import create_block_mask

    s, a = anchors.shape
    q_len, t = a * block_size, context_len

    def mask_mod(b, h, q, k):
        j = q // block_size
        return torch.where(k < t, k < anchors[b, j], (k - t) // block_size == j)

    return create_block_mask(mask_mod, s, None, q_len, t + q_len, device=device or anchors.device)
