"""The commit of a hybrid target's recurrent (linear-attention) state after a verify (serving/recurrent_state.py):
which verify step's state each request keeps, and which one the radix cache snapshots. The state copy itself is
SGLang's kernel (GPU); here its inputs are checked against a token-by-token replay of what the state has seen."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dflash.serving.recurrent_state import RecurrentStateCommit, boundary_steps  # noqa: E402


def _replay_boundary_step(prefix: int, commit: int, interval: int) -> int:
    """Walk the committed tokens one by one: the step after which the length is a multiple of interval."""
    for i in range(commit):
        if (prefix + i + 1) % interval == 0:
            return i
    return -1


@pytest.mark.parametrize("interval", [16, 64])
def test_boundary_steps_match_a_token_by_token_replay(interval):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 300, (500,), generator=g)
    commit = torch.randint(1, 17, (500,), generator=g)
    got = boundary_steps(prefix, commit, interval)
    want = [_replay_boundary_step(int(p), int(c), interval) for p, c in zip(prefix, commit)]
    assert got.tolist() == want
    assert (got >= 0).any() and (got < 0).any()


class FakeBackend:
    def __init__(self):
        self.calls = []

    def update_mamba_state_after_mtp_verify(self, **kw):
        self.calls.append(kw)


def _commit_for(monkeypatch, hybrid: bool):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "mambaish_config", lambda mc: object() if hybrid else None)
    runner = SimpleNamespace(model_config=None, model="target", attn_backend=FakeBackend())
    return RecurrentStateCommit(runner), runner


def test_each_request_keeps_the_state_after_its_committed_tokens(monkeypatch):
    commit, runner = _commit_for(monkeypatch, hybrid=True)
    width_backend = FakeBackend()  # the verify ran on another width's backend: that one's metadata is used
    batch = SimpleNamespace(mamba_track_indices=None)
    commit.after_accept(width_backend, batch, torch.tensor([5, 9]), torch.tensor([1, 16], dtype=torch.int32))
    (call,) = width_backend.calls
    assert call["last_correct_step_indices"].tolist() == [0, 15] and call["mamba_steps_to_track"] is None
    assert call["model"] == "target" and not runner.attn_backend.calls


def test_no_recurrent_layers_no_commit(monkeypatch):
    commit, runner = _commit_for(monkeypatch, hybrid=False)
    backend = FakeBackend()
    commit.after_accept(backend, SimpleNamespace(mamba_track_indices=None), torch.tensor([1]), torch.tensor([2]))
    assert not backend.calls and not commit.active


def test_a_hybrid_target_whose_backend_cannot_restore_state_is_refused(monkeypatch):
    import sglang.srt.configs.hybrid_arch as arch

    monkeypatch.setattr(arch, "mambaish_config", lambda mc: object())
    runner = SimpleNamespace(model_config=None, model=torch.nn.Identity(), attn_backend=object())
    with pytest.raises(RuntimeError, match="cannot restore their state.*Fix"):
        RecurrentStateCommit(runner)
