"""Anchors, block masks and loss weighting of drafter training (CPU, fast)."""

import math

import pytest
import torch

from sglang_dflash.train.blocks import (IGNORE, build_batch, build_blocks, decayed_block_loss, flex_block_mask,
                                        position_weights, sample_anchors)

B, MASK = 4, 99


def test_anchors_stay_in_the_response_and_leave_a_label():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = sample_anchors(5, 20, 6, g)
        assert a.tolist() == sorted(a.tolist())
        assert a.min() >= 5 and a.max() <= 18
        assert len(set(a.tolist())) == 6  # enough candidates: no repeats
    a = sample_anchors(5, 8, 10, g)  # 2 candidates, 10 anchors: drawn with replacement
    assert set(a.tolist()) <= {5, 6}
    with pytest.raises(ValueError, match="no anchor"):
        sample_anchors(7, 8, 1, g)


def test_block_ids_positions_labels():
    tokens = torch.arange(100, 112)  # 12 tokens, values != MASK
    anchors = torch.tensor([3, 9])
    blk = build_blocks(tokens, anchors, B, MASK)
    assert blk.ids.tolist() == [103, MASK, MASK, MASK, 109, MASK, MASK, MASK]
    assert blk.positions.tolist() == [3, 4, 5, 6, 9, 10, 11, 12]
    # position k of a block predicts token a+k; position 0 and positions past the end have no label
    assert blk.labels.tolist() == [IGNORE, 104, 105, 106, IGNORE, 110, 111, IGNORE]


def test_no_block_sees_another_block_or_its_own_future_context():
    t = 30
    tokens = torch.randint(0, 50, (t,))
    anchors = torch.tensor([4, 5, 17, 28])
    vis = build_blocks(tokens, anchors, B, MASK).visible
    assert vis.shape == (len(anchors) * B, t + len(anchors) * B)
    for q in range(vis.shape[0]):
        j = q // B
        a = int(anchors[j])
        ctx = vis[q, :t]
        # context: exactly the positions strictly before the anchor (the anchor token itself is the block's input)
        assert ctx[:a].all() and not ctx[a:].any(), (q, a)
        blocks = vis[q, t:].view(len(anchors), B)
        assert blocks[j].all()  # its own block, bidirectionally
        others = torch.cat([blocks[:j], blocks[j + 1:]])
        assert not others.any()  # never another block


def test_batch_mask_matches_per_sequence_blocks_and_hides_padding():
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([20, 13, 17])
    t = int(lengths.max())
    tokens = torch.zeros(3, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(0, 50, (int(n),), generator=g)
    anchors = torch.stack([sample_anchors(3, int(n), 5, g) for n in lengths])
    bb = build_batch(tokens, lengths, anchors, B, MASK)
    for i, n in enumerate(lengths.tolist()):
        ref = build_blocks(tokens[i, :n], anchors[i], B, MASK)
        assert torch.equal(bb.ids[i], ref.ids) and torch.equal(bb.labels[i], ref.labels)
        assert torch.equal(bb.visible[i, :, :n], ref.visible[:, :n])
        assert not bb.visible[i, :, n:t].any()  # padded context is invisible
        assert torch.equal(bb.visible[i, :, t:], ref.visible[:, n:])


def test_flex_block_mask_equals_dense_mask():
    pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([40, 33])
    t = int(lengths.max())
    tokens = torch.randint(0, 50, (2, t), generator=g)
    anchors = torch.stack([sample_anchors(2, int(n), 8, g) for n in lengths])
    dense = build_batch(tokens, lengths, anchors, B, MASK).visible
    bm = flex_block_mask(anchors, B, t)
    q = torch.arange(dense.shape[1])[:, None]
    k = torch.arange(dense.shape[2])[None, :]
    for b in range(2):
        assert torch.equal(bm.mask_mod(torch.tensor(b), 0, q, k), dense[b])


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15.0) / 7.0))
    assert (w[1:-1] > w[2:]).all()  # strictly decaying after the bonus position


def test_decayed_loss_weights_positions_and_skips_ignored_labels():
    v = 7
    labels = torch.tensor([IGNORE, 1, 2, 3, IGNORE, 4, IGNORE, IGNORE])  # 2 blocks of B=4
    logits = torch.randn(8, v)
    ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    w = position_weights(B, 2.0).repeat(2) * (labels != IGNORE)
    expected = (ce * w).sum() / w.sum()
    got = decayed_block_loss(logits, labels, B, gamma=2.0)
    assert torch.allclose(got, expected)
    # only the weighted positions matter: changing an IGNORE row's logits changes nothing
    logits2 = logits.clone()
    logits2[0] += 100
    logits2[6] -= 50
    assert torch.allclose(decayed_block_loss(logits2, labels, B, gamma=2.0), got)
    # an error at position 1 costs more than the same error at position 3
    perfect = torch.full((8, v), -20.0)
    perfect[torch.arange(8), labels.clamp(min=0)] = 20.0
    early, late = perfect.clone(), perfect.clone()
    early[1] = 0.0
    late[3] = 0.0
    assert decayed_block_loss(early, labels, B, 2.0) > decayed_block_loss(late, labels, B, 2.0)
    assert math.isclose(decayed_block_loss(early, labels, B, 2.0).item() / decayed_block_loss(late, labels, B, 2.0).item(),
                        math.exp(2 / 2.0), rel_tol=1e-3)
