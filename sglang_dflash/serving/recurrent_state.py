"""The recurrent state of hybrid targets (Qwen3.5, Qwen3-Next: linear-attention layers between attention layers)
under speculative verify.

A verify pass runs W = k + 1 tokens through every layer. Attention layers write K/V per token slot, and rows past
the commit are simply rewritten by the next step (worker.py). A linear-attention layer instead carries ONE state per
request, advanced token by token, so after a verify its state must be the state after exactly commit_len of the W
tokens, not after W. SGLang's hybrid attention backend runs TARGET_VERIFY without touching the persistent state, and
the commit sets it afterwards, one of two ways (docs/notes-replayssm.md):

- snapshot scatter (the default): the verify keeps the state after every verified token in per-step caches (a full
  SSM state per draft position per running request, which SGLang's memory plan reserves up front), and
  ``update_mamba_state_after_mtp_verify`` copies the chosen step's state (and conv window) into the request's slot:
  step index commit_len - 1 for every request (a chain; no tree), one fused launch, no host sync.
- replay (SGLang's ``--enable-linear-replayssm-spec``, which start-up turns on for Gated DeltaNet targets where it
  applies, startup.check_replay_ssm): no snapshots; the verify records each token's raw inputs (k, v, gate, beta) in
  a per-slot window, and the commit replays the first commit_len of them into the state with SGLang's fold kernel
  (the one its EAGLE commit ``spec_utils.commit_mamba_states_after_verify`` calls; conv windows still roll back by
  step). The worker uses it when the pool was built for it (``replay_pool``), at every width W (k = 0 included: a
  window of one).
- in place at k = 0 (the default with the replay pool since 2026-11-28; SGLANG_DFLASH_K0_STATE_IN_PLACE=0 folds): a verify of one token
  per request commits exactly that token, so it runs what SGLang's GDN decode runs (``verify_one_token_as_decode``:
  the conv window and the state updated in place by the decode kernels, no record) and the commit only fills crossed
  track slots. The replay verify reads each request's state for its output and the fold reads and writes it again,
  one read more than plain decoding (~59 MB of fp32 state per request on Qwen3.5-35B-A3B); the verify-mode conv also
  writes a window per step. A profile at c = 64 put the k = 0 step's GPU work 1.18 ms over plain decoding's with
  the state in place but the verify's conv and GDN kernels, 0.53 + 0.38 ms of it in those two
  (benchmarks/results/floor-qwen3.5-inplace-h200).

Radix caching of hybrid models (`--mamba-radix-cache-strategy extra_buffer`) also keeps snapshots of the state at
every `mamba_track_interval` tokens, for later requests that share the prefix. A verify that crosses such a boundary
must snapshot the state of the step that ends exactly on it: step boundary - prefix - 1, which always lies inside
the committed steps (the boundary is at most the new length). SGLang rebuilds the snapshot slots
(`mamba_track_indices`) from the requests before each verify (`prepare_mamba_track_for_verify`); the replay stores
that step's state in the track slot as it passes it.

Targets without recurrent layers: nothing here runs (`active` is False).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import torch

from .. import settings
from ..settings import K0_STATE_IN_PLACE
from . import compat
from .errors import DFlashStartupError

logger = logging.getLogger("sglang_dflash")


def replay_pool(req_to_token_pool) -> bool:
    """Whether SGLang built this request pool's recurrent state for the replay commit (a raw-input window per slot, no
    per-draft-position snapshots): ``--enable-linear-replayssm-spec`` on a GDN / KDA target. The flag alone does not
    say it (a unified memory pool, for one, builds no window), so the pool is asked."""
    mamba_pool = getattr(req_to_token_pool, "mamba_pool", None)
    return bool(getattr(mamba_pool, "enable_linear_replayssm_spec", False))


class RecurrentStateCommit:
    def __init__(self, model_runner):
        from sglang.srt.configs.hybrid_arch import mambaish_config

        self.model_runner = model_runner
        self.active = mambaish_config(model_runner.model_config) is not None
        self.replay = self.active and replay_pool(getattr(model_runner, "req_to_token_pool", None))
        self.in_place = (self.replay and in_place_pool(model_runner.req_to_token_pool)
                         and settings.get(K0_STATE_IN_PLACE) and not _IN_PLACE_UNAVAILABLE)
        # SGLang's commit takes a target worker and reads only its model runner
        self._target = SimpleNamespace(model_runner=model_runner)
        self._rows = None  # 0, 1, 2, ...: the accept index of a chain verify is a [bs, W] view of it
        if self.active and not self.replay and not hasattr(model_runner.attn_backend,
                                                           "update_mamba_state_after_mtp_verify"):
            raise RuntimeError(
                f"the target {type(model_runner.model).__name__} has recurrent (linear-attention) layers, but its "
                f"attention backend {type(model_runner.attn_backend).__name__} cannot restore their state after a "
                "speculative verify, so DFLASH would not be lossless. Fix: serve it with SGLang's hybrid attention "
                "backend (the default for this model), or without --speculative-algorithm DFLASH")
        if self.active:
            how = ("by replaying the accepted tokens' recorded inputs (--enable-linear-replayssm-spec: no state "
                   "snapshot per draft position)" if self.replay else
                   "from per-draft-position state snapshots (SGLang's scatter)")
            logger.info("sglang-dflash: hybrid target %s: recurrent state committed %s",
                        type(model_runner.model).__name__, how)

    def before_verify(self, batch) -> None:
        """Snapshot slots for the radix cache, rebuilt from the requests (extra_buffer strategy; else a no-op)."""
        if self.active:
            from sglang.srt.speculative.spec_utils import prepare_mamba_track_for_verify

            prepare_mamba_track_for_verify(batch)

    def after_accept(self, backend, batch, prefix: torch.Tensor, commit_lens: torch.Tensor, width: int) -> None:
        """Every request's recurrent state := its state after commit_lens of the `width` verified tokens. `backend` is
        the attention backend that ran this verify (its metadata names the requests' state slots; each verify width
        has its own backend: verify_widths.py); the replay commit reads the slots from the request pool instead."""
        if not self.active:
            return
        if self.in_place and width == 1:
            self._commit_in_place(batch, commit_lens)
            return
        if self.replay:
            self._replay(batch, commit_lens, width)
            return
        steps = commit_lens.to(torch.int64) - 1
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=steps, mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=self._steps_to_track(batch, prefix, commit_lens), model=self.model_runner.model)

    def _replay(self, batch, commit_lens: torch.Tensor, width: int) -> None:
        """Every request's first commit_lens recorded tokens folded into its state (and the state at a crossed radix
        interval into its track slot), the conv window rolled back to step commit_lens - 1.

        SGLang 0.5.17's replay pool folds at every commit (``replayssm_spec_fold``): we call that fold directly with a
        chain's step indices, commit_lens - 1 and ``boundary_steps`` from the lengths before the verify
        (batch.seq_lens), which is what SGLang's EAGLE commit (``commit_mamba_states_after_verify``) derives, through
        ~12 more small launches, from an accept index: that host time bounded the k = 0 step on Qwen3.5
        (benchmarks/results/floor-qwen3.5-replay-h200). Any other replay flavour (KDA, a pool without the fold) goes
        through SGLang's commit with a chain's accept index (row i's verify rows i * width .. i * width + width - 1)."""
        pool = self.model_runner.req_to_token_pool
        mamba_pool = pool.mamba_pool
        bs = commit_lens.shape[0]
        if not fold_pool(pool):
            from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify

            accept_index = self._accept_index(bs, width, commit_lens.device)
            commit_mamba_states_after_verify(self._target, batch, commit_lens, accept_index, width)
            return
        if bs == 0:
            return
        from sglang.kernels.ops.attention.fla import gdn_replayssm_spec_fold as fold

        track = batch.mamba_track_indices
        steps_to_track = None
        if track is not None:
            from sglang.srt.runtime_context import get_exec

            steps_to_track = boundary_steps(batch.seq_lens, commit_lens, int(get_exec().mamba.mamba_track_interval))
        fold.commit_gdn_replayssm_fold_after_verify(
            spec_state=pool.get_speculative_mamba2_params_all_layers(),
            state_batch_indices=pool.get_mamba_indices(batch.req_pool_indices), accept_lens=commit_lens,
            last_correct_step_indices=commit_lens - 1, mamba_track_indices=track, mamba_steps_to_track=steps_to_track,
            null_block_id=-1)

    def _commit_in_place(self, batch, commit_lens: torch.Tensor) -> None:
        """After a one-token verify that advanced every conv window and state in place (``verify_one_token_as_decode``):
        a radix track slot crossed by this token given the new state and window (SGLang's all-layers track copy, what
        its decode runs)."""
        if batch.mamba_track_indices is None or commit_lens.shape[0] == 0:
            return
        from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter
        from sglang.srt.runtime_context import get_exec

        pool = self.model_runner.req_to_token_pool
        spec = pool.get_speculative_mamba2_params_all_layers()
        crossed = boundary_steps(batch.seq_lens, commit_lens, int(get_exec().mamba.mamba_track_interval)) >= 0
        scatter.track_mamba_states_all_layers(spec.conv[0], spec.temporal, pool.get_mamba_indices(batch.req_pool_indices),
                                              crossed, batch.mamba_track_indices, commit_lens.shape[0])

    def _accept_index(self, bs: int, width: int, device: torch.device) -> torch.Tensor:
        """[bs, width] int32: i * width + j (no launch once the buffer is large enough; it doubles when not)."""
        n = bs * width
        if self._rows is None or self._rows.numel() < n or self._rows.device != device:
            size = max(n, 2 * self._rows.numel()) if self._rows is not None else n
            self._rows = torch.arange(size, dtype=torch.int32, device=device)
        return self._rows[:n].view(bs, width)

    @staticmethod
    def _steps_to_track(batch, prefix: torch.Tensor, commit_lens: torch.Tensor) -> torch.Tensor | None:
        """Per request, the verify step whose state ends on a snapshot boundary crossed by this commit, else -1."""
        if batch.mamba_track_indices is None:
            return None
        from sglang.srt.runtime_context import get_exec

        return boundary_steps(prefix, commit_lens, int(get_exec().mamba.mamba_track_interval))


def fold_pool(req_to_token_pool) -> bool:
    """A GDN replay pool that folds at every commit (SGLang 0.5.17's ``replayssm_spec_fold``; not KDA): the pool whose
    verify is ``GDNAttnBackend._replayssm_fold_target_verify`` and whose commit is the fold."""
    mamba_pool = req_to_token_pool.mamba_pool
    return bool(getattr(mamba_pool, "replayssm_spec_fold", False) and not getattr(mamba_pool, "replayssm_is_kda", False))


def in_place_pool(req_to_token_pool) -> bool:
    """The pool on which SGLANG_DFLASH_K0_STATE_IN_PLACE applies: a replay pool that folds at every commit. The verify
    hook and the commit ask the same question, so a k = 0 verify runs in place exactly where its commit skips the
    fold."""
    return replay_pool(req_to_token_pool) and fold_pool(req_to_token_pool)


_EXTEND_ARGS = ("layer", "forward_batch", "mixed_qkv", "a", "b")  # GDNAttnBackend.forward_extend's, after self


def verify_one_token_as_decode(original, backend, *args, **kw):
    """AROUND hook on SGLang's GDN ``forward_extend`` (``compat.GDN_EXTEND_HOOK``), installed with
    SGLANG_DFLASH_K0_STATE_IN_PLACE=1: a TARGET_VERIFY of one token per request on an in-place pool (our k = 0 step)
    runs SGLang's GDN decode kernels (``decode_one_token``), whose token is always committed (``_commit_in_place``);
    anything else is SGLang's own forward. The width is fixed per CUDA graph, so each verify graph captures one of the
    two."""
    got = dict(zip(_EXTEND_ARGS, args))
    got.update((name, kw[name]) for name in _EXTEND_ARGS if name in kw)
    batch = got.get("forward_batch")
    if (batch is None or not batch.forward_mode.is_target_verify() or batch.spec_info.draft_token_num != 1
            or not in_place_pool(backend.req_to_token_pool)):
        return original(backend, *args, **kw)
    return decode_one_token(backend, got["layer"], got["mixed_qkv"], got["a"], got["b"])


def decode_one_token(backend, layer, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One token per request through a GDN layer as SGLang's decode runs it (GDNAttnBackend.forward_decode): the conv
    window rolled and the recurrent state advanced in place, in the request's own slots, by the same kernels, so a
    k = 0 step's outputs are plain decoding's. Left to the commit: the radix track copy (decode does it inside)."""
    from sglang.srt.layers.attention.linear import gdn_backend

    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    slots = backend.forward_metadata.mamba_cache_indices[: mixed_qkv.shape[0]]
    x = gdn_backend.causal_conv1d_update(mixed_qkv, cache.conv[0], layer.conv_weights, layer.bias, layer.activation,
                                         conv_state_indices=slots)
    kernels = backend.kernel_dispatcher
    if kernels.supports_packed_decode:
        return kernels.packed_decode(x, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias, scale=layer.head_k_dim ** -0.5,
                                     ssm_states=cache.temporal, cache_indices=slots, num_v_heads=layer.num_v_heads,
                                     head_v_dim=layer.head_v_dim)
    bs = x.shape[0]
    q, k, v = torch.split(x, [layer.q_dim, layer.k_dim, layer.v_dim], dim=-1)
    return kernels.decode(q=q.view(1, bs, layer.num_q_heads, layer.head_q_dim),
                          k=k.view(1, bs, layer.num_k_heads, layer.head_k_dim),
                          v=v.view(1, bs, layer.num_v_heads, layer.head_v_dim), a=a, b=b, A_log=layer.A_log,
                          dt_bias=layer.dt_bias, ssm_states=cache.temporal, cache_indices=slots,
                          query_start_loc=backend.forward_metadata.query_start_loc)


def boundary_steps(prefix: torch.Tensor, commit_lens: torch.Tensor, interval: int) -> torch.Tensor:
    """For lengths prefix -> prefix + commit_lens: the step i (0-based, state after prefix + i + 1 tokens) that ends
    exactly on a multiple of `interval` crossed on the way, or -1 where none is crossed."""
    prefix = prefix.to(torch.int64)
    new = prefix + commit_lens.to(torch.int64)
    boundary = new // interval * interval
    crossed = prefix // interval != new // interval
    return torch.where(crossed, boundary - prefix - 1, torch.full_like(prefix, -1))


# ------------------------------------------------------------------------------------ the replay pool at start-up
_POOL_HOOK_INSTALLED = False
_IN_PLACE_HOOK_INSTALLED = False
_IN_PLACE_UNAVAILABLE = False  # the in-place switch is on by default, and this SGLang cannot: the fold commits k = 0


def build_pool_for_replay(original, configurator, *args, **kwargs):
    """AROUND hook on SGLang's ``KVCacheConfigurator._build_hybrid_req_pool``: SGLang refuses the replay pool for a
    DFLASH target that is not KDA, a refusal about its own DFLASH worker's commit; ours commits through the function
    that has the GDN replay (compat.replay_pool_for_gdn says how the refusal is lifted for the call)."""
    with compat.replay_pool_for_gdn(configurator):
        return original(configurator, *args, **kwargs)


def install_replay_pool_hook(server_args) -> None:
    """With --enable-linear-replayssm-spec, hook the target's pool build (``build_pool_for_replay``). Called by the
    worker's constructor: it runs in the scheduler process before SGLang builds the target's pools
    (Scheduler.init_model_worker: the draft worker, then init_memory_pools). Once per process."""
    global _POOL_HOOK_INSTALLED, _IN_PLACE_HOOK_INSTALLED, _IN_PLACE_UNAVAILABLE
    if not getattr(server_args, "enable_linear_replayssm_spec", False):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not _POOL_HOOK_INSTALLED:
        HookRegistry.register(compat.HYBRID_REQ_POOL_HOOK, build_pool_for_replay, HookType.AROUND)
        _POOL_HOOK_INSTALLED = True
    if settings.get(K0_STATE_IN_PLACE) and not _IN_PLACE_HOOK_INSTALLED:
        from sglang.srt.layers.attention.linear import gdn_backend

        if hasattr(gdn_backend.GDNAttnBackend, "_replayssm_fold_target_verify"):
            HookRegistry.register(compat.GDN_EXTEND_HOOK, verify_one_token_as_decode, HookType.AROUND)
            _IN_PLACE_HOOK_INSTALLED = True
            logger.info("sglang-dflash: k = 0 steps update the recurrent state in place (%s=1)", K0_STATE_IN_PLACE)
        elif os.environ.get(K0_STATE_IN_PLACE):  # asked for by name: refuse rather than quietly fold
            raise DFlashStartupError(
                f"{K0_STATE_IN_PLACE}=1: this SGLang's GDN backend has no replay fold verify (SGLang 0.5.17's "
                f"protocol). Fix: unset {K0_STATE_IN_PLACE}")
        else:  # the default on another SGLang: every step's commit folds, as before the switch existed
            _IN_PLACE_UNAVAILABLE = True
            logger.info("sglang-dflash: this SGLang's GDN backend has no replay fold verify: k = 0 steps fold their "
                        "recurrent state like wider ones")
    HookRegistry.apply_hooks()
