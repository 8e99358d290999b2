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

from ..settings import (DUMMY_WEIGHTS as DUMMY_WEIGHTS_ENV, ORACLE_DRAFTS as ORACLE_DRAFTS_ENV, REDRAWN_DUMMY_INITS,
                        WORKER as WORKER_ENV, current as settings)
from . import disagg, memory_plan  # import-light: their SGLang and torch imports are inside the hooks
from .finish_order import update_finish_state_in_token_order  # no imports of its own: on every request's step

logger = logging.getLogger("sglang_dflash")

# Flags from older SGLang docs; 0.5.17 always runs the V2 (overlap-capable) worker, so they mean nothing now.
_OLD_FLAGS = ("SGLANG_ENABLE_SPEC_V2", "SGLANG_ENABLE_DFLASH_SPEC_V2")

_SPEC = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm"
_HOOK_ARGS = "sglang.srt.arg_groups.speculative_hook"
_CAPTURE = "sglang.srt.model_executor.model_runner_components.attention_backend_setup.configure_aux_hidden_state_capture"
# SGLang's scheduler refuses logprobs for every DFLASH worker through this name (imported into its namespace)
_VALIDATE_DFLASH = "sglang.srt.managers.scheduler.validate_dflash_request"
_TOKENIZED = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
_KV_COPY_INIT = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
_ALLOC = "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
_SPEC_EXTRAS = "sglang.srt.managers.overlap_utils.FutureMap._resolve_spec_extras"
_XGRAMMAR = "sglang.srt.constrained.xgrammar_backend"
_TRITON_EXTEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
_TRITON_VERIFY_BUFFERS = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend._update_target_verify_buffers"
_PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_FINISH_STATE = f"{_REQ}.update_finish_state"
_SCHEDULER_WORKER = "sglang.srt.managers.scheduler.Scheduler.init_model_worker"
_DUMMY_WEIGHTS = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
_SWA_POOL_PLAN = "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator.__init__"
_PREBUILT = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch"


def selected_worker() -> str:
    return settings().worker


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # before the worker choice: a run's plain, builtin and our servers must all hold the same random target
    if settings().dummy_weights in REDRAWN_DUMMY_INITS:
        HookRegistry.register(_DUMMY_WEIGHTS, _model_like_dummy_weights, HookType.AROUND)
    for flag in _OLD_FLAGS:
        if flag in os.environ:
            logger.info("sglang-dflash: %s=%s is accepted and ignored: SGLang 0.5.17 always uses the V2 "
                        "speculative worker (overlap on unless --disable-overlap-schedule).", flag, os.environ[flag])
    if selected_worker() == "builtin":
        if settings().oracle_drafts:  # benchmarks: the builtin has no hook between its draft and its verify
            _register_refusal(HookRegistry, HookType, _builtin_oracle_refusal(), _startup_error)
            return
        logger.info("sglang-dflash: %s=builtin, SGLang's builtin DFLASH worker is left in place.", WORKER_ENV)
        return
    # compat: an SGLang release we were not tested on gets no hooks but the refusal (compat.py)
    from . import compat

    reason = compat.refusal()
    if reason is not None:
        _register_refusal(HookRegistry, HookType, reason)
        return

    around = HookType.AROUND
    HookRegistry.register(f"{_SPEC}.create_worker", _create_worker, around)
    HookRegistry.register(f"{_HOOK_ARGS}._resolve_speculative_algorithm_alias", _check_draft_path, around)
    HookRegistry.register(f"{_HOOK_ARGS}._handle_dflash", _handle_dflash, around)
    HookRegistry.register(f"{_HOOK_ARGS}._resolve_dflash_draft_attention_backend", _resolve_draft_backend, around)
    # an attention backend this GPU cannot run: our refusal (flag, capability, fix) before SGLang's own step
    HookRegistry.register(compat.ATTENTION_CHECKS_HOOK, _check_attention_architecture, around)
    HookRegistry.register(_CAPTURE, _configure_capture, around)
    # our verify-attention kernel for DFLASH TARGET_VERIFY batches on the triton backend (GPU; CPU uses torch_native)
    HookRegistry.register(_TRITON_EXTEND, _triton_forward_extend, around)
    # and its graph-replay metadata (qo/kv index pointers, prefix slots) in one launch instead of eight
    HookRegistry.register(_TRITON_VERIFY_BUFFERS, _triton_verify_buffers, around)
    HookRegistry.register(_TOKENIZED, _refuse_unapplied_sampling, around)
    HookRegistry.register(_VALIDATE_DFLASH, _validate_dflash_request, around)
    # a multi-token commit finishes where plain decoding would: stop strings / tokens before the length limit, in
    # token order (finish_order.py)
    HookRegistry.register(_FINISH_STATE, update_finish_state_in_token_order, around)
    # new requests are admitted as in plain decoding: no DFLASH min-free-slots prefill delay (admission.py)
    HookRegistry.register(_SCHEDULER_WORKER, _scheduler_init_model_worker, around)
    # a sliding-window target's memory plan pays for the drafter's KV pool too, as a plain target's does
    # (memory_plan.py: SGLang 0.5.17 leaves it out, and the gpt-oss preset ran out of memory)
    HookRegistry.register(_SWA_POOL_PLAN, memory_plan.budget_draft_pool, around)
    # prefill-decode disaggregation, decode side: a relayed request's draft input and slot state (disagg.py; the
    # modes are refused at start-up unless SGLANG_DFLASH_PD=1)
    HookRegistry.register(f"{_SPEC}.build_disagg_draft_input", disagg.build_disagg_draft_input, around)
    HookRegistry.register(_PREBUILT, disagg.prebuilt_batch, around)
    HookRegistry.register(f"{_REQ}.offload_kv_cache", disagg.offload_kv_cache, around)
    HookRegistry.register(f"{_REQ}.load_kv_cache", disagg.load_kv_cache, around)
    # CPU only (each passes through untouched on GPU): plain-torch versions of ops that exist in sgl_kernel only as
    # (unshipped) *_cpu kernels, TARGET_VERIFY support for torch_native attention, no sgl_kernel KV-copy warm-up, and
    # a stream-free FutureMap read under overlap scheduling.
    HookRegistry.register(_ALLOC, _assign_req_to_token_pool, around)
    HookRegistry.register(_TORCH_NATIVE, _torch_native_forward_extend, around)
    HookRegistry.register(_KV_COPY_INIT, _kv_copy_init, around)
    HookRegistry.register(_SPEC_EXTRAS, _resolve_spec_extras, around)
    HookRegistry.register(_PARALLEL_GROUP, _init_model_parallel_group, around)
    # CPU only: xgrammar token bitmasks without pinned memory, applied with xgrammar's CPU kernel (cpu_grammar.py)
    HookRegistry.register(f"{_XGRAMMAR}._allocate_token_bitmask", _allocate_token_bitmask, around)
    HookRegistry.register(f"{_XGRAMMAR}.XGrammarGrammar.apply_vocab_mask", _apply_vocab_mask, around)


def _builtin_oracle_refusal() -> str:
    return (f"{ORACLE_DRAFTS_ENV} (oracle drafts, benchmarks only) with {WORKER_ENV}=builtin: the plugin does not "
            "replace the builtin worker's drafts (DFlashWorkerV2.forward_batch_generation takes them from its draft "
            "graph's sampler buffer and builds the verify inputs in the same method), so its row would not be at "
            f"the stated acceptance. Fix: unset {ORACLE_DRAFTS_ENV} for the builtin (benchmarks.driver does), and "
            "project its step cost from a plain random-weight run, labelled as a projection")


def _startup_error(reason: str) -> Exception:
    from .errors import DFlashStartupError

    return DFlashStartupError(reason)


def _version_error(reason: str) -> Exception:
    from .compat import UnsupportedSGLangVersion

    return UnsupportedSGLangVersion(reason)


def _register_refusal(registry, hook_type, reason: str, error=_version_error) -> None:
    """Stop any DFLASH start with ``reason`` (SGLang catches and only logs exceptions raised by ``register``, so
    raising there would silently leave SGLang's builtin worker running). Other servers start as usual. Hooked in
    the launcher's DFLASH argument step (first) and at worker creation (in case that step moved)."""
    logger.error("sglang-dflash: %s", reason)

    def refuse_dflash_args(original, *args, **kwargs):
        raise error(reason)

    def refuse_worker(original, self, *args, **kwargs):
        if getattr(self, "is_dflash", lambda: False)():
            raise error(reason)
        return original(self, *args, **kwargs)

    registry.register(f"{_HOOK_ARGS}._handle_dflash", refuse_dflash_args, hook_type.AROUND)
    registry.register(f"{_SPEC}.create_worker", refuse_worker, hook_type.AROUND)


# ------------------------------------------------------------------------------------------------------- hooks
def _create_worker(original, self, server_args):
    if not self.is_dflash():
        return original(self, server_args)
    from .worker import DFlashWorker

    logger.info("sglang-dflash: DFLASH runs sglang_dflash.serving.worker.DFlashWorker (set %s=builtin for "
                "SGLang's builtin worker)", WORKER_ENV)
    return DFlashWorker


def _model_like_dummy_weights(original, model, *args, **kwargs):
    """SGLANG_DFLASH_DUMMY_WEIGHTS=model or chain: SGLang's dummy weights, then re-drawn like a trained model's
    (targets/random_weights.py), seeded per tensor-parallel rank and tensor name; with chain, the target's logits
    processor also gets the decisive chain head (targets/chain_head.py)."""
    out = original(model, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    from ..targets import chain_head
    from ..targets.random_weights import model_like_init

    mode = settings().dummy_weights
    counts = model_like_init(model, seed=0, rank=get_parallel().tp_rank)
    logger.info("sglang-dflash: %s: dummy weights re-drawn like a trained model's (%s=%s): %s",
                type(model).__name__, DUMMY_WEIGHTS_ENV, mode, counts)
    if mode == "chain" and (head := chain_head.attach(model)) is not None:
        logger.info("sglang-dflash: %s: chain head on (%s=chain): every greedy step emits CHAIN[current token] "
                    "(margin %g over %d tokens, seed %d): outputs that bf16 rounding cannot flip",
                    type(model).__name__, DUMMY_WEIGHTS_ENV, head.margin, head.vocab, chain_head.SEED)
    return out


def _scheduler_init_model_worker(original, self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    from .admission import admit_as_plain_decoding

    admit_as_plain_decoding(self)
    return out


def _triton_verify_buffers(original, self, *args, **kwargs):
    from .verify_metadata import update_target_verify_buffers

    return update_target_verify_buffers(original, self, *args, **kwargs)


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


def _check_attention_architecture(original, server_args, *args, **kwargs):
    from .startup import check_architecture_first

    return check_architecture_first(original, server_args, *args, **kwargs)


def _resolve_draft_backend(original, server_args):
    from .startup import resolve_draft_attention_backend

    return resolve_draft_attention_backend(server_args)


def _configure_capture(original, **kwargs):
    # generic hidden-state capture where the model class has no native DFLASH hook (capture.py)
    from .capture import configure_capture

    return configure_capture(original, **kwargs)


def _validate_dflash_request(original, req, enable_overlap, *args, **kwargs):
    # Our worker returns logprobs (controls.py: the target's own, from the verify rows); every other check of
    # SGLang's DFLASH request validation still applies.
    if not getattr(req, "return_logprob", False):
        return original(req, enable_overlap, *args, **kwargs)
    req.return_logprob = False
    try:
        return original(req, enable_overlap, *args, **kwargs)
    finally:
        req.return_logprob = True


# Sampling controls our verify step does not apply, read from the final SamplingParams (request,
# --preferred-sampling-params and the model's generation-config defaults all merged): a custom logit processor is
# handed the request itself (its params carry "__req__", whose output_ids cannot show the drafts a block row sits
# behind), so it cannot be applied exactly per block position. Refused rather than silently not applied.
# Penalties, min_new_tokens, grammars, logit_bias and logprobs are applied exactly (controls.py). Each entry:
# (field, value that means "off").
_UNAPPLIED = ()


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
                         "worker (its verify step scores a block of tokens at once, and SGLang hands a custom logit "
                         "processor the request itself, whose output cannot show the drafts a block position sits "
                         "behind, so it cannot be applied exactly per position). Penalties, min_tokens, grammars, "
                         "logit_bias and logprobs are supported. Fix: drop it from the request, or serve without "
                         "speculation")
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
    # torch_native (SGLang's CPU attention) has no TARGET_VERIFY branch; ours is cpu_ops.verify_attention
    if not forward_batch.forward_mode.is_target_verify() or layer.is_cross_attention \
            or forward_batch.encoder_lens is not None:
        return original(self, q, k, v, layer, forward_batch, save_kv_cache)
    import sys

    from sglang.srt.layers.radix_attention import AttentionType

    from . import tree_step
    from .cpu_ops import verify_attention, verify_width

    if save_kv_cache and k is not None and v is not None:  # as the original writes them
        write_loc = sys.modules[type(self).__module__].KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
        self.token_to_kv_pool.set_kv_buffer(layer, write_loc, k, v)
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    window = layer.sliding_window_size
    heads, dim = layer.tp_q_head_num, layer.qk_head_dim
    width = verify_width(forward_batch)
    tree = tree_step.active()  # set by the worker around a tree verify's target forward only (tree_step.py)
    if tree is not None:
        tree.claim(width)
    o = verify_attention(q.reshape(-1, heads, dim), self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                         self.token_to_kv_pool.get_value_buffer(layer.layer_id), self.req_to_token_pool.req_to_token,
                         forward_batch.req_pool_indices, forward_batch.seq_lens, width,
                         scale=layer.scaling, causal=causal,
                         sliding_window=window if causal and window is not None and window > -1 else None,
                         tree_depth=tree.depth if tree is not None else None,
                         tree_mask=tree.ancestors if tree is not None else None)
    # the original's output layout: q's own shape (Gemma-3 passes [1, N, heads, dim]), or [N, heads x v_dim]
    return o.view(q.shape) if layer.qk_head_dim == layer.v_head_dim else o.view(q.shape[0], -1)


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


def _init_model_parallel_group(original, *args, **kwargs):
    # CPU, --tp-size > 1: SGLang 0.5.17 asks for a PyNccl communicator in every group whatever the device, and its
    # constructor needs a CUDA device. On CPU the groups' collectives already take torch.distributed over gloo
    # (GroupCoordinator.all_reduce / all_gather on CPU tensors), so the CPU engine needs no NCCL at all.
    from .cpu_ops import on_cpu_engine

    if on_cpu_engine():
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def _allocate_token_bitmask(original, vocab_size, batch_size):
    from .cpu_grammar import allocate_token_bitmask

    return allocate_token_bitmask(original, vocab_size, batch_size)


def _apply_vocab_mask(original, self, logits, vocab_mask):
    from .cpu_grammar import apply_vocab_mask

    return apply_vocab_mask(original, self, logits, vocab_mask)
