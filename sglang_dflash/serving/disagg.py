"""Prefill-decode disaggregation (issue #49; docs/notes-pd.md has the SGLang 0.5.17 references).

A PD pair prefills a request on one server and decodes it on another. With our worker on both:

- the prefill server runs our ordinary prefill (`DFlashWorker._prefill`): the target's extend with hidden capture,
  and the drafter's context K/V for every prompt position written into the drafter's pool;
- SGLang's transfer already registers the drafter's pool (the speculative worker's `draft_runner.token_to_kv_pool`)
  after the target's on both sides and moves the prompt's pages of both, so the decode server receives the context
  the drafter needs. The pools are paired by position: both servers must run the same target, drafter and
  --tp-size (a server cannot see its peer's arguments, so this is said at start-up, not checked);
- the decode server turns a relayed request into a running one without a forward ("prebuilt"). SGLang 0.5.17 builds
  the speculative state for it for EAGLE and DSPARK only (`SpeculativeAlgorithm.build_disagg_draft_input`); for
  DFLASH it returns None and the first decode step fails (sgl-project/sglang#36140). `relayed_draft_input` builds
  what our prefill would have returned: the bonus token is the prefill's first output token, at position = the
  prompt length; under overlap scheduling it is also published to the FutureMap, where the next decode step reads
  the bonus and the lengths;
- a relayed request never ran our `_prefill` on this server, so its per-slot state (penalty rows, seeds) would be
  its slot's previous occupant's: `DFlashWorker.on_relayed` sets it from the request's output so far (the first
  token; all of it for a retracted request that resumes);
- a decode server retracts by copying a request's KV to host memory and back: the drafter's rows go with it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_dflash")

MODES = ("prefill", "decode")


def relayed_draft_input(batch, last_tokens, future_map):
    """The draft input of a prebuilt batch of relayed requests: as after our prefill, bonus = their last token."""
    from sglang.srt.managers.overlap_utils import RelayPayload
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    state = make_draft_input_v2(bonus_tokens=last_tokens, new_seq_lens=batch.seq_lens)
    if batch.enable_overlap:  # what the scheduler does for a forward's result: the next step resolves from these
        state.future_dsa_topk_indices_available = False
        state.future_indices = batch.req_pool_indices
        future_map.publish(state.future_indices, batch.seq_lens)
        future_map.stash(state.future_indices, RelayPayload.from_draft_input(state))
    return state


def build_disagg_draft_input(original, self, *args, **kwargs):
    """Around `SpeculativeAlgorithm.build_disagg_draft_input`: ours for DFLASH (SGLang 0.5.17 has none; 0.5.23's
    own is its worker's). Arguments: (batch, server_args, last_tokens, future_map) in 0.5.17, (batch, last_tokens,
    future_map) in 0.5.23."""
    if not self.is_dflash():
        return original(self, *args, **kwargs)
    batch = kwargs.get("batch", args[0] if args else None)
    last_tokens = kwargs.get("last_tokens_tensor", args[-2] if len(args) >= 3 else None)
    future_map = kwargs.get("future_map", args[-1] if len(args) >= 3 else None)
    return relayed_draft_input(batch, last_tokens, future_map)


def prebuilt_batch(original, self, *args, **kwargs):
    """Around the decode scheduler's `get_new_prebuilt_batch`: the relayed requests' slots get their state."""
    batch = original(self, *args, **kwargs)
    on_relayed = getattr(getattr(self, "draft_worker", None), "on_relayed", None)
    if batch is not None and on_relayed is not None:
        on_relayed(batch)
    return batch


# --------------------------------------------------------------------------- retraction on the decode server
# A decode server retracts a request by copying its KV to host memory and back into new slots later
# (`Req.offload_kv_cache` / `load_kv_cache`: the target's pool only). The drafter's context for those positions must
# travel with it, or the resumed request drafts from whatever its new slots held (lossless, but no draft accepted).
# One worker per scheduler process: it names its drafter pool here (a callable: the pool is built after the worker).
_draft_pool = None


def keep_draft_pool(get_pool) -> None:
    global _draft_pool
    _draft_pool = get_pool


def _rows(req, req_to_token_pool):
    return req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1]  # SGLang's own rows for the copy


def offload_kv_cache(original, self, req_to_token_pool, *args, **kwargs):
    """Around `Req.offload_kv_cache`: the drafter's rows go to host memory with the target's."""
    out = original(self, req_to_token_pool, *args, **kwargs)
    if _draft_pool is not None:
        self.dflash_draft_kv_cpu = _draft_pool().get_cpu_copy(_rows(self, req_to_token_pool))
    return out


def load_kv_cache(original, self, req_to_token_pool, *args, **kwargs):
    """Around `Req.load_kv_cache`: and back, into the request's new slots."""
    out = original(self, req_to_token_pool, *args, **kwargs)
    saved = getattr(self, "dflash_draft_kv_cpu", None)
    if _draft_pool is not None and saved is not None:
        _draft_pool().load_cpu_copy(saved, _rows(self, req_to_token_pool))
        self.dflash_draft_kv_cpu = None
    return out


# ----------------------------------------------------------------------------------------------- start-up
def _unserved_target(config) -> str | None:
    """What in the target's attention the relay has not been read or tested for, or None (full attention only)."""
    from ..config import text_field

    layer_types = set(text_field(config, "layer_types") or [])
    if layer_types - {"full_attention"}:
        return f"layer types {sorted(layer_types)}: sliding-window or recurrent layers transfer their own pools"
    if text_field(config, "sliding_window") and text_field(config, "use_sliding_window") is not False:
        return f"sliding_window {text_field(config, 'sliding_window')}: the sliding-window pool transfers apart"
    if text_field(config, "kv_lora_rank"):
        return "MLA attention (kv_lora_rank): its compressed pool's layout beside the drafter's is unread"
    return None


def check_at_launch(server_args, target_config, *, pd_switch: bool, release_ok: bool, oracle: bool) -> None:
    """Refuse, with the fix, the prefill-decode setups our worker does not serve (docs/notes-pd.md, section 6)."""
    import os

    from .errors import DFlashStartupError

    mode = str(getattr(server_args, "disaggregation_mode", None) or "null")
    if mode == "null":
        return
    one_server = ("serve DFLASH on one server (drop --disaggregation-mode), or run the prefill-decode pair without "
                  "--speculative-algorithm")
    if not pd_switch:
        raise DFlashStartupError(
            f"--disaggregation-mode {mode}: prefill-decode disaggregation is served by the sglang-dflash worker only "
            "behind SGLANG_DFLASH_PD=1 while it is experimental (issue #49; SGLang 0.5.17's own DFLASH has no draft "
            "input for a relayed request, sgl-project/sglang#36140). Fix: set SGLANG_DFLASH_PD=1 on both servers, "
            f"with the same target, drafter and --tp-size on each, or {one_server}")
    why = []
    if not release_ok:
        why.append("this SGLang release (the relay hooks were written against 0.5.17's disaggregation code); "
                   "Fix: SGLang 0.5.17")
    backend = str(getattr(server_args, "disaggregation_transfer_backend", "") or "")
    if backend in ("ascend", "mori"):
        why.append(f"--disaggregation-transfer-backend {backend} (its handling of the drafter's pool is unread); "
                   "Fix: mooncake or nixl")
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true", "yes"):
        why.append("SGLANG_DISAGG_STAGING_BUFFER (it hands the transfer the target's K/V buffers only); Fix: unset it")
    if int(getattr(server_args, "dcp_size", 1) or 1) > 1:
        why.append(f"--dcp-size {server_args.dcp_size} (the drafter's pages are not relayed across DCP ranks); "
                   "Fix: --dcp-size 1")
    if (target := _unserved_target(target_config)) is not None:
        why.append(f"the target's {target}; Fix: a full-attention target, or {one_server}")
    for flag in ("enable_hierarchical_cache", "enable_hisparse", "disaggregation_decode_enable_offload_kvcache"):
        if getattr(server_args, flag, False):
            why.append(f"--{flag.replace('_', '-')} (the drafter's pages are not covered); Fix: drop it")
    if oracle:
        why.append("oracle drafts (benchmarks: they are keyed at our prefill, which a decode server does not run); "
                   "Fix: unset SGLANG_DFLASH_ORACLE_DRAFTS")
    if why:
        raise DFlashStartupError(f"--disaggregation-mode {mode} with DFLASH: not served with " + "; ".join(why))
    if backend == "fake":
        logger.warning("sglang-dflash: --disaggregation-transfer-backend fake moves no KV: for wiring tests only "
                       "(the decode server's drafter then reads context it never received)")
    logger.info("sglang-dflash: prefill-decode disaggregation, %s side (SGLANG_DFLASH_PD=1, experimental): the "
                "peer must run the same target, drafter and --tp-size, since the transfer pairs the two servers' "
                "pools by position", mode)
