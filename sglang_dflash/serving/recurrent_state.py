"""The recurrent state of hybrid targets (Qwen3.5, Qwen3-Next: linear-attention layers between attention layers)
under speculative verify.

A verify pass runs W = k + 1 tokens through every layer. Attention layers write K/V per token slot, and rows past
the commit are simply rewritten by the next step (worker.py). A linear-attention layer instead carries ONE state per
request, advanced token by token, so after a verify its state must be the state after exactly commit_len of the W
tokens, not after W. SGLang's hybrid attention backend runs TARGET_VERIFY without touching the persistent state: it
keeps the state after every verified token in per-step caches, and `update_mamba_state_after_mtp_verify` copies the
chosen step's state (and conv window) into the request's slot. So the commit of a verify step is: step index
commit_len - 1 for every request (a chain; no tree), one fused launch, no host sync.

Radix caching of hybrid models (`--mamba-radix-cache-strategy extra_buffer`) also keeps snapshots of the state at
every `mamba_track_interval` tokens, for later requests that share the prefix. A verify that crosses such a boundary
must snapshot the state of the step that ends exactly on it: step boundary - prefix - 1, which always lies inside
the committed steps (the boundary is at most the new length). SGLang rebuilds the snapshot slots
(`mamba_track_indices`) from the requests before each verify (`prepare_mamba_track_for_verify`).

Targets without recurrent layers: nothing here runs (`active` is False).
"""

from __future__ import annotations

import torch


class RecurrentStateCommit:
    def __init__(self, model_runner):
        from sglang.srt.configs.hybrid_arch import mambaish_config

        self.model_runner = model_runner
        self.active = mambaish_config(model_runner.model_config) is not None
        if self.active and not hasattr(model_runner.attn_backend, "update_mamba_state_after_mtp_verify"):
            raise RuntimeError(
                f"the target {type(model_runner.model).__name__} has recurrent (linear-attention) layers, but its "
                f"attention backend {type(model_runner.attn_backend).__name__} cannot restore their state after a "
                "speculative verify, so DFLASH would not be lossless. Fix: serve it with SGLang's hybrid attention "
                "backend (the default for this model), or without --speculative-algorithm DFLASH")

    def before_verify(self, batch) -> None:
        """Snapshot slots for the radix cache, rebuilt from the requests (extra_buffer strategy; else a no-op)."""
        if self.active:
            from sglang.srt.speculative.spec_utils import prepare_mamba_track_for_verify

            prepare_mamba_track_for_verify(batch)

    def after_accept(self, backend, batch, prefix: torch.Tensor, commit_lens: torch.Tensor) -> None:
        """Every request's recurrent state := its state after commit_lens of the verified tokens. `backend` is the
        attention backend that ran this verify (its metadata names the requests' state slots; each verify width
        has its own backend: verify_widths.py)."""
        if not self.active:
            return
        steps = commit_lens.to(torch.int64) - 1
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=steps, mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=self._steps_to_track(batch, prefix, commit_lens), model=self.model_runner.model)

    @staticmethod
    def _steps_to_track(batch, prefix: torch.Tensor, commit_lens: torch.Tensor) -> torch.Tensor | None:
        """Per request, the verify step whose state ends on a snapshot boundary crossed by this commit, else -1."""
        if batch.mamba_track_indices is None:
            return None
        from sglang.srt.runtime_context import get_exec

        return boundary_steps(prefix, commit_lens, int(get_exec().mamba.mamba_track_interval))


def boundary_steps(prefix: torch.Tensor, commit_lens: torch.Tensor, interval: int) -> torch.Tensor:
    """For lengths prefix -> prefix + commit_lens: the step i (0-based, state after prefix + i + 1 tokens) that ends
    exactly on a multiple of `interval` crossed on the way, or -1 where none is crossed."""
    prefix = prefix.to(torch.int64)
    new = prefix + commit_lens.to(torch.int64)
    boundary = new // interval * interval
    crossed = prefix // interval != new // interval
    return torch.where(crossed, boundary - prefix - 1, torch.full_like(prefix, -1))
