"""Everything that differs between the SGLang releases the plugin supports, in one module.

Tested releases: 0.5.17 (the GPU line: torch 2.11) and 0.5.23 (the current release: torch 2.14, CPU CI). Anything
else is refused at plugin registration (see :func:`refusal`), because our hooks patch SGLang internals by dotted
path and an untested release may move or change them silently; ``SGLANG_DFLASH_ALLOW_UNTESTED_SGLANG=1`` lets a
maintainer try another release anyway.

Import-light at module level (``importlib.metadata`` only): ``plugin.register`` runs in every SGLang process.
Adapters that need SGLang import it inside the function, and prefer detecting the feature over comparing versions,
so an allowed untested release takes the path that matches its code.

What differs between 0.5.17 and 0.5.23, and where each difference is handled:
- server arguments (startup.py): 0.5.23 seals ``ServerArgs`` while it resolves them; a resolution step reads
  through ``resolving_view`` and writes through ``declare_resolution`` (a plain assignment raises).
  -> :func:`args_view`, :func:`set_args`.
- the speculative worker's constructor (worker.py): 0.5.17 passes ``ps`` (ParallelState) to the worker and to
  ``build_draft_tp_worker``; 0.5.23 passes neither. -> :func:`draft_worker_parallel_kwargs`.
- ``DFlashDraftInputV2``'s host copy of the reserved KV lengths (worker.py): ``reserved_seq_lens_cpu`` in 0.5.17,
  ``nxt_kv_lens_cpu`` in 0.5.23. -> :func:`reserved_lens_cpu`.
- the attention-backend compatibility step (startup.py), which runs before the speculative step: a method of
  ``ServerArgs`` in 0.5.17, a function of ``arg_groups.attention_hook`` in 0.5.23; and where it lets trtllm_mha
  prefill run: Blackwell SM100 only in 0.5.17, also Hopper and SM120 in 0.5.23.
  -> :data:`ATTENTION_CHECKS_HOOK`, :data:`TRTLLM_MHA_PREFILL_MAJORS`.
- SGLang's replay commit of Gated DeltaNet state (``--enable-linear-replayssm-spec``; docs/notes-replayssm.md): in
  0.5.17 the verify writes each token's raw inputs into a per-slot window and the commit folds the accepted prefix
  into the state (``gdn_replayssm_spec_fold``); 0.5.23 replaced that for GDN by a circular history with cursors.
  Start-up turns the flag on where the fold was read and tested (0.5.17); both releases refuse it for a DFLASH
  target that is not KDA, a refusal aimed at their own DFLASH worker's commit, which our worker does not use
  (module global ``kimi_linear_config`` in 0.5.17, field ``hybrid_kda_config`` in 0.5.23).
  -> :data:`REPLAY_SSM_AUTO`, :data:`HYBRID_REQ_POOL_HOOK`, :func:`replay_pool_for_gdn`, :data:`GDN_EXTEND_HOOK`.
- prefill-decode disaggregation (disagg.py): the relay hooks were written against 0.5.17's decode scheduler; the
  draft-input builder takes (batch, server_args, last_tokens, future_map) there and (batch, last_tokens, future_map)
  in 0.5.23, which also has its own DFLASH relay. -> :func:`pd_release_ok`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import re

from ..settings import ALLOW_UNTESTED_SGLANG as ALLOW_UNTESTED_ENV, current as settings

# (major, minor, micro) of every release the CPU serving tests pass on; keep in step with pyproject's extras
# (serve = 0.5.17, serve-latest = 0.5.23) and the README's compatibility table.
TESTED_RELEASES = ((0, 5, 17), (0, 5, 23))


def _installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def release_of(version: str | None) -> tuple[int, ...] | None:
    """(major, minor, micro) of a version string ("0.5.23.post1" -> (0, 5, 23)); None if it has none."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(x) for x in m.groups()) if m else None


def _text(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


SGLANG_VERSION = _installed_sglang_version()  # None without SGLang (the algorithm layer needs none)
SGLANG_RELEASE = release_of(SGLANG_VERSION)
SUPPORTED_TEXT = " and ".join(_text(r) for r in TESTED_RELEASES)
_AT_MOST_0_5_17 = (SGLANG_RELEASE or (0, 5, 17)) <= (0, 5, 17)
# SGLang's attention-backend compatibility step; it runs before the speculative one (``_handle_dflash``)
ATTENTION_CHECKS_HOOK = ("sglang.srt.server_args.ServerArgs._handle_attention_backend_compatibility" if _AT_MOST_0_5_17
                         else "sglang.srt.arg_groups.attention_hook.handle_attention_backend_compatibility")
# compute-capability majors SGLang runs trtllm_mha prefill on (its own check, in that step)
TRTLLM_MHA_PREFILL_MAJORS = (10,) if _AT_MOST_0_5_17 else (9, 10, 12)


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not a release sglang-dflash was tested with; the message says the fix."""


def _allow_untested() -> bool:
    return settings().allow_untested_sglang


def refusal(version: str | None = None) -> str | None:
    """Why the plugin must not run on SGLang ``version`` (the installed one by default), or None if it may.

    A release outside :data:`TESTED_RELEASES` is refused unless ``SGLANG_DFLASH_ALLOW_UNTESTED_SGLANG=1``."""
    version = SGLANG_VERSION if version is None else version
    if release_of(version) in TESTED_RELEASES or _allow_untested():
        return None
    return (f"sglang {version or '(not installed)'} is not supported by sglang-dflash: it supports SGLang "
            f"{SUPPORTED_TEXT} (tested releases only, since its hooks patch SGLang internals that move between "
            f"releases). Fix: pip install 'sglang==0.5.17' (GPU line, torch 2.11) or 'sglang==0.5.23' (torch 2.14), "
            f"i.e. the extra serve or serve-latest of sglang-dflash (docs/VERSIONS.md); or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try this release at your own risk; or set SGLANG_DFLASH_WORKER=builtin to run "
            f"SGLang's own DFLASH worker without this plugin")


def check_supported(version: str | None = None) -> None:
    """Raise :class:`UnsupportedSGLangVersion` if the plugin must not run on SGLang ``version``."""
    reason = refusal(version)
    if reason is not None:
        raise UnsupportedSGLangVersion(reason)


# --------------------------------------------------------------------------------------------- server arguments
def _sealed(server_args) -> bool:
    # 0.5.23 seals the record while resolving (`_input_frozen`); 0.5.17 has no such flag and is assigned directly
    return bool(getattr(server_args, "_input_frozen", False))


def args_view(server_args):
    """What server-argument resolution has decided so far (0.5.23: raw inputs + earlier declarations)."""
    if _sealed(server_args):
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(server_args)
    return server_args


def set_args(server_args, source: str, **fields) -> None:
    """Set server arguments from a resolution step (0.5.23: a declaration named ``source``; 0.5.17: assignment)."""
    if _sealed(server_args):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, source, **fields)
        return
    for name, value in fields.items():
        setattr(server_args, name, value)


def dp_attention_enabled(cfg) -> bool:
    """DP attention requested: 0.5.17's ``--enable-dp-attention``; 0.5.23 deprecates it for ``--attn-dp-size``."""
    return bool(getattr(cfg, "enable_dp_attention", False)) or int(getattr(cfg, "attn_dp_size", 1) or 1) > 1


def target_hf_config(server_args):
    """The target's Hugging Face config (0.5.17: ``ServerArgs.get_model_config``; 0.5.23: ``model_config_of``)."""
    if hasattr(server_args, "get_model_config"):
        return server_args.get_model_config().hf_config
    from sglang.srt.arg_groups.overrides import model_config_of

    return model_config_of(server_args).hf_config


def prefill_graph_config():
    """This process's prefill CUDA-graph settings (backend, bs, max_bs), or None where SGLang published none (a
    model built outside a server: tests). Both releases keep the resolved config in the "exec" namespace (the
    worker reads its decode half there too)."""
    from sglang.srt.runtime_context import get_exec

    try:
        graphs = get_exec().graph.cuda_graph_config
    except ValueError:  # "config namespace 'exec' not published": no server, no graphs
        return None
    return getattr(graphs, "prefill", None)


def target_context_len(server_args) -> int:
    """The target's context length as SGLang derives it (the flag, else the checkpoint's), what the draft model's
    config is built with."""
    if hasattr(server_args, "get_model_config"):
        return int(server_args.get_model_config().context_len)
    from sglang.srt.arg_groups.overrides import model_config_of

    return int(model_config_of(server_args).context_len)


# ------------------------------------------------------------------------------------------ speculative worker
def draft_worker_parallel_kwargs(ps) -> dict:
    """The parallel-state argument ``build_draft_tp_worker`` takes: 0.5.17 wants ``ps`` (pipeline rank 0: the
    draft runs whole on every stage), 0.5.23 reads the process's parallel state itself and takes none."""
    from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker

    if "ps" not in inspect.signature(build_draft_tp_worker).parameters:
        return {}
    if ps is None:
        raise TypeError(f"sglang {SGLANG_VERSION}: build_draft_tp_worker needs the ParallelState `ps`, but the "
                        "scheduler passed none to the DFLASH worker")
    from dataclasses import replace

    return {"ps": replace(ps, pp_rank=0)}


def reserved_lens_cpu(state):
    """Host copy of the KV lengths reserved for the next step (``DFlashDraftInputV2``), or None."""
    lens = getattr(state, "nxt_kv_lens_cpu", None)  # 0.5.23
    if lens is None:
        lens = getattr(state, "reserved_seq_lens_cpu", None)  # 0.5.17
    return lens


# ---------------------------------------------------------------------------- prefill-decode disaggregation (#49)
def pd_release_ok() -> bool:
    """Whether our relay hooks (disagg.py) were read against this release's disaggregation code: 0.5.17 only (0.5.23
    has its own DFLASH relay for its worker and another decode scheduler, not read yet)."""
    return _AT_MOST_0_5_17


# ------------------------------------------------------------------------------ recurrent state: the replay commit
# Start-up turns --enable-linear-replayssm-spec on for Gated DeltaNet targets only on releases whose GDN replay is
# the fold-every-commit protocol (0.5.17: read, and tested on CPU under Triton's interpreter). On 0.5.23 (a circular
# history with cursors for GDN) the operator's flag is honoured and our commit goes through the same SGLang function,
# but start-up does not turn it on by itself.
REPLAY_SSM_AUTO = _AT_MOST_0_5_17
# where SGLang builds a hybrid target's request + recurrent-state pools (and refuses the flag for DFLASH + non-KDA)
HYBRID_REQ_POOL_HOOK = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool"
# the GDN layers' extend forward, TARGET_VERIFY included (0.5.17, gdn_backend.py): the k = 0 in-place switch hooks it
GDN_EXTEND_HOOK = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend"
_KDA_PROBE = "kimi_linear_config"  # 0.5.17: the configurator module's global that the refusal asks


class _NotKda:
    """What the refusal's KDA probe answers while it is lifted (any non-None value passes it)."""


@contextlib.contextmanager
def replay_pool_for_gdn(configurator):
    """Around SGLang's ``KVCacheConfigurator._build_hybrid_req_pool``: lets it build the replay pool (raw-input window,
    no per-draft-position state snapshots) for a Gated DeltaNet target under DFLASH.

    Both releases refuse ``--enable-linear-replayssm-spec`` with DSPARK / DFLASH unless the target is KDA
    (kv_cache_configurator.py ``_build_hybrid_req_pool``: "DSPARK/DFLASH commit routes through the backend fold
    (KDA-only)"): SGLang's own DFLASH worker commits through ``update_mamba_state_after_mtp_verify``, whose replay
    branch is KDA-only. Our worker commits through ``spec_utils.commit_mamba_states_after_verify`` (EAGLE's), which has
    the GDN replay, so the refusal does not concern it. For the call's duration the refusal's KDA probe answers
    "yes"; the only other reader of that probe in the call is the pool's ``enable_linear_replayssm_spec`` argument,
    ``gdn or kda``, already true for a GDN target. No-op unless the flag is on and the target is GDN."""
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config
    from sglang.srt.runtime_context import get_exec

    if not (get_exec().mamba.enable_linear_replayssm_spec and hybrid_gdn_config(configurator.model_config) is not None):
        yield
        return
    if hasattr(configurator, "hybrid_kda_config"):  # 0.5.23: a field of the configurator
        saved = configurator.hybrid_kda_config
        configurator.hybrid_kda_config = saved if saved is not None else _NotKda()
        try:
            yield
        finally:
            configurator.hybrid_kda_config = saved
        return
    import sys

    module = sys.modules[type(configurator).__module__]  # 0.5.17: a module global the method calls
    probe = getattr(module, _KDA_PROBE)
    setattr(module, _KDA_PROBE, lambda model_config: probe(model_config) or _NotKda())
    try:
        yield
    finally:
        setattr(module, _KDA_PROBE, probe)
