"""Verification of a drafted block against the target: which drafts to keep, and the token that follows them.

Shapes: N requests, block size B. ``drafts`` [N, B-1] are the drafter's tokens for block positions 1..B-1;
the target scored the block [bonus, d_1, .., d_{B-1}], so its row i (logits or probabilities) predicts position i+1.

The rules return ``(commit_lens, tokens)``: ``commit_lens`` [N] int64 in 1..B = accepted drafts + 1, and
``tokens`` [N, B] whose first commit_len entries are the accepted drafts followed by the target's own token
(the next bonus); the rest is -1. No host synchronisation.
"""

from __future__ import annotations

import torch

from .sampling import SamplingTensors, sample_from_probs, seeded_sample


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
    if drafts.shape[1] == 0:  # a plain decode step (adaptive k = 0): the argmax, one token; 2 launches, not 12
        next_token = target_logits[:, 0].argmax(dim=-1)
        return torch.ones_like(next_token), next_token[:, None]
    return verify_greedy_ids(drafts, target_logits.argmax(dim=-1))


def verify_greedy_ids(drafts: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_greedy`` given the target's argmax ids [N, B] (all it reads from the logits)."""
    accepted = accepted_prefix_len(drafts == target_tokens[:, :-1])
    # the accepted drafts ARE the target's tokens, so the committed ones are target_tokens[:, :accepted + 1]: one
    # mask instead of assembling drafts + next token (7 launches fewer on the worker's host path)
    col = torch.arange(target_tokens.shape[1], device=target_tokens.device)
    return accepted + 1, target_tokens.masked_fill(col[None, :] > accepted[:, None], -1)


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


def verify_sampled_q(drafts: torch.Tensor, target_probs: torch.Tensor, candidates: torch.Tensor, draft_q: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling for drafts drawn from a distribution q over K candidates (DFlash2's selector).

    Draft d_i was drawn from q_i (given d_1..d_{i-1}); q_i is zero outside the candidates. Accept d_i with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from (p_i - q_i)+ renormalised over the
    whole vocabulary (p_i itself should that be all zero, which needs p_i == q_i, where a rejection has probability
    0); if every draft is kept, sample the bonus from p_{B-1}. Each emitted token then follows p exactly. A one-hot
    q (a greedy draft) gives verify_sampled's rule, and the same draws from the generator.

    Shapes: ``drafts`` [N, B-1] int64, ``target_probs`` [N, B, V] (processed, row i predicts position i+1),
    ``candidates`` [N, B-1, K] int64 (distinct ids per row), ``draft_q`` [N, B-1, K]. Returns (commit_lens, tokens)
    as verify_sampled; no host synchronisation.
    """
    n, b, _ = target_probs.shape
    if b == 1:  # no drafts (a plain decode step): nothing depends on q
        return verify_sampled(drafts, target_probs, generator)
    p_draft = target_probs[:, :-1].gather(2, drafts[:, :, None])[:, :, 0]  # [N, B-1]
    q_draft = (draft_q * (candidates == drafts[:, :, None])).sum(dim=-1)  # q_i(d_i)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = accepted_prefix_len(u * q_draft < p_draft)  # u < p / q without dividing by q
    rows = torch.arange(n, device=drafts.device)
    p_next = target_probs[rows, accepted]  # the first rejected (or the bonus) position's p: [N, V]
    at = accepted.clamp(max=b - 2)
    rejected = (accepted < b - 1)[:, None].to(draft_q.dtype)  # rows where everything was kept subtract nothing
    residual = p_next.scatter_add(1, candidates[rows, at], -rejected * draft_q[rows, at]).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p_next)
    return _assemble(drafts, accepted, sample_from_probs(residual, generator))


# Floats in one chunk of scaled draft rows in verify_sampled_logits when N x V is smaller (64 MiB of float32): small
# batches then take one chunk (few kernel launches), large ones B-1 chunks of ~N rows, so the extra memory stays
# O(max(N x V, this)) instead of the dense path's several [N x B, V] float32 tensors.
_LSE_CHUNK_ELEMENTS = 1 << 24


def _scaled_logsumexp(logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """logsumexp(logits / temp) over the last dim in float32 with one [.., V] float32 buffer, updated in place
    (torch.logsumexp allocates two more). logits is a strided [c, B-1, V] view: dividing it by the float32
    temperature makes the float32 copy whatever its dtype, without reshaping (which would copy all its rows)."""
    x = logits / temp
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row of -inf only: lse -inf, not NaN
    return x.sub_(top).exp_().sum(dim=-1).log_().add_(top[..., 0])


def verify_sampled_logits(drafts: torch.Tensor, target_logits: torch.Tensor, temperature: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_sampled(drafts, processed_probs(logits, s, filtered=False)) without the dense probabilities.

    For batches where no row uses top-k, top-p or min-p, the processed distribution of row i is
    p_i = softmax(l_i / T) (a point mass on the argmax, first index on ties, where T == 0), so the rule needs
    only:
      - p_i(d_i) = exp(l_i[d_i] / T - logsumexp(l_i / T)) for the B-1 drafts: one reduction over V per row,
        computed in float32 over chunks of requests of at most max(N x V, _LSE_CHUNK_ELEMENTS) floats (the
        [N, B, V] float32 probabilities of the dense path are never built);
      - the next token from the ONE row per request at the accepted position a (gathered: [N, V]): an exponential
        race argmax(l_a / T - log E), E ~ Exp(1), which draws from softmax(l_a / T); the rejected draft d_a is
        set to -inf first (p_a with d_a's mass removed and renormalised), unless every draft was accepted.
    Greedy rows (T == 0): draft i is accepted iff it is the argmax of row i (p_i(d_i) is exactly 1 or 0) and the
    next token is the argmax of row a, so they equal verify_greedy bit for bit.

    Terms and shapes: N requests, block size B, vocabulary V; ``drafts`` [N, B-1] int64, ``target_logits``
    [N, B, V] in any float dtype (row i predicts block position i+1), ``temperature`` [N] (0 = greedy).
    Returns ``(commit_lens, tokens)`` as verify_sampled. The generator is consumed as verify_sampled consumes it
    (uniforms [N, B-1], then exponentials [N, V] float32), so with the same seed both mostly emit the same tokens;
    they differ only where float rounding of p versus log p decides a race or a uniform. No host synchronisation
    (the chunking depends only on shapes).
    """
    n, b, v = target_logits.shape
    device = target_logits.device
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    target_tokens = target_logits.argmax(dim=-1)  # [N, B]: the greedy rows' point masses (first index on ties)
    rows = torch.arange(n, device=device)
    if b == 1:  # no drafts (a plain decode step): the next token comes from row 0
        accepted = drafts.new_zeros(n)
    else:
        draft_logit = target_logits[:, :-1].gather(2, drafts[:, :, None])[:, :, 0] / temp[:, None]  # [N, B-1] fp32
        lse = torch.empty_like(draft_logit)
        per_chunk = max(1, max(_LSE_CHUNK_ELEMENTS, n * v) // ((b - 1) * v))  # requests per float32 chunk
        for start in range(0, n, per_chunk):
            stop = min(n, start + per_chunk)
            lse[start:stop] = _scaled_logsumexp(target_logits[start:stop, :-1], temp[start:stop, None, None])
        p_draft = torch.exp(draft_logit - lse)
        p_draft = torch.where(greedy[:, None], (drafts == target_tokens[:, :-1]).to(p_draft.dtype), p_draft)
        u = torch.rand(p_draft.shape, generator=generator, device=device)
        accepted = accepted_prefix_len(u < p_draft)
    scaled = target_logits[rows, accepted] / temp[:, None]  # [N, V] float32: the first rejected (or bonus) row
    if b > 1:
        rejected = accepted < b - 1
        rejected_draft = drafts.gather(1, accepted.clamp(max=b - 2)[:, None])
        kept = scaled.gather(1, rejected_draft)
        scaled.scatter_(1, rejected_draft, torch.where(rejected[:, None], torch.full_like(kept, -torch.inf), kept))
    race = torch.empty_like(scaled).exponential_(1.0, generator=generator)
    # exponential_ can return exactly 0: -log(0) = inf would make -inf + inf = NaN, which argmax picks
    scaled.sub_(race.clamp_min_(torch.finfo(race.dtype).tiny).log_())
    next_token = torch.where(greedy, target_tokens[rows, accepted], scaled.argmax(dim=-1))
    return _assemble(drafts, accepted, next_token)


def seeded_targets(target_logits: torch.Tensor, s: SamplingTensors, seeds: torch.Tensor, positions: torch.Tensor,
                   filtered: bool = True) -> torch.Tensor:
    """The target's own seeded sample at every verified row: [n, W] token ids, row j of request i drawn by
    sampling.seeded_sample from its processed distribution with the noise of (seeds[i], positions[i, j]).
    ``target_logits`` [n, W, V], ``s`` one row per request, ``positions`` [n, W] the rows' sequence positions
    (a chain: prefix + j; a tree: prefix + depth). THE seeded draw of the worker and the reference engine."""
    n, w, v = target_logits.shape

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [n] -> [n * w], request-major (no repeat_interleave: capturable)
        return t[:, None].expand(n, w).reshape(-1)

    rows = SamplingTensors(per_row(s.temperature), per_row(s.top_k), per_row(s.top_p), per_row(s.min_p))
    return seeded_sample(target_logits.reshape(n * w, v), rows, per_row(seeds), positions.reshape(-1),
                         filtered).view(n, w)


def verify_seeded(drafts: torch.Tensor, target_logits: torch.Tensor, s: SamplingTensors, seeds: torch.Tensor,
                  prefix: torch.Tensor, filtered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact and reproducible speculative sampling for seeded requests: draw the target's token X_j at every verified
    row with the seeded noise of its position (``seeded_targets``), keep the drafts while d_j == X_j, emit X at the
    first mismatch (or after the last draft): ``verify_greedy_ids(drafts, X)``.

    Lossless: the emitted token at every position is X, the target's own draw from its processed distribution p
    there (the exponential race), whatever the drafts; the drafts only decide how many positions one verify
    settles. Reproducible: X at position t is a function of p_t and (seed, t) alone, so the output is the seeded
    target-only sample stream (the reference engine's generate_target_only with the same seed), whatever the block
    alignment, the verified width k (the adaptive policy's, which depends on timing), a tree instead of a chain, or
    the batch. Acceptance: a point-mass draft d is kept with probability P(X = d) = p(d), as verify_sampled keeps
    it; drafts drawn with the same noise (DFlash2: dflash2.CandidateSelector.walk with seeds) are kept with the
    coupling's P(argmax q/E = argmax p/E) = sum_x 1 / sum_v max(p_v / p_x, q_v / q_x) (below verify_sampled_q's
    sum_x min(p, q), above the independent sum_x p q). Why not verify_sampled's rule with seeded coins: its emitted
    token at a position depends on whether that position had a draft and which (accept coin vs residual draw), so
    a seeded output would change with k, which the adaptive policy picks from step times.

    ``drafts`` [n, W-1], ``target_logits`` [n, W, V], ``s`` / ``seeds`` one row per request, ``prefix`` [n] the
    position of each request's row 0 (the bonus token's). Returns (commit_lens, tokens) as verify_sampled."""
    w = target_logits.shape[1]
    positions = prefix.to(torch.int64)[:, None] + torch.arange(w, device=target_logits.device)
    return verify_greedy_ids(drafts, seeded_targets(target_logits, s, seeds, positions, filtered))
