"""SGLang plugin entry point (group ``sglang.srt.plugins``): route ``--speculative-algorithm DFLASH`` to our worker.

SGLang calls :func:`register` in every process it starts (launcher, scheduler, detokenizer, ...). This module
must stay import-light: it imports only SGLang's hook registry; the worker, the draft model and torch-heavy code
are imported inside the hooks, i.e. only in the processes (and at the moment) they are needed.

Switch: ``SGLANG_DFLASH_WORKER=builtin`` keeps SGLang's own DFLASH worker (to compare the two on one install);
unset or ``ours`` selects ours. Every process logs which one runs when DFLASH is used.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("sglang_dflash")

WORKER_ENV = "SGLANG_DFLASH_WORKER"
_CHOICES = ("ours", "builtin")
# Flags from older SGLang docs; 0.5.17 always runs the V2 (overlap-capable) worker, so they mean nothing now.
_OLD_FLAGS = ("SGLANG_ENABLE_SPEC_V2", "SGLANG_ENABLE_DFLASH_SPEC_V2")

_SPEC = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm"
_HOOK_ARGS = "sglang.srt.arg_groups.speculative_hook"
_CAPTURE = "sglang.srt.model_executor.model_runner_components.attention_backend_setup.configure_aux_hidden_state_capture"
_VALIDATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_KV_COPY_INIT = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
_ALLOC = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"


def selected_worker() -> str:
    value = os.environ.get(WORKER_ENV, "ours").strip().lower() or "ours"
    if value not in _CHOICES:
        raise ValueError(f"{WORKER_ENV}={value!r}: unknown worker. Fix: set it to one of {_CHOICES} "
                         "(or unset it for ours)")
    return value


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for flag in _OLD_FLAGS:
        if flag in os.environ:
            logger.info("sglang-dflash: %s=%s is accepted and ignored: SGLang 0.5.17 always uses the V2 "
                        "speculative worker (overlap on unless --disable-overlap-schedule).", flag, os.environ[flag])
    if selected_worker() == "builtin":
        logger.info("sglang-dflash: %s=builtin, SGLang's builtin DFLASH worker is left in place.", WORKER_ENV)
        return

    around = HookType.AROUND
    HookRegistry.register(f"{_SPEC}.create_worker", _create_worker, around)
    HookRegistry.register(f"{_HOOK_ARGS}._handle_dflash", _handle_dflash, around)
    HookRegistry.register(f"{_HOOK_ARGS}._resolve_dflash_draft_attention_backend", _resolve_draft_backend, around)
    HookRegistry.register(_CAPTURE, _configure_capture, around)
    HookRegistry.register(_VALIDATE, _refuse_logprobs, HookType.BEFORE)
    # CPU only: plain-torch versions of ops that exist in sgl_kernel only as (unshipped) *_cpu kernels, and
    # TARGET_VERIFY support for torch_native attention. Both hooks pass through untouched on GPU.
    HookRegistry.register(_ALLOC, _assign_req_to_token_pool, around)
    HookRegistry.register(_TORCH_NATIVE, _torch_native_forward_extend, around)
    HookRegistry.register(_KV_COPY_INIT, _kv_copy_init, around)


# ------------------------------------------------------------------------------------------------------- hooks
def _create_worker(original, self, server_args):
    if not self.is_dflash():
        return original(self, server_args)
    from .worker import DFlashWorker

    logger.info("sglang-dflash: DFLASH runs sglang_dflash.serving.worker.DFlashWorker (set %s=builtin for "
                "SGLang's builtin worker)", WORKER_ENV)
    return DFlashWorker


def _handle_dflash(original, server_args):
    from .startup import handle_dflash_args

    return handle_dflash_args(original, server_args)


def _resolve_draft_backend(original, server_args):
    from .startup import resolve_draft_attention_backend

    return resolve_draft_attention_backend(server_args)


def _configure_capture(original, *, model, dflash_use_aux_hidden_state, dflash_target_layer_ids, **kwargs):
    if dflash_use_aux_hidden_state and not hasattr(model, "set_dflash_layers_to_capture"):
        from .capture import install_capture_hook

        install_capture_hook(model)
    return original(model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                    dflash_target_layer_ids=dflash_target_layer_ids, **kwargs)


def _refuse_logprobs(self, obj, *args, **kwargs):
    if getattr(obj, "return_logprob", False) and str(self.server_args.speculative_algorithm).upper() == "DFLASH":
        raise ValueError("logprobs are not supported with --speculative-algorithm DFLASH by the sglang-dflash worker "
                         "yet. Fix: drop logprobs/return_logprob from the request, or serve without speculation")
    return None


def _assign_req_to_token_pool(original, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                              batch_size):
    if req_to_token.device.type != "cpu":
        return original(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)
    from .cpu_ops import assign_req_to_token_pool_torch

    assign_req_to_token_pool_torch(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)


def _kv_copy_init(original, self):
    # The slot-row KV copy (EAGLE tree moves; a DFLASH chain never moves KV) warms up an sgl_kernel op that the
    # CPU wheel lacks. Leave it unconfigured on CPU: a move_kv_cache call would then fail loudly, not corrupt.
    if str(self.device).startswith("cpu"):
        self._kv_copy_config = None
        return None
    return original(self)


def _torch_native_forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache=True):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)
    from .cpu_ops import torch_native_verify_lengths

    with torch_native_verify_lengths(forward_batch, q.shape[0]):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)
