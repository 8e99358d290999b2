"""Verification of a drafted block against the target: which drafts to keep, and the token that follows them.

Shapes: N requests, block size B. ``drafts`` [N, B-1] are the drafter's tokens for block positions 1..B-1;
the target scored the block [bonus, d_1, .., d_{B-1}], so its row i (logits or probabilities) predicts position i+1.

Both rules return ``(commit_lens, tokens)``: ``commit_lens`` [N] int64 in 1..B = accepted drafts + 1, and
``tokens`` [N, B] whose first commit_len entries are the accepted drafts followed by the target's own token
(the next bonus); the rest is -1. No host synchronisation.
"""

from __future__ import annotations

import torch

from .sampling import sample_from_probs


def _assemble(drafts: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, width = drafts.shape
    col = torch.arange(width + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((n, 1), -1)], dim=1)
    tokens = torch.where(col < accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = tokens.scatter(1, accepted[:, None], next_token[:, None].to(tokens.dtype))
    return accepted + 1, tokens


def accepted_prefix_len(matches: torch.Tensor) -> torch.Tensor:
    """THE rule that counts accepted drafts, used by both verify rules, training's acceptance estimate and the
    teacher-forced replay: ``matches`` [N, K] bool (draft j passed its test, e.g. ``drafts == target_tokens``)
    -> [N] int64, the length of the leading run of True (a draft after the first failure never counts)."""
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the longest prefix of drafts equal to the target's argmax; then emit the target's argmax.
    Output equals target-only greedy decoding token for token."""
    target_tokens = target_logits.argmax(dim=-1)  # [N, B]
    accepted = accepted_prefix_len(drafts == target_tokens[:, :-1])
    return _assemble(drafts, accepted, target_tokens.gather(1, accepted[:, None])[:, 0])


def verify_sampled(drafts: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling for a point-mass (greedy) draft.

    With q = delta(d), the rule "accept d with prob min(1, p(d)/q(d)), else sample from norm(max(0, p - q))"
    becomes: accept d_i with probability p_i(d_i); at the first rejection sample from p_i with d_i's mass removed
    and renormalised; if every draft is kept, sample the bonus from p_{B-1}. The emitted tokens are then
    distributed exactly as target-only sampling from p. Greedy rows (one-hot p) reduce to verify_greedy.
    """
    n, b, _ = target_probs.shape
    if b == 1:  # no drafts (a plain decode step): sample the next token from p_0
        return _assemble(drafts, drafts.new_zeros(n), sample_from_probs(target_probs[:, 0], generator))
    p_draft = target_probs[:, :-1].gather(2, drafts[:, :, None])[:, :, 0]  # [N, B-1]
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = accepted_prefix_len(u < p_draft)
    rows = torch.arange(n, device=drafts.device)
    p_next = target_probs[rows, accepted].clone()  # the distribution at the first rejected (or bonus) position
    rejected = accepted < b - 1
    rejected_draft = drafts.gather(1, accepted.clamp(max=b - 2)[:, None])[:, 0]
    # remove the rejected draft's mass (rows where everything was accepted keep p_{B-1} as it is)
    p_next[rows, rejected_draft] = torch.where(rejected, torch.zeros_like(p_next[rows, rejected_draft]),
                                               p_next[rows, rejected_draft])
    p_next = p_next / p_next.sum(dim=-1, keepdim=True)
    return _assemble(drafts, accepted, sample_from_probs(p_next, generator))
