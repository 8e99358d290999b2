"""The greedy draft head inside the draft CUDA graph (DFlashWorker._capture_draft_head) drafts what the eager head
drafts, and DFlashWorker._draft reads the graph's drafts only from a replay of a graph that computed them, and never
for a DFlash2 batch with sampled rows (whose drafts are drawn from q by the eager head, after the replay).

The hook is what SGLang's graph runner calls at the end of every draft-graph capture (``capture_tail_hooks``); on
the GPU its ops are recorded and replayed with the graph. Here it is called directly on CPU tensors, as at capture,
and ``_draft`` runs on a stand-in draft runner whose forward reports a replay (or not) of a given padded batch size.
"""

from __future__ import annotations

import contextlib
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dflash.serving import worker  # noqa: E402

B, H, V, CAP = 6, 8, 50, 4


def stand_in(hidden: torch.Tensor, replayed_bs: int | None):
    g = torch.Generator().manual_seed(1)
    head = torch.randn(V, H, generator=g)
    runner = SimpleNamespace(
        forward=lambda fb: SimpleNamespace(can_run_graph=replayed_bs is not None,
                                           logits_output=SimpleNamespace(hidden_states=hidden)),
        decode_cuda_graph_runner=SimpleNamespace(bs=replayed_bs))
    me = SimpleNamespace(block=B, draft_runner=runner, _draft_spec_info=None, _graph_head_bs=set(),
                         _graph_greedy_head=True, _tree_buffers=None,  # the chain's head alone (tree off)
                         _graph_drafts=torch.full((CAP, B - 1), -1, dtype=torch.int64),
                         draft_model=SimpleNamespace(greedy_drafts=lambda h, anchors: (h @ head.T).argmax(-1)))
    me._draft_forward = types.MethodType(worker.DFlashWorker._draft_forward, me)  # the drafter pass, on the stand-in
    return me, head


def _batch(num_tokens: int):
    """The captured batch as the hook sees it: the block ids (bonus, MASK...) the draft forward ran on."""
    return SimpleNamespace(input_ids=torch.zeros(num_tokens, dtype=torch.int64))


def eager_drafts(hidden, head, bs, k):
    rows = hidden[: bs * B].view(bs, B, -1)[:, 1:k + 1]
    return (rows @ head.T).argmax(-1)


def draft(me, bs, k, temperature=None, width=None):
    """The drafts [bs, k] of _draft (temperature None: point masses; else the stand-in's propose draws them)."""
    z = torch.zeros((bs, B), dtype=torch.int64)
    batch = SimpleNamespace(req_pool_indices=torch.arange(bs))
    return worker.DFlashWorker._draft(me, batch, z, z, z, torch.full((bs,), 5), (None, None), bs, k, temperature,
                                      width=width).tokens


@pytest.mark.parametrize("bs,padded", [(1, 1), (3, 4)])
def test_graph_head_drafts_what_the_eager_head_drafts(bs, padded):
    hidden = torch.randn(padded * B, H)
    me, head = stand_in(hidden, replayed_bs=padded)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=hidden), _batch(padded * B),
                                            padded * B)
    assert me._graph_head_bs == {(B, padded)}
    for k in range(1, B):
        got = draft(me, bs, k)
        assert torch.equal(got, eager_drafts(hidden, head, bs, k)), k
        assert got.data_ptr() == me._graph_drafts.data_ptr()  # read from the graph's buffer, not recomputed


def test_eager_head_where_the_replayed_graph_has_none():
    hidden = torch.randn(4 * B, H)
    me, head = stand_in(hidden, replayed_bs=4)
    me._graph_head_bs = {(B, 1), (B, 2)}  # captured with the head at 1 and 2 only; the buffer holds stale drafts
    got = draft(me, 3, B - 1)
    assert torch.equal(got, eager_drafts(hidden, head, 3, B - 1))
    me, head = stand_in(hidden, replayed_bs=None)  # an eager forward (no replay) never reads the buffer
    me._graph_head_bs = {(B, 4)}
    assert torch.equal(draft(me, 3, 2), eager_drafts(hidden, head, 3, 2))


def test_large_batches_keep_the_eager_head(monkeypatch):
    monkeypatch.setattr(worker, "GRAPH_HEAD_MAX_ROWS", 2 * (B - 1))
    hidden = torch.randn(3 * B, H)
    me, _ = stand_in(hidden, replayed_bs=3)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=hidden), _batch(3 * B), 3 * B)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=hidden), _batch(2 * B), 2 * B)
    assert me._graph_head_bs == {(B, 2)}
    big = torch.randn((CAP + 1) * B, H)  # a captured batch larger than the buffer: left out, nothing written
    monkeypatch.setattr(worker, "GRAPH_HEAD_MAX_ROWS", 10_000)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=big), _batch((CAP + 1) * B), (CAP + 1) * B)
    assert (B, CAP + 1) not in me._graph_head_bs


def test_sampled_dflash2_batch_drafts_eagerly_after_a_graph_replay():
    """The graphs record the argmax head only: a batch whose drafts are drawn from q (a temperature is given) must
    not read them, even from a replay of a graph that computed them, but run the eager propose on the replay's
    hidden states (the rows of block positions 1..k) with the rows' temperatures."""
    hidden = torch.randn(4 * B, H)
    me, head = stand_in(hidden, replayed_bs=4)
    worker.DFlashWorker._capture_draft_head(me, None, SimpleNamespace(hidden_states=hidden), _batch(4 * B), 4 * B)
    assert me._graph_head_bs == {(B, 4)}
    seen = {}

    def propose(rows, anchors, temperature):
        seen.update(rows=rows, temperature=temperature)
        return worker.DraftBlock((rows @ head.T).argmax(-1).view(anchors.shape[0], -1) + 1)  # not the graph's

    me.draft_model.propose, me._logged_q_drafts = propose, False
    temperature = torch.tensor([0.0, 0.7, 1.2])
    got = draft(me, 3, 2, temperature)
    assert torch.equal(got, eager_drafts(hidden, head, 3, 2) + 1)
    assert torch.equal(seen["rows"], hidden[:3 * B].view(3, B, H)[:, 1:3].reshape(6, H))
    assert seen["temperature"] is temperature and me._logged_q_drafts


def test_cpu_draft_head_reads_the_target_weight_or_its_bfloat16_copy():
    """On a CPU the draft head may multiply with a bfloat16 copy of the target's float32 lm_head (draft_model.
    cpu_draft_head: where this CPU runs it 1.5x faster); anything else reads the target's own weight."""
    from sglang_dflash.serving.draft_model import cpu_draft_head

    w = torch.randn(4096, 64)
    head = cpu_draft_head(w)
    assert head is w or (head.dtype == torch.bfloat16 and torch.equal(head, w.to(torch.bfloat16)))
    low = w.to(torch.bfloat16)
    assert cpu_draft_head(low) is low


@pytest.mark.parametrize("bs,padded", [(1, 1), (3, 4)])
def test_short_draft_graph_head_at_its_width(bs, padded):
    """SGLANG_DFLASH_SHORT_DRAFT: a draft graph of width W < B (k = W - 1 drafts) computes its head into the first
    W - 1 columns and is read only by a replay at that width; the full block's graphs keep theirs apart."""
    W = 4
    hidden = torch.randn(padded * W, H)
    me, head = stand_in(hidden, replayed_bs=padded)
    seen = []
    me._draft_widths = SimpleNamespace(target_at=lambda w: seen.append(w) or contextlib.nullcontext())
    me._draft_spec_infos, me._logged_short_draft = {W: None}, False
    worker.DFlashWorker._capture_draft_head(me, SimpleNamespace(speculative_num_draft_tokens=W),
                                            SimpleNamespace(hidden_states=hidden), _batch(padded * W), padded * W)
    assert me._graph_head_bs == {(W, padded)}
    got = draft(me, bs, W - 1, width=W)
    rows = hidden[: bs * W].view(bs, W, -1)[:, 1:]
    assert torch.equal(got, (rows @ head.T).argmax(-1)) and got.data_ptr() == me._graph_drafts.data_ptr()
    assert seen == [W] and me._logged_short_draft
    me._graph_head_bs = {(B, padded)}  # the full block's graph at this bs has a head; the short one has none
    assert torch.equal(draft(me, bs, W - 1, width=W), (rows @ head.T).argmax(-1))
    assert draft(me, bs, W - 1, width=W).data_ptr() != me._graph_drafts.data_ptr()


def test_short_draft_refused_with_a_dflash2_drafter(monkeypatch):
    """DFlash2's convolutions run over whole blocks: a short draft pass is refused before any model loads."""
    from sglang_dflash.serving.startup import DFlashStartupError, check_short_draft

    d2 = SimpleNamespace(block_size=16, is_dflash2=True, architecture="DFlash2DraftModel")
    monkeypatch.delenv("SGLANG_DFLASH_SHORT_DRAFT", raising=False)
    check_short_draft(d2)  # off: nothing to refuse
    monkeypatch.setenv("SGLANG_DFLASH_SHORT_DRAFT", "1")
    check_short_draft(SimpleNamespace(block_size=16, is_dflash2=False, architecture="DFlashDraftModel"))
    with pytest.raises(DFlashStartupError, match=r"DFlash2 drafter.*whole blocks.*Fix: unset SGLANG_DFLASH_SHORT_DRAFT"):
        check_short_draft(d2)
