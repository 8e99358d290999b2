"""Plain-torch references for the kernels in this package (same arguments, same result, no speed).

``verify_attention_reference`` is the function ``verify_attention.verify_attention`` computes (see that module's
docstring for the maths); it walks requests one at a time and computes in float32 (float64 for float64 inputs), so
it is the yardstick for the Triton kernel on CPU (interpreter) and GPU alike.

Tree mode (``tree_parents`` given, issue #38): the block is a draft tree instead of a chain. ``tree_parents``
[N] holds, for each block token, its parent's index inside its own request's block (-1 for the root, and
parents[i] < i). Block token i then sits at position P + depth(i) and attends to the whole prefix plus its
ancestors and itself (``causal`` is ignored: the tree mask replaces it); a window counts in those positions.

Attention sinks (``sinks`` [Hq], gpt-oss): one extra logit per query head, in the scores' natural-log units (after
the scale and softcap; not capped itself, outside every mask and window), that joins each row's softmax and has no
value row: it only takes probability mass away from the keys. This is SGLang 0.5.17's definition in its triton
extend and decode kernels (exp(sink) joins the denominator once the keys are summed), which ours must match.
"""

from __future__ import annotations

import torch


def gather_pool_rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(slots), heads, dim]`` of a KV pool: flat ``[slots, heads, dim]`` or ``[pages, page, heads, dim]``."""
    if buf.dim() == 3:
        return buf[slots]
    page = buf.shape[1]
    return buf[slots // page, slots % page]


def tree_block_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's block-local parents [L] (root -1, parents[i] < i) -> (ancestors-and-self [L, L] bool, depth [L])."""
    n = len(parents)
    allowed = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            allowed[i] |= allowed[p]
            depth[i] = depth[p] + 1
    return allowed, depth


def verify_attention_reference(q, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
                               sm_scale: float, causal: bool = True, window_left: int = -1, logit_cap: float = 0.0,
                               k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                               tree_parents: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                               **_launch_only) -> torch.Tensor:
    """Reference of ``verify_attention`` (launch-only keywords such as ``max_q_len`` / ``max_splits`` are ignored)."""
    n_tok, hq, _ = q.shape
    hkv, dv = k_extend.shape[1], v_extend.shape[-1]
    group = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)     # float32 at least; float64 stays float64 (tests)
    if out is None:
        out = q.new_empty((n_tok, hq, dv))
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q0, q1, p0, p1 = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        n_q, n_p = q1 - q0, p1 - p0
        if n_q == 0:
            continue
        slots = kv_indices[p0:p1].long()
        keys = torch.cat([gather_pool_rows(k_buffer, slots).to(acc) * k_scale, k_extend[q0:q1].to(acc)], 0)
        vals = torch.cat([gather_pool_rows(v_buffer, slots).to(acc) * v_scale, v_extend[q0:q1].to(acc)], 0)
        # The block's own K/V come unscaled (SGLang hands them over before any fp8 quantisation); only pool rows carry
        # k_scale / v_scale. The kernel applies the scales to the pool reads the same way.
        keys = keys.repeat_interleave(group, dim=1)                      # [P + L, Hq, Dk]
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].to(acc), keys) * sm_scale
        if logit_cap and logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        block_pos = torch.arange(n_q)
        allowed = torch.ones(n_q, n_p + n_q, dtype=torch.bool)
        if tree_parents is not None:                                      # prefix + ancestors and self
            allowed[:, n_p:], block_pos = tree_block_mask(tree_parents[q0:q1].cpu())
        q_pos = (n_p + block_pos).unsqueeze(1)                           # [L, 1]
        k_pos = torch.cat([torch.arange(n_p), n_p + block_pos]).unsqueeze(0)  # [1, P + L]
        if causal and tree_parents is None:
            allowed &= k_pos <= q_pos
        if window_left is not None and window_left >= 0:
            allowed &= (q_pos - k_pos) <= window_left
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        if sinks is not None:       # the sink's logit as one more column of every row's softmax, then dropped
            sink_col = sinks.to(scores).view(hq, 1, 1).expand(hq, n_q, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], -1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)
    return out
