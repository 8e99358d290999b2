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
_TOKENIZED = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
_KV_COPY_INIT = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
_ALLOC = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
_SPEC_EXTRAS = "sglang.srt.managers.overlap_utils.FutureMap._resolve_spec_extras"
_TRITON_EXTEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"


def env_choice(name: str, choices: tuple[str, ...], what: str) -> str:
    """The value of a switch variable among ``choices`` (the first is the default, also when unset or empty)."""
    value = os.environ.get(name, choices[0]).strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(f"{name}={value!r}: unknown {what}. Fix: set it to one of {choices} "
                         f"(or unset it for {choices[0]})")
    return value


def selected_worker() -> str:
    return env_choice(WORKER_ENV, _CHOICES, "worker")


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
    HookRegistry.register(f"{_HOOK_ARGS}._resolve_speculative_algorithm_alias", _check_draft_path, around)
    HookRegistry.register(f"{_HOOK_ARGS}._handle_dflash", _handle_dflash, around)
    HookRegistry.register(f"{_HOOK_ARGS}._resolve_dflash_draft_attention_backend", _resolve_draft_backend, around)
    HookRegistry.register(_CAPTURE, _configure_capture, around)
    # our verify-attention kernel for DFLASH TARGET_VERIFY batches on the triton backend (GPU; CPU uses torch_native)
    HookRegistry.register(_TRITON_EXTEND, _triton_forward_extend, around)
    HookRegistry.register(_VALIDATE, _refuse_logprobs, HookType.BEFORE)
    HookRegistry.register(_TOKENIZED, _refuse_unapplied_sampling, around)
    # CPU only (each passes through untouched on GPU): plain-torch versions of ops that exist in sgl_kernel only as
    # (unshipped) *_cpu kernels, TARGET_VERIFY support for torch_native attention, no sgl_kernel KV-copy warm-up, and
    # a stream-free FutureMap read under overlap scheduling.
    HookRegistry.register(_ALLOC, _assign_req_to_token_pool, around)
    HookRegistry.register(_TORCH_NATIVE, _torch_native_forward_extend, around)
    HookRegistry.register(_KV_COPY_INIT, _kv_copy_init, around)
    HookRegistry.register(_SPEC_EXTRAS, _resolve_spec_extras, around)


# ------------------------------------------------------------------------------------------------------- hooks
def _create_worker(original, self, server_args):
    if not self.is_dflash():
        return original(self, server_args)
    from .worker import DFlashWorker

    logger.info("sglang-dflash: DFLASH runs sglang_dflash.serving.worker.DFlashWorker (set %s=builtin for "
                "SGLang's builtin worker)", WORKER_ENV)
    return DFlashWorker


def _check_draft_path(original, *args, **kwargs):
    # SGLang reads the drafter path here, before _handle_dflash: a missing directory must get our error first
    from .startup import check_draft_path_before_alias

    return check_draft_path_before_alias(original, *args, **kwargs)


def _triton_forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    from .verify_kernel import triton_forward_extend

    return triton_forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs)


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


# Sampling controls that the scheduler applies to the logits of ONE next token (penalizers, grammar masks, custom
# logit processors), read from the final SamplingParams (request, --preferred-sampling-params and the model's
# generation-config defaults all merged). A DFLASH verify scores B positions at once; applying these would need
# their state advanced token by token inside the block, which our worker does not do, so it refuses them rather
# than produce a distribution the user did not ask for. Each entry: (field, value that means "off").
_UNAPPLIED = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
              ("min_new_tokens", 0), ("regex", None), ("json_schema", None), ("ebnf", None),
              ("structural_tag", None))


def unapplied_sampling_controls(sampling_params, custom_logit_processor=None) -> list[str]:
    """``name=value`` of every control set to something our verify step would not apply."""
    bad = [f"{name}={getattr(sampling_params, name)!r}" for name, off in _UNAPPLIED
           if getattr(sampling_params, name, off) not in (off, None)]
    if custom_logit_processor:
        bad.append("custom_logit_processor")
    return bad


def _refuse_unapplied_sampling(original, self, obj, *args, **kwargs):
    tokenized = original(self, obj, *args, **kwargs)
    if str(self.server_args.speculative_algorithm).upper() != "DFLASH":
        return tokenized
    params = getattr(tokenized, "sampling_params", None)
    bad = unapplied_sampling_controls(params, getattr(obj, "custom_logit_processor", None)) if params else []
    if bad:
        raise ValueError(f"{', '.join(bad)}: not supported with --speculative-algorithm DFLASH by the sglang-dflash "
                         "worker yet (its verify step scores a block of tokens at once and would silently not apply "
                         "penalties, min_new_tokens, grammars or custom logit processors). Fix: drop them from the "
                         "request (and from --preferred-sampling-params / the model's generation_config defaults), "
                         "or serve without speculation")
    return tokenized


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

    with torch_native_verify_lengths(forward_batch):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)


def _resolve_spec_extras(original, self, batch):
    # Overlap scheduling (SGLang's default) relays each request's bonus token through the FutureMap; reading it
    # back pins the index tensor to the current stream with `record_stream`, an op CUDA tensors alone implement
    # (CPU has no streams, so on CPU the call can only fail). On CPU, hand the original a view of the indices
    # whose record_stream does nothing; everything else it does is unchanged.
    spec = batch.spec_info
    indices = getattr(spec, "future_indices", None)
    if indices is None or indices.device.type != "cpu":
        return original(self, batch)
    from .cpu_ops import StreamlessIndices

    spec.future_indices = indices.as_subclass(StreamlessIndices)
    try:
        return original(self, batch)
    finally:
        spec.future_indices = indices
