"""The commit folded into the target's verify forward (sglang_dflash/serving/context_commit.py): it writes the
verified rows' context K/V with the forward's own hidden states, positions and slots, only for TARGET_VERIFY, and
keeps the forward's signature (SGLang's graph runner inspects it). End to end (acceptance collapses without the
write): tests/serving/test_e2e_cpu.py::test_acceptance_above_one."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.serving.context_commit import ContextCommitInVerify


class _Mode:
    def __init__(self, verify: bool):
        self.verify = verify

    def is_target_verify(self):
        return self.verify


class _Target:
    def __init__(self, hidden):
        self.hidden = hidden

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        return SimpleNamespace(hidden_states=self.hidden, next_token_logits=input_ids.float())


class _Draft:
    def __init__(self):
        self.writes = []

    def write_context_kv(self, features, positions, cache_loc, pool):
        self.writes.append((features, positions, cache_loc, pool))


def _batch(verify: bool, n: int):
    return SimpleNamespace(forward_mode=_Mode(verify), out_cache_loc=torch.arange(100, 100 + n))


def test_verify_forward_writes_its_rows():
    hidden = torch.randn(6, 8)
    target, draft = _Target(hidden), _Draft()
    commit = ContextCommitInVerify(target, draft, lambda: "pool")
    ids, pos = torch.arange(6), torch.arange(40, 46)
    fb = _batch(True, 6)
    out = target.forward(ids, pos, fb)
    assert out.hidden_states is hidden and commit.calls == 1
    (features, positions, cache_loc, pool), = draft.writes
    assert features is hidden and positions is pos and cache_loc is fb.out_cache_loc and pool == "pool"


def test_other_modes_write_nothing():
    target, draft = _Target(torch.randn(3, 8)), _Draft()
    commit = ContextCommitInVerify(target, draft, lambda: "pool")
    target.forward(torch.arange(3), torch.arange(3), _batch(False, 3))
    assert draft.writes == [] and commit.calls == 0


def test_verify_without_hidden_states_says_the_fix():
    target = _Target(None)
    ContextCommitInVerify(target, _Draft(), lambda: "pool")
    with pytest.raises(RuntimeError, match="Fix: the target's hidden capture"):
        target.forward(torch.arange(2), torch.arange(2), _batch(True, 2))


def test_signature_is_kept():
    target = _Target(torch.randn(1, 8))
    before = inspect.signature(target.forward)
    ContextCommitInVerify(target, _Draft(), lambda: "pool")
    assert inspect.signature(target.forward) == before
    assert "pp_proxy_tensors" in inspect.signature(target.forward).parameters
