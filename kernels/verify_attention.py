"""Paged-KV attention for a speculative verify step: B query tokens per request over its cached prefix + its own block.

The function (``verify_attention``; ``reference.verify_attention_reference`` is the same function in plain torch)
-----------------------------------------------------------------------------------------------------------------
Request ``b`` owns query rows ``qo_indptr[b] : qo_indptr[b+1]`` (its ``L_b <= 32`` block tokens, ``L_b`` = the verify
width B, which may differ between requests) and prefix slots ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]`` (its
``P_b`` cached tokens, in order). Positions are counted from the first prefix token in ``kv_indices``: prefix key
``j`` sits at ``j``, block token ``i`` (query or key) at ``P_b + i``. For query head ``h`` (KV head ``h // G``, ``G``
= GQA group) of block token ``i``::

    keys     K = [K_pool[kv_indices[kv_indptr[b] + j]] for j < P_b]  ++  [k_extend[qo_indptr[b] + t] for t < L_b]
    s_ij     = sm_scale * kscale_j * <q_i, K_j>;   if logit_cap > 0:  s_ij = logit_cap * tanh(s_ij / logit_cap)
    allowed  = (causal is False or pos(j) <= P_b + i)  and  (window_left < 0 or (P_b + i) - pos(j) <= window_left)
    out_i    = sum_j softmax_j(s_ij over allowed j) * vscale_j * V_j
    (kscale_j, vscale_j = k_scale, v_scale for pool keys (an fp8 pool's per-layer scales), 1 for the block's keys)
    with sinks (gpt-oss: ``sinks`` [Hq], one logit per query head, natural-log units like s_ij, never capped or
    masked, no value row): out_i = sum_j exp(s_ij) vscale_j V_j / (sum_j exp(s_ij) + exp(sinks[h]))

This is exactly what SGLang 0.5.17's triton ``extend_attention_fwd`` computes for a TARGET_VERIFY batch without a
custom mask (the current block's K/V come in as the separate ``k_extend`` / ``v_extend`` tensors; SGLang has also
stored them into the pool, but ``kv_indices`` covers only the prefix). With SGLang's sliding-window metadata the
prefix is already cut to the last ``min(P, window)`` tokens and positions are relative to that cut, as here.

Why a kernel of our own: SGLang's extend kernel gives every (request, query head) its own program with a 64-128-row
query tile of which a verify uses B (16), and walks the whole prefix serially. At B = 16 and GQA 4 that is 4x the
K/V reads (each query head reloads its KV head's tiles) and 8x the MMA rows, in one program per head, so long
contexts at small batch use few SMs. Here:

* one query tile = the ``L_b x G`` rows of one (request, KV head): row ``r`` is block token ``r // G``, query head
  ``kv_head * G + r % G``. Every K/V tile is loaded once for all of them (``BLOCK_M`` caps the tile; wider blocks
  or groups take several m-blocks).
* split-K like decode: the prefix is cut into up to ``max_splits`` chunks of at least ``split_min`` keys (both
  from :func:`split_plan`), one program each; each writes its normalised partial output and its log-sum-exp, and
  ``_combine_kernel`` merges them: ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``. The last split also
  takes the block keys.
  The split count per request is computed on the GPU from ``kv_indptr`` (no host work, CUDA-graph safe); the
  launch grid depends only on shapes and ``max_q_len``. A request left with one split writes its output directly
  and the combine skips it: the fp32 partials cost as much memory traffic as the K/V reads at short contexts.
* softmax runs in base 2 (``exp2``, scores pre-multiplied by log2(e)); LSEs are base-2 throughout.
* a sink (``sinks``) is one more term of the denominator, added where the denominator is final: in the split kernel
  when it writes a request's output directly (one split), else in the combine, once; a split's partial (o_s, lse_s)
  never holds it, or a request with n splits would count it n times. Both places rescale to max(m, sink), so a
  sink far above every score (the head attends to nothing: output ~0) or far below (no effect) stays finite.

Tree mode (``tree_parents`` [N], issue #38): the block is a draft tree; each block token's parent index inside its
request's block (-1 for the root, parents[i] < i). Block token i sits at position P_b + depth(i) and its allowed
block keys are its ancestors and itself (``causal`` is ignored). The host turns the parents into one int64 bitmask
of ancestors per token and the depths (:func:`tree_ancestor_bits`, L_b small torch ops, no sync), so the kernel's
block mask is one shift and one AND; the window compares depths. ``reference.verify_attention_reference`` takes the
same ``tree_parents``.

Shapes (N = total query tokens = qo_indptr[-1], S = pool slots):
    q [N, Hq, Dk]; k_extend [N, Hkv, Dk]; v_extend [N, Hkv, Dv]; out [N, Hq, Dv] (written; returned)
    k_buffer [S, Hkv, Dk] or paged [S / page, page, Hkv, Dk]; v_buffer likewise with Dv
    qo_indptr, kv_indptr [bs + 1] int32/int64; kv_indices [>= kv_indptr[-1]] int32/int64 (token slot ids)
Head dims up to MAX_HEAD_DIM = 512 (any size, padded to a power of two inside), Hq = G * Hkv with G >= 1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_BLOCK_TOKENS = 32          # largest verify width (query tokens per request) one launch accepts
MAX_HEAD_DIM = 512             # the tile configs below keep a BLOCK_M x head_dim fp32 accumulator in registers
MIN_TILE = 16                  # tl.dot needs every dimension >= 16
SPLIT_MIN_SMALL_GRID = 64      # fewest prefix keys per split when the grid is small (<= a quarter of the SMs) ...
SPLIT_MIN_TOKENS = 256         # ... and otherwise (below that the reduce costs more than the split saves)
MAX_SPLITS_CAP = 64            # upper bound on splits per request (partial-buffer size: N x Hq x splits x Dv fp32)
WAVES = 2                      # split bound: about this many programs per SM


@triton.jit
def _num_splits(prefix_len, window_left, max_splits: tl.constexpr, split_min: tl.constexpr):
    """Splits used for a request and where its prefix walk starts (keys below ``lo`` are outside every window)."""
    lo = tl.where(window_left >= 0, tl.maximum(prefix_len - window_left, 0), 0)
    n = tl.cdiv(prefix_len - lo, split_min)
    n = tl.minimum(tl.maximum(n, 1), max_splits)
    return n, lo


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1, finite for every x (no exp overflow into inf/inf)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _base2_scores(qk, scale, logit_cap, USE_CAP: tl.constexpr):
    """Scores in base 2 (for exp2): log2(e) * s, s = scale * qk, or logit_cap * tanh(s / logit_cap) when capped.

    1.4426950408889634 = log2(e) (a literal: jitted code reads only constexpr globals).
    """
    if USE_CAP:
        return (logit_cap * 1.4426950408889634) * _tanh(qk * (scale / logit_cap))
    return qk * (scale * 1.4426950408889634)


@triton.jit
def _online_softmax_step(s, v, v_scale, m_i, l_i, acc, dtype: tl.constexpr):
    """Fold one tile of base-2 scores s [M, N] (masked entries -inf) and values v [N, Dv] into the running max m_i,
    normaliser l_i and output acc. A row with every score -inf so far keeps m = -inf (exp2 of -inf - 0 = 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype)) * v_scale
    return m_new, l_i, acc


@triton.jit
def _normalised(acc, m_i, l_i, Sinks, head, HAS_SINK: tl.constexpr):
    """The final output acc / denominator of a row whose keys are all folded in (running max m_i, sum l_i, base 2).

    With a sink its 2^sink joins the denominator; both terms are taken relative to max(m_i, sink): 2^(sink - m_i)
    alone turns inf for a sink far above the row's scores, and every term stays finite this way. A row without
    keys (l_i == 0: masked rows only) yields 0."""
    if HAS_SINK:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634        # log2(e): base-2 like m_i
        m_all = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_all)                                        # 0 when m_i = -inf
        den = l_i * alpha + tl.math.exp2(sink - m_all)
        return acc * (alpha / den)[:, None]
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]


@triton.jit
def _verify_split_kernel(
    Q, K_ext, V_ext, K_buf, V_buf, Out, Part_o, Part_lse,
    qo_indptr, kv_indptr, kv_indices, Tree_bits, Tree_depth, Sinks,
    scale_prefix,             # sm_scale * k_scale: pool keys may be fp8 with a per-layer scale
    scale_block,              # sm_scale: the block's keys come unquantised
    logit_cap, v_scale, window_left,
    stride_qt, stride_qh, stride_ket, stride_keh, stride_vet, stride_veh,
    stride_kpage, stride_ktok, stride_kh, stride_vpage, stride_vtok, stride_vh,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, USE_CAP: tl.constexpr,
    MAX_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr, M_BLOCKS: tl.constexpr, IS_TREE: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """One program: request ``program_id(0)``, (KV head, m-block) ``program_id(1)``, split ``program_id(2)``."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1) // M_BLOCKS
    m_block = tl.program_id(1) % M_BLOCKS
    split = tl.program_id(2)

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    q_len = tl.load(qo_indptr + req + 1).to(tl.int64) - q_start
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix_len = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start
    n_splits, walk_lo = _num_splits(prefix_len, window_left, MAX_SPLITS, SPLIT_MIN)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP                                   # block token of each packed row
    head = kv_head * GROUP + rows % GROUP                 # its query head
    row_ok = tok < q_len
    if split >= n_splits:
        return
    if m_block * BLOCK_M >= q_len * GROUP:      # this request's block is narrower than max_q_len
        return

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
                mask=row_ok[:, None] & dk_ok[None, :], other=0.0)
    if IS_TREE:                                           # a tree node sits at prefix + its depth
        q_depth = tl.load(Tree_depth + q_start + tok, mask=row_ok, other=0).to(tl.int64)
    else:
        q_depth = tok
    q_pos = prefix_len + q_depth                          # position of each row's query token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # ---- this split's share of the prefix: paged K/V, gathered through kv_indices
    chunk = tl.cdiv(tl.cdiv(prefix_len - walk_lo, n_splits), BLOCK_N) * BLOCK_N
    lo = walk_lo + split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        key = start + offs_n
        key_ok = key < hi
        slot = tl.load(kv_indices + kv_start + key, mask=key_ok, other=0).to(tl.int64)
        if PAGE_SIZE == 1:
            k_row = slot * stride_ktok
            v_row = slot * stride_vtok
        else:
            k_row = (slot // PAGE_SIZE) * stride_kpage + (slot % PAGE_SIZE) * stride_ktok
            v_row = (slot // PAGE_SIZE) * stride_vpage + (slot % PAGE_SIZE) * stride_vtok
        k = tl.load(K_buf + k_row[None, :] + kv_head * stride_kh + offs_dk[:, None],
                    mask=key_ok[None, :] & dk_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype))
        s = _base2_scores(s, scale_prefix, logit_cap, USE_CAP)
        ok = row_ok[:, None] & key_ok[None, :]      # prefix keys precede every query: causality adds nothing
        ok = ok & ((window_left < 0) | (q_pos[:, None] - key[None, :] <= window_left))
        v = tl.load(V_buf + v_row[:, None] + kv_head * stride_vh + offs_dv[None, :],
                    mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(tl.where(ok, s, float("-inf")), v, v_scale, m_i, l_i, acc, q.dtype)

    # ---- the block itself (the last split): K/V of this step's tokens, causal inside the block
    if split == n_splits - 1:
        bt = tl.arange(0, BLOCK_Q)
        bt_ok = bt < q_len
        k = tl.load(K_ext + (q_start + bt)[None, :] * stride_ket + kv_head * stride_keh + offs_dk[:, None],
                    mask=bt_ok[None, :] & dk_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype))
        s = _base2_scores(s, scale_block, logit_cap, USE_CAP)
        ok = row_ok[:, None] & bt_ok[None, :]
        if IS_TREE:                                       # ancestors and self: bit t of the row's mask
            bits = tl.load(Tree_bits + q_start + tok, mask=row_ok, other=0)
            ok = ok & (((bits[:, None] >> bt[None, :].to(tl.int64)) & 1) != 0)
            k_depth = tl.load(Tree_depth + q_start + bt, mask=bt_ok, other=0).to(tl.int64)
            ok = ok & ((window_left < 0) | (q_depth[:, None] - k_depth[None, :] <= window_left))
        else:
            if IS_CAUSAL:
                ok = ok & (bt[None, :] <= tok[:, None])
            ok = ok & ((window_left < 0) | (tok[:, None] - bt[None, :] <= window_left))
        v = tl.load(V_ext + (q_start + bt)[:, None] * stride_vet + kv_head * stride_veh + offs_dv[None, :],
                    mask=bt_ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(tl.where(ok, s, float("-inf")), v, 1.0, m_i, l_i, acc, q.dtype)

    tok_row = q_start + tok
    out_ptrs = Out + tok_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    # A request with one split has its whole denominator here: its output (and the sink) is final.
    if MAX_SPLITS == 1:
        o = _normalised(acc, m_i, l_i, Sinks, head, HAS_SINK)
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    elif n_splits == 1:         # nothing to merge: the combine skips this request
        o = _normalised(acc, m_i, l_i, Sinks, head, HAS_SINK)
        tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        # A partial without the sink (the combine adds it once). A split whose keys all fall outside the window has
        # l_i == 0: it stores o = 0, lse = -inf (weight 0).
        has_keys = l_i > 0.0
        o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(Part_o + tok_row[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
                 + offs_dv[None, :], o, mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(Part_lse + tok_row * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _combine_kernel(
    Out, Part_o, Part_lse, qo_indptr, kv_indptr, Sinks, window_left,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, MAX_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr,
    HAS_SINK: tl.constexpr,
):
    """One program per (request, block token, query head): merge the splits' partial softmaxes."""
    req = tl.program_id(0)
    tok = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qo_indptr + req).to(tl.int64)
    if tok >= tl.load(qo_indptr + req + 1) - q_start:
        return
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix_len = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start
    n_splits, _ = _num_splits(prefix_len, window_left, MAX_SPLITS, SPLIT_MIN)
    if n_splits == 1:           # the split kernel wrote this request's output directly
        return
    row = q_start + tok
    offs_s = tl.arange(0, MAX_SPLITS)
    s_ok = offs_s < n_splits
    lse = tl.load(Part_lse + row * stride_lt + head * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)                       # finite: the last split holds the query's own key
    if HAS_SINK:                             # the sink's one term of the denominator (the partials hold none)
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634        # log2(e): base 2 like the LSEs
        m = tl.maximum(m, sink)
        w = tl.math.exp2(lse - m)
        den = tl.sum(w, 0) + tl.math.exp2(sink - m)
    else:
        w = tl.math.exp2(lse - m)
        den = tl.sum(w, 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = tl.load(Part_o + row * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_dv[None, :],
                mask=s_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / den
    tl.store(Out + row * stride_ot + head * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < DV)


# --------------------------------------------------------------------------------------------------- host side
def _pool_layout(buf: torch.Tensor, name: str):
    """(page_size, page_stride, token_stride, head_stride) of a KV pool tensor, flat or paged."""
    if buf.dim() == 3:          # [slots, heads, dim]: a slot id addresses a row directly, whatever SGLang's page size
        return 1, buf.stride(0), buf.stride(0), buf.stride(1)
    if buf.dim() == 4:          # [pages, page_size, heads, dim]: slot id = page * page_size + offset
        return buf.shape[1], buf.stride(0), buf.stride(1), buf.stride(2)
    raise ValueError(f"{name}: expected [slots, heads, dim] or [pages, page_size, heads, dim], got shape "
                     f"{tuple(buf.shape)}. Fix: pass the layer's key/value buffer from the KV pool")


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tile_config(block_tokens: int, group: int, dk: int, dv: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a query tile of ``block_tokens x group`` rows.

    Register budget: the fp32 accumulator is BLOCK_M x Dv and q is BLOCK_M x Dk, so wide heads get fewer rows.
    Measured on one H100 (benchmarks/kernel_bench.py; ``--sweep`` in benchmarks/results/kernel-sweep-h100): head dim
    128 with 64 rows: 64 x 64 keys, 4 warps, 3 pipeline stages was 1.5-1.8x faster than 2 stages at 8-32k contexts;
    with 16 rows (a width-1 step at GQA 4) 128 keys per tile beat 64 by 5-15%; head dim 256: 3 stages 1.35x faster
    than 2; head dim 512 at B = 16: 32 x 16, 4 warps, 3 stages beat 32 x 32, 8 warps, 2 stages by 1.4-1.6x from
    8 requests up.
    """
    widest = max(dk, dv)
    rows = max(MIN_TILE, triton.next_power_of_2(block_tokens * group))
    if widest <= 128:
        return min(rows, 128), (128 if rows <= MIN_TILE else 64), (8 if rows > 64 else 4), 3
    if widest <= 256:
        return min(rows, 64), 32, (8 if rows > 32 else 4), 3
    return min(rows, 32), 16, 4, 3


def split_plan(device: torch.device, bs: int, kv_heads: int, m_blocks: int) -> tuple[int, int]:
    """(max_splits, split_min) from shapes alone, so a CUDA graph captured at this bs replays with the same grid.

    The bound is the largest power of two that keeps the programs within ``WAVES`` per SM; splits are at least 64
    keys when the unsplit grid fills at most a quarter of the SMs (one request: parallelism is scarce) and 256
    otherwise. From the H100 sweep (benchmarks/results/kernel-sweep-h100): at 1 request 8-32 splits of 64+ keys were
    best; at 8 requests 1 split at 256 keys and 4 of 256+ at 1-4k; from 32 requests up, no split.
    """
    if device.type != "cuda":
        return 4, SPLIT_MIN_TOKENS
    programs = bs * kv_heads * m_blocks
    sms = _sm_count(device.index or 0)
    fit = max(1, WAVES * sms // programs)
    max_splits = int(min(MAX_SPLITS_CAP, 1 << (fit.bit_length() - 1)))
    return max_splits, (SPLIT_MIN_SMALL_GRID if 4 * programs <= sms else SPLIT_MIN_TOKENS)


def tree_ancestor_bits(parents: torch.Tensor, qo_indptr: torch.Tensor, max_q_len: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-local tree parents [N] (root -1) -> (int64 ancestor-and-self bitmask [N], depth [N] int32).

    One step per level, max_q_len steps (a root path is at most that deep), batched over all tokens and shapes
    fixed: no host sync. A token's walk keeps climbing from its current ancestor a: set bit a, move to a's parent."""
    n = parents.shape[0]
    start = torch.repeat_interleave(qo_indptr[:-1].long(), qo_indptr.diff().long(), output_size=n)  # token's req
    local = torch.arange(n, device=parents.device) - start
    bits = torch.ones_like(local) << local
    depth = torch.zeros_like(local)
    cur = parents.long()
    for _ in range(max_q_len - 1):
        up = cur >= 0
        bits = bits | torch.where(up, torch.ones_like(cur) << cur.clamp(min=0), 0)
        depth = depth + up.long()
        cur = torch.where(up, parents.long()[(start + cur).clamp(min=0)], cur)
    return bits, depth.to(torch.int32)


def verify_attention(q, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *,
                     max_q_len: int, sm_scale: float, causal: bool = True, window_left: int = -1,
                     logit_cap: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0,
                     out: torch.Tensor | None = None, max_splits: int | None = None,
                     split_min: int | None = None, tile: tuple | None = None,
                     tree_parents: torch.Tensor | None = None,
                     tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each request's block tokens over its paged prefix + its block (see the module docstring).

    ``max_q_len``: an upper bound on the per-request query count (SGLang's ``max_extend_len``), <= 32.
    ``max_splits``, ``split_min``: split-K bound (a power of two) and fewest prefix keys per split; defaults from
    :func:`split_plan` (tests lower ``split_min`` to exercise the split path on short prefixes).
    ``tile``: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of :func:`tile_config`'s (for tuning).
    ``tree_parents``: [N] block-local parent per token (tree mode, see the module docstring).
    ``tree_mask``: the same tree as :func:`tree_ancestor_bits` gives it (int64 ancestor-and-self bits [N], int32
    depth [N]), computed once by a caller that runs many layers over one tree: building it from the parents is
    ~8 small launches per tree level, per call (a 30-layer eager verify of a 16-node tree launched 7,000 kernels
    per step that way on an H100, benchmarks/results/tree-smollm2-h100).
    ``sinks``: [Hq] attention-sink logits (any float dtype, read as fp32), one per query head, or None.
    """
    n_tok, hq, dk = q.shape
    hkv, dv = k_extend.shape[1], v_extend.shape[-1]
    bs = qo_indptr.shape[0] - 1
    if not 1 <= max_q_len <= MAX_BLOCK_TOKENS:
        raise ValueError(f"max_q_len={max_q_len}: verify_attention takes 1..{MAX_BLOCK_TOKENS} query tokens per "
                         "request. Fix: use SGLang's extend kernel (SGLANG_DFLASH_VERIFY_ATTENTION=sglang) for wider "
                         "blocks")
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims {dk}/{dv}: verify_attention takes up to {MAX_HEAD_DIM}. Fix: use SGLang's "
                         "extend kernel (SGLANG_DFLASH_VERIFY_ATTENTION=sglang)")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads. Fix: pass q [N, Hq, D] and "
                         "k_extend [N, Hkv, D] of the same layer")
    if k_buffer.shape[-2] != hkv or k_buffer.shape[-1] != dk or v_buffer.shape[-1] != dv:
        raise ValueError(f"KV pool shapes {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} do not match "
                         f"k_extend {tuple(k_extend.shape)} / v_extend {tuple(v_extend.shape)}. Fix: pass this "
                         "layer's buffers")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != hq):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: expected one logit per query head, [{hq}]. Fix: pass "
                         "the layer's sinks for this rank's query heads")
    group = hq // hkv
    page_k, kpage, ktok, kh = _pool_layout(k_buffer, "k_buffer")
    page_v, vpage, vtok, vh = _pool_layout(v_buffer, "v_buffer")
    if page_k != page_v:
        raise ValueError(f"k_buffer page size {page_k} != v_buffer page size {page_v}. Fix: pass one pool's buffers")
    if out is None:
        out = q.new_empty((n_tok, hq, dv))
    if bs == 0 or n_tok == 0:
        return out

    block_m, block_n, num_warps, num_stages = tile or tile_config(max_q_len, group, dk, dv)
    m_blocks = triton.cdiv(max_q_len * group, block_m)
    plan = split_plan(q.device, bs, hkv, m_blocks)
    max_splits = plan[0] if max_splits is None else max_splits
    split_min = plan[1] if split_min is None else split_min
    if max_splits < 1 or max_splits & (max_splits - 1):
        raise ValueError(f"max_splits={max_splits}: must be a power of two >= 1")
    if max_splits > 1:
        part_o = torch.empty((n_tok, hq, max_splits, dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n_tok, hq, max_splits), dtype=torch.float32, device=q.device)
    else:                       # one split writes the output directly; the partial buffers are never touched
        part_o = part_lse = out
    window = int(window_left) if window_left is not None and window_left >= 0 else -1
    use_cap = logit_cap is not None and logit_cap > 0

    if tree_mask is not None:
        tree_bits, tree_depth = tree_mask
    elif tree_parents is not None:
        tree_bits, tree_depth = tree_ancestor_bits(tree_parents, qo_indptr, max_q_len)
    else:                       # never read (IS_TREE is off): any tensor serves as the pointer
        tree_bits = tree_depth = qo_indptr
    has_sink = sinks is not None
    sink_ptr = sinks.contiguous() if has_sink else qo_indptr    # never read without HAS_SINK
    grid = (bs, hkv * m_blocks, max_splits)
    _verify_split_kernel[grid](
        q, k_extend, v_extend, k_buffer, v_buffer, out, part_o, part_lse,
        qo_indptr, kv_indptr, kv_indices, tree_bits, tree_depth, sink_ptr,
        float(sm_scale * k_scale), float(sm_scale), float(logit_cap) if use_cap else 1.0, float(v_scale), window,
        q.stride(0), q.stride(1), k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        kpage, ktok, kh, vpage, vtok, vh,
        out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if max_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, DK=dk, DV=dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_Q=max(MIN_TILE, triton.next_power_of_2(max_q_len)),
        BLOCK_DK=max(MIN_TILE, triton.next_power_of_2(dk)), BLOCK_DV=max(MIN_TILE, triton.next_power_of_2(dv)),
        PAGE_SIZE=page_k, IS_CAUSAL=bool(causal), USE_CAP=use_cap,
        MAX_SPLITS=max_splits, SPLIT_MIN=split_min, M_BLOCKS=m_blocks,
        IS_TREE=tree_parents is not None or tree_mask is not None, HAS_SINK=has_sink,
        num_warps=num_warps, num_stages=num_stages,
    )
    if max_splits > 1:
        _combine_kernel[(bs, max_q_len, hq)](
            out, part_o, part_lse, qo_indptr, kv_indptr, sink_ptr, window,
            out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            DV=dv, BLOCK_DV=triton.next_power_of_2(dv), MAX_SPLITS=max_splits, SPLIT_MIN=split_min,
            HAS_SINK=has_sink, num_warps=4 if dv <= 256 else 8,
        )
    return out
