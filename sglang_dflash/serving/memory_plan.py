"""The drafter's KV pool in a sliding-window target's memory plan (SGLang 0.5.17).

A DFLASH server holds two KV pools of the same token capacity: the target's and the drafter's (one full-attention
layer set per draft layer). SGLang sizes that capacity as "memory left for KV / bytes per token", and for a plain
target (`DefaultPoolConfigurator`) the bytes per token include the drafter's layers. Its configurator for hybrid
sliding-window targets (`HybridSWAPoolConfigurator`: gpt-oss, Gemma-3, Gemma-4) counts EAGLE's draft layers and not
DFLASH's, so the drafter's pool is allocated on top of the planned budget, out of the memory kept for activations
and CUDA graphs. The seed smoke job found it (benchmarks/results/seed-recipes, 2026-11-28): the gpt-oss-20b preset
(`--mem-fraction-static 0.8`) on an H200 put 71 GB of target KV and then 16.5 GB of draft KV into a budget that had
room for the first only, and both DFLASH workers ran out of memory capturing CUDA graphs, where plain decoding
started. SGLang 0.5.23 budgets the drafter itself (`_draft_cell_size`), and the hook then leaves its plan alone.

The fix adds the drafter's exact bytes per token (its layers x this rank's K/V heads x (K + V) head dims x the KV
dtype's size) to the configurator's, as the plain configurator does: both pools then fit inside
`--mem-fraction-static`, at a proportionally smaller token capacity.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_dflash")


def draft_kv_bytes_per_token(cfg, tp_size: int, kv_element_size: int) -> int:
    """Bytes one token takes in the drafter's KV pool on one tensor-parallel rank (K and V of every draft layer)."""
    from .draft_model import rank_heads

    _, kv_heads = rank_heads(cfg, tp_size)
    return cfg.num_hidden_layers * kv_heads * 2 * cfg.head_dim * kv_element_size


def budget_draft_pool(original, self, kvc, *args, **kwargs):
    """Around `HybridSWAPoolConfigurator.__init__`: the target's plan (not the drafter's own runner) also pays for
    the drafter's pool."""
    original(self, kvc, *args, **kwargs)
    if kvc.is_draft_worker or not kvc.spec_algorithm.is_dflash_family():
        return
    if hasattr(self, "_draft_cell_size"):  # a release that budgets the drafter itself (0.5.23)
        return
    import torch
    from sglang.srt.runtime_context import get_parallel

    from .startup import load_draft_config

    cfg = load_draft_config(kvc.server_args)
    extra = draft_kv_bytes_per_token(cfg, int(get_parallel().attn_tp_size),
                                     torch._utils._element_size(kvc.kv_cache_dtype))
    before = self._cell_size
    self._cell_size = before + extra
    # SWAChunkCapPoolConfigurator (radix cache off, explicit --max-running-requests) sizes its full pool from the
    # draft's full-layer count instead of _cell_size: the drafter as that many target full layers' worth of bytes
    self._draft_full_layers_num += extra / self._full_per_token
    logger.info("sglang-dflash: the drafter's KV pool (%d layers, %d bytes per token) is budgeted in the "
                "sliding-window memory plan: %d -> %d bytes per token of capacity", cfg.num_hidden_layers, extra,
                before, self._cell_size)
