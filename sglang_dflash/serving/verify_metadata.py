"""Plug ``sglang_dflash.kernels.verify_metadata`` into SGLang's triton backend: a DFLASH TARGET_VERIFY graph replay's
attention metadata in one launch.

Every CUDA-graph replay of a TARGET_VERIFY pass (our draft pass and our verify, each step) has SGLang 0.5.17's
``TritonAttnBackend._update_target_verify_buffers`` refill the graph's qo / kv index pointers, the prefix slot list and
the mask pointers with eight small launches. Our AROUND hook writes the same buffers, with the same values, with one
(``verify_metadata``) and returns what SGLang's function returns. It serves the DFLASH case only, where the block is
causal without a custom mask and no sliding window cuts the prefix; anything else (EAGLE's tree masks, sliding-window
layers) runs SGLang's function. ``tests/test_step_kernels.py`` checks the hook against SGLang's own function.

Switch: ``SGLANG_DFLASH_VERIFY_METADATA=sglang`` keeps SGLang's function (for comparison); unset or ``ours`` selects
ours.
"""

from __future__ import annotations

from ..kernels.verify_metadata import verify_metadata
from ..settings import VERIFY_METADATA as METADATA_ENV, get as setting


def update_target_verify_buffers(original, self, bs, seq_lens, req_pool_indices, spec_info):
    """AROUND hook on ``TritonAttnBackend._update_target_verify_buffers`` (same arguments, same return value)."""
    if not _ours_serves(self, spec_info):
        return original(self, bs, seq_lens, req_pool_indices, spec_info)
    qo_indptr, kv_indptr, mask_indptr = self.qo_indptr[: bs + 1], self.kv_indptr[: bs + 1], self.mask_indptr[: bs + 1]
    verify_metadata(seq_lens, req_pool_indices, self.req_to_token, int(spec_info.draft_token_num), qo_indptr,
                    kv_indptr, self.cuda_graph_kv_indices, mask_indptr)
    return qo_indptr, kv_indptr, None, mask_indptr, self.window_kv_indptr, None, None, None


def _ours_serves(backend, spec_info) -> bool:
    if spec_info is None or type(spec_info).__name__ != "DFlashVerifyInput":
        return False
    if getattr(spec_info, "custom_mask", None) is not None or getattr(spec_info, "draft_token_num", None) is None:
        return False
    if (getattr(backend, "sliding_window_size", None) or 0) > 0:
        return False
    return setting(METADATA_ENV) == "ours"
