"""Plug ``sglang_dflash.kernels.verify_attention`` into SGLang's triton attention backend for DFLASH TARGET_VERIFY.

SGLang 0.5.17's ``TritonAttnBackend.forward_extend`` serves a TARGET_VERIFY batch by storing the block's K/V into the
pool (at ``out_cache_loc``) and then calling ``self.extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, qo_indptr,
kv_indptr, kv_indices, custom_mask, causal, mask_indptr, max_extend_len, ...)``, where ``kv_indices`` lists only the
cached prefix and the block's own K/V are the separate ``k`` / ``v``. The metadata (``qo_indptr`` = arange * B,
``kv_indptr`` / ``kv_indices`` from ``seq_lens``, or their sliding-window versions) is built by
``init_forward_metadata`` in eager mode and into fixed buffers under CUDA graphs. Our hook (AROUND
``forward_extend``) leaves all of that to SGLang and, for the duration of one DFLASH TARGET_VERIFY call, points
``self.extend_attention_fwd`` at :func:`extend_compatible_verify`, which takes the same arguments and runs our kernel.
So the K/V store, the metadata and the graph buffers stay SGLang's, and our kernel does no host work beyond its launch
(its grid depends only on shapes and ``max_extend_len``, so CUDA-graph capture and replay see the same launch).

Both the target's verify and our worker's draft pass run as DFLASH TARGET_VERIFY batches, so both use the kernel when
their backend is triton (the draft's non-causal and sliding-window layers included).

Attention sinks (gpt-oss, issue #44): SGLang passes a layer's ``sinks`` ([query heads] logits, bf16) to
``extend_attention_fwd``; our kernel takes them as the same extra softmax term (one per head, in the denominator
only), so gpt-oss's sliding and full layers all run ours. They used to go to SGLang's extend kernel, which made a
plain (k = 0) step on the gpt-oss-20b shape cost 16 ms instead of 5.5 ms.

Tree verify (``SGLANG_DFLASH_TREE``, serving/tree_step.py): while the worker runs a tree verify's target forward,
``tree_step.active()`` holds the tree, and the kernel gets its mask (``TreeVerify.kernel_mask``: ancestor bits and
depths, the kernel's tree mode: node at prefix + depth, ancestors-and-self mask). The tree verify CUDA graphs are
captured the same way, with the mask in static buffers that each replay reads (serving/tree_graphs.py). A tree
verify that would fall back to SGLang's kernel raises instead (SGLang's kernel would attend causally over the nodes:
wrong tokens).

Switch: ``SGLANG_DFLASH_VERIFY_ATTENTION=sglang`` keeps SGLang's ``extend_attention_fwd``; unset or ``ours`` selects
ours. Calls our kernel cannot serve exactly (custom mask, score_mod, xai temperature, LSE output / DCP split stages,
blocks wider than 32, head dims above 512) go to SGLang's kernel, with one warning per reason naming it.
"""

from __future__ import annotations

import logging

import torch

from ..settings import VERIFY_ATTENTION as KERNEL_ENV, get as setting

logger = logging.getLogger("sglang_dflash")

_logged: set[str] = set()


def selected_kernel() -> str:
    return setting(KERNEL_ENV)


def _log_once(level: int, message: str, *args) -> None:
    key = message % args
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


def triton_forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND hook on ``TritonAttnBackend.forward_extend``: our kernel for DFLASH TARGET_VERIFY, else unchanged."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    algo = getattr(forward_batch, "spec_algorithm", None)
    if algo is None or not algo.is_dflash():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    from . import tree_step

    if tree_step.active() is not None and (selected_kernel() == "sglang" or getattr(self, "enable_deterministic", False)
                                           or getattr(self, "dcp_size", 1) > 1):
        raise RuntimeError(f"a tree verify (SGLANG_DFLASH_TREE) needs our verify kernel's tree mode, and this call "
                           f"would run SGLang's kernels ({KERNEL_ENV}=sglang, deterministic inference or decode-context "
                           f"parallelism). Fix: unset {KERNEL_ENV} and drop those modes, or set SGLANG_DFLASH_TREE=0")
    if selected_kernel() == "sglang":
        _log_once(logging.INFO, "sglang-dflash: DFLASH TARGET_VERIFY attention runs SGLang's triton "
                  "extend_attention_fwd (%s=sglang)", KERNEL_ENV)
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    if getattr(self, "enable_deterministic", False) or getattr(self, "dcp_size", 1) > 1:
        # These modes go through SGLang's unified / DCP paths, not the extend call we replace.
        _log_once(logging.WARNING, "sglang-dflash: DFLASH TARGET_VERIFY attention runs SGLang's kernels: "
                  "deterministic inference or decode-context parallelism is on (our verify kernel serves neither)")
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)

    sglang_fn = self.extend_attention_fwd
    self.extend_attention_fwd = _Dispatch(sglang_fn)
    try:
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        self.extend_attention_fwd = sglang_fn


class _Dispatch:
    """``extend_attention_fwd`` during one verify call; keeps SGLang's function for the calls ours can't serve."""

    __slots__ = ("sglang_fn",)

    def __init__(self, sglang_fn):
        self.sglang_fn = sglang_fn

    def __call__(self, *args, **kwargs):
        return extend_compatible_verify(self.sglang_fn, *args, **kwargs)


@torch.compiler.disable
def extend_compatible_verify(sglang_fn, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                             kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale,
                             v_scale, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True,
                             sliding_window_size=-1, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
                             lse_extend=None, skip_prefix=False, skip_extend=False, page_size=1, score_mod=None,
                             aux_tensors=None):
    """SGLang 0.5.17 ``extend_attention_fwd``'s signature; runs ``verify_attention`` into ``o_extend``."""
    from sglang_dflash.kernels.verify_attention import MAX_BLOCK_TOKENS, MAX_HEAD_DIM, verify_attention

    reason = None
    if custom_mask is not None:
        reason = "the batch carries a custom attention mask"
    elif score_mod is not None:
        reason = "the layer has a score_mod"
    elif xai_temperature_len is not None and xai_temperature_len > 0:
        reason = "the layer uses xai_temperature_len"
    elif lse_extend is not None or skip_prefix or skip_extend:
        reason = "the caller asks for LSE output or a prefix/extend-only pass"
    elif not 1 <= int(max_len_extend) <= MAX_BLOCK_TOKENS:
        reason = f"the verify block has {max_len_extend} tokens (ours takes 1..{MAX_BLOCK_TOKENS})"
    elif max(q_extend.shape[-1], v_extend.shape[-1]) > MAX_HEAD_DIM:
        reason = f"head dims {q_extend.shape[-1]}/{v_extend.shape[-1]} exceed {MAX_HEAD_DIM}"
    elif k_buffer.dim() == 4 and k_buffer.shape[1] != page_size:
        reason = f"the paged pool's page {k_buffer.shape[1]} differs from page_size={page_size}"
    from . import tree_step

    tree = tree_step.active()  # the tree of a tree verify's target forward (tree_step.py), else None
    if tree is not None:
        tree.claim(int(max_len_extend))
        if reason is not None:
            raise RuntimeError(f"a tree verify (SGLANG_DFLASH_TREE) needs our verify kernel's tree mode, but {reason}. "
                               "Fix: set SGLANG_DFLASH_TREE=0 for this model")
    if reason is not None:
        _log_once(logging.WARNING, "sglang-dflash: a DFLASH TARGET_VERIFY attention call runs SGLang's "
                  "extend_attention_fwd: %s (our verify kernel does not serve that)", reason)
        return sglang_fn(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                         custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=sm_scale,
                         logit_cap=logit_cap, skip_prefix_custom_mask=skip_prefix_custom_mask,
                         sliding_window_size=sliding_window_size, sinks=sinks, window_kv_offsets=window_kv_offsets,
                         xai_temperature_len=xai_temperature_len, lse_extend=lse_extend, skip_prefix=skip_prefix,
                         skip_extend=skip_extend, page_size=page_size, score_mod=score_mod, aux_tensors=aux_tensors)
    _log_once(logging.INFO, "sglang-dflash: DFLASH TARGET_VERIFY attention runs sglang_dflash.kernels.verify_attention "
              "(set %s=sglang for SGLang's extend_attention_fwd)", KERNEL_ENV)
    verify_attention(
        q_extend, k_extend, v_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
        max_q_len=int(max_len_extend), sm_scale=sm_scale or q_extend.shape[-1] ** -0.5, causal=bool(is_causal),
        window_left=sliding_window_size if sliding_window_size is not None else -1, logit_cap=logit_cap or 0.0,
        k_scale=float(k_scale), v_scale=float(v_scale), out=o_extend, sinks=sinks,
        tree_mask=tree.kernel_mask if tree is not None else None)  # built once per tree, not per layer
    return o_extend
