"""The decisive chain head of random-weight targets (sglang_dflash/targets/chain_head.py; issues #44, #45): the
margin lands on CHAIN[input token] of each logits row in decode / verify and on each prompt's last token in a
prefill, rows it cannot map are left alone, and it hooks targets only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_dflash.targets.chain_head import MARGIN, ChainHead, attach, chain_map, chain_walk


def _logits(rows, vocab, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4.0


def test_chain_map_is_seeded_and_in_range():
    a, b = chain_map(1000), chain_map(1000)
    assert torch.equal(a, b) and a.min() >= 0 and a.max() < 1000
    assert not torch.equal(a, chain_map(1000, seed=1))
    walk = chain_walk(7, 20, 1000)
    assert walk[0] == int(a[7]) and all(int(a[x]) == y for x, y in zip(walk, walk[1:]))


def test_decode_and_verify_rows_take_the_chain_of_their_input_token():
    head, vocab = ChainHead(500, "cpu"), 500
    ids = torch.tensor([3, 17, 17, 499, 0])
    out = SimpleNamespace(next_token_logits=_logits(5, vocab))
    before = out.next_token_logits.clone()
    head(None, (ids, None, None, SimpleNamespace(extend_seq_lens=None)), {}, out)
    assert torch.equal(out.next_token_logits.argmax(-1), head.table[ids])
    diff = out.next_token_logits - before
    assert torch.allclose(diff.sum(-1), torch.full((5,), MARGIN)) and int((diff != 0).sum()) == 5


def test_prefill_rows_take_each_prompts_last_token():
    head = ChainHead(300, "cpu")
    ids = torch.tensor([5, 6, 7, 8, 9, 10])  # prompts of 2, 3 and 1 tokens
    out = SimpleNamespace(next_token_logits=_logits(3, 300))
    head(None, (), {"input_ids": ids, "logits_metadata": SimpleNamespace(extend_seq_lens=torch.tensor([2, 3, 1]))},
         out)
    assert out.next_token_logits.argmax(-1).tolist() == head.table[torch.tensor([6, 9, 10])].tolist()


def test_rows_it_cannot_map_are_left_alone():
    head = ChainHead(300, "cpu")
    out = SimpleNamespace(next_token_logits=_logits(2, 300))
    before = out.next_token_logits.clone()
    head(None, (torch.arange(5), None, None, SimpleNamespace(extend_seq_lens=None)), {}, out)
    assert torch.equal(out.next_token_logits, before) and head.skipped == 1
    head(None, (torch.arange(5),), {}, SimpleNamespace(next_token_logits=None))  # e.g. an autotune dummy run


class _Target(torch.nn.Module):
    def __init__(self, name="Qwen3ForCausalLM"):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=64)
        self.embed = torch.nn.Embedding(64, 8)
        self.logits_processor = torch.nn.Identity()


def test_attach_hooks_targets_not_drafters():
    target = _Target()
    head = attach(target)
    assert head is not None and head.vocab == 64
    draft = type("DFlashDraftModel", (_Target,), {})()
    assert attach(draft) is None
    assert attach(torch.nn.Linear(2, 2)) is None
