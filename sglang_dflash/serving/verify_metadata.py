"""Plug ``sglang_dflash.kernels.verify_metadata`` into SGLang's triton backend: a DFLASH TARGET_VERIFY graph replay's
attention metadata in one launch.

Every CUDA-graph replay of a TARGET_VERIFY pass (our draft pass and our verify, each step) has SGLang 0.5.17's
``TritonAttnBackend._update_target_verify_buffers`` refill the graph's qo / kv index pointers, the prefix slot list and
the mask pointers with eight small launches, and on a backend with sliding-window layers the window's buffers with a
few more and a host synchronisation (``update_sliding_window_buffer`` slices by a device scalar). Our AROUND hook
writes the same buffers, with the same values, with one launch (``verify_metadata``) and returns what SGLang's
function returns. It serves the DFLASH case, where the block is causal without a custom mask, on pools whose
sliding-window slots are the full pool's or ``SWAKVPool``'s mapped ones; anything else (EAGLE's tree masks, a
unified memory pool that translates slots before each replay, other sliding-window pools) runs SGLang's function.
``tests/test_step_kernels.py`` checks the hook against SGLang's own function, with and without a window.

Switch: ``SGLANG_DFLASH_VERIFY_METADATA=sglang`` keeps SGLang's function (for comparison); unset or ``ours`` selects
ours.
"""

from __future__ import annotations

import torch

from ..kernels.verify_metadata import Window, verify_metadata
from ..settings import VERIFY_METADATA as METADATA_ENV, get as setting


def update_target_verify_buffers(original, self, bs, seq_lens, req_pool_indices, spec_info):
    """AROUND hook on ``TritonAttnBackend._update_target_verify_buffers`` (same arguments, same return value)."""
    if not _ours_serves(self, spec_info):
        return original(self, bs, seq_lens, req_pool_indices, spec_info)
    qo_indptr, kv_indptr, mask_indptr = self.qo_indptr[: bs + 1], self.kv_indptr[: bs + 1], self.mask_indptr[: bs + 1]
    window = _window(self)
    verify_metadata(seq_lens, req_pool_indices, self.req_to_token, int(spec_info.draft_token_num), qo_indptr,
                    kv_indptr, self.cuda_graph_kv_indices, mask_indptr, window)
    if window is None:
        return qo_indptr, kv_indptr, None, mask_indptr, self.window_kv_indptr, None, None, None
    return (qo_indptr, kv_indptr, None, mask_indptr, window.indptr[: bs + 1], window.indices,
            self.cuda_graph_window_num_kv_splits, window.offsets)


def _window(backend) -> Window | None:
    if not _has_window(backend):
        return None
    pool = backend.token_to_kv_pool
    swa_map = getattr(pool, "full_to_swa_index_mapping", None) \
        if hasattr(pool, "translate_loc_from_full_to_swa") else None
    return Window(int(backend.sliding_window_size), backend.window_kv_indptr, backend.cuda_graph_window_kv_indices,
                  backend.cuda_graph_window_kv_offsets, swa_map)


def _has_window(backend) -> bool:
    return (getattr(backend, "sliding_window_size", None) or 0) > 0


def _window_slots_known(backend) -> bool:
    """Whether the window's slots are the full pool's (no translation) or ``SWAKVPool``'s mapped ones, the two
    cases ``update_sliding_window_buffer`` resolves with its own translation; a unified pool
    (``_translate_kv_loc``) rewrites the buffers again before each replay, other pools translate their own way."""
    if getattr(backend, "_translate_kv_loc", None) is not None:
        return False
    pool = getattr(backend, "token_to_kv_pool", None)
    if not hasattr(pool, "translate_loc_from_full_to_swa"):
        return True
    return type(pool).__name__ == "SWAKVPool" and torch.is_tensor(getattr(pool, "full_to_swa_index_mapping", None))


def _ours_serves(backend, spec_info) -> bool:
    if spec_info is None or type(spec_info).__name__ != "DFlashVerifyInput":
        return False
    if getattr(spec_info, "custom_mask", None) is not None or getattr(spec_info, "draft_token_num", None) is None:
        return False
    if _has_window(backend) and not _window_slots_known(backend):
        return False
    return setting(METADATA_ENV) == "ours"
