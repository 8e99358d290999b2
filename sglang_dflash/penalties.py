"""Repetition controls (frequency / presence / repetition penalty, min_new_tokens) at every position of a block.

Plain decoding applies them to one next-token distribution whose state is the request's output so far. A verify
scores the block [bonus, d_1, .., d_{W-1}] at once, and its row i predicts the token after d_i: if d_1..d_i are
accepted, the output at that point is the request's output (bonus included) followed by d_1..d_i, so row i's
state is known exactly. Nothing after a rejection is kept, so rows past the accepted prefix never matter.

The state of one request, as SGLang's penalizers keep it (sglang/srt/sampling/penaltylib), one row per request:
    freq_acc  [N, V] float32  the request's frequency_penalty added once per output occurrence of each token
                              (added one token at a time, as plain decoding does, so the sums round the same way)
    seen      [N, V] bool     the token occurred in the output (presence and repetition penalties)
    out_len   [N]    int64    output tokens so far (min_new_tokens)
and the per-request settings frequency / presence / repetition [N] float32, min_new [N] int64, stop [N, V] bool
(the token ids min_new_tokens holds back). Processing order and arithmetic are plain decoding's, so float32 results
are bit-identical: logits += (-freq - presence_if_seen) (+ -inf on stop tokens while out_len < min_new), then the
repetition penalty (logit * r where the logit < 0, logit / r otherwise) on seen tokens, then logit_bias.

No SGLang import and no per-request Python: every function is a few batched tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyRows:
    """Per-request state and settings (see the module docstring); rows can be a slice of a larger table."""

    freq_acc: torch.Tensor
    seen: torch.Tensor
    out_len: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    min_new: torch.Tensor
    stop: torch.Tensor


@dataclass
class BlockState:
    """The state at every row of a verify block: row i includes the block's tokens 1..i."""

    freq_acc: torch.Tensor  # [N, W, V] float32
    seen: torch.Tensor  # [N, W, V] bool
    out_len: torch.Tensor  # [N, W] int64


def block_state(rows: PenaltyRows, block_ids: torch.Tensor) -> BlockState:
    """block_ids [N, W] = [bonus, d_1..d_{W-1}]; the bonus is already part of rows (it is output)."""
    n, w = block_ids.shape
    v = rows.freq_acc.shape[-1]
    drafts = block_ids[:, 1:].to(torch.int64)
    # one frequency_penalty per draft occurrence, then a running sum along the block starting from freq_acc: the
    # cumulative sum adds one token at a time in block order (adding 0.0 elsewhere changes nothing), exactly as
    # plain decoding's per-step scatter_add does
    steps = torch.zeros((n, w, v), dtype=rows.freq_acc.dtype, device=rows.freq_acc.device)
    steps[:, 0] = rows.freq_acc
    steps[:, 1:].scatter_(2, drafts[:, :, None], rows.frequency[:, None, None].expand(n, w - 1, 1).to(steps.dtype))
    freq_acc = steps.cumsum(dim=1)
    # occurrences of each token among d_1..d_i (at most W - 1: int16 keeps the [N, W, V] temporaries small)
    hits = torch.zeros((n, w, v), dtype=torch.int16, device=block_ids.device)
    hits[:, 1:].scatter_(2, drafts[:, :, None], 1)
    seen = (hits.cumsum(dim=1, dtype=torch.int16) > 0) | rows.seen[:, None, :]
    out_len = rows.out_len[:, None] + torch.arange(w, device=block_ids.device)[None, :]
    return BlockState(freq_acc=freq_acc, seen=seen, out_len=out_len)


def apply_penalties(logits: torch.Tensor, rows: PenaltyRows, state: BlockState) -> torch.Tensor:
    """logits [N, W, V] (raw target scores of the block rows) -> penalised logits, a new tensor."""
    presence = torch.where(state.seen, rows.presence[:, None, None], 0.0)
    additive = torch.neg(state.freq_acc) - presence
    holding = (state.out_len < rows.min_new[:, None])[:, :, None] & rows.stop[:, None, :]
    additive = additive + torch.where(holding, float("-inf"), 0.0)
    out = logits.float() + additive
    scale = torch.where(state.seen, rows.repetition[:, None, None], 1.0)
    return torch.where(out < 0, out * scale, out / scale)


def penalty_terms(freq_acc, seen, out_len, presence, repetition, min_new, stop) -> tuple[torch.Tensor, torch.Tensor]:
    """One next-token distribution's penalties as SGLang's sampler takes them from its orchestrator: (additive
    [N, V], scaling [N, V]) with processed = (logits + additive) * scaling where that is < 0, / scaling otherwise;
    `apply_penalties` at one row. The worker's prefill uses it (a retracted request prefilled again)."""
    additive = torch.neg(freq_acc) - torch.where(seen, presence[:, None], 0.0)
    holding = (out_len < min_new)[:, None] & stop
    additive = additive + torch.where(holding, float("-inf"), 0.0)
    return additive, torch.where(seen, repetition[:, None], 1.0)


def advance(rows: PenaltyRows, state: BlockState, tokens: torch.Tensor,
            commit_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state after the committed tokens (new freq_acc [N, V], seen [N, V], out_len [N]): the accepted drafts
    (row commit_len - 1 of the block state already holds them), then the target's own token
    tokens[:, commit_len - 1]."""
    n = tokens.shape[0]
    last = (commit_lens - 1).to(torch.int64)
    idx = torch.arange(n, device=tokens.device)
    new_token = tokens.gather(1, last[:, None]).to(torch.int64)  # [N, 1]
    freq_acc = state.freq_acc[idx, last]
    freq_acc.scatter_add_(1, new_token, rows.frequency[:, None].to(freq_acc.dtype))
    seen = state.seen[idx, last]
    seen.scatter_(1, new_token, True)
    return freq_acc, seen, rows.out_len + commit_lens.to(rows.out_len.dtype)
