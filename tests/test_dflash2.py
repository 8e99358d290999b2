"""DFlash2's pieces in the plain-torch drafter: the grouped dynamic causal convolution (causal, inside the block,
the formula of dflash2.py's doc) and the candidate selector (its greedy path is the best-scoring walk, its sampled
draws follow the q it reports), and the published parameter names."""

import pytest
import torch
from _stats import detectable_tv, grouped_chi2

from sglang_dflash.config import DFlashConfig
from sglang_dflash.dflash2 import GroupedCausalConv
from sglang_dflash.targets.tiny import TINY_DFLASH2, tiny_dflash2_drafter, tiny_drafter_config, tiny_target

TARGET = tiny_target("qwen3")
BLOCK = 8


def conv(seed=0, **keys) -> GroupedCausalConv:
    cfg = DFlashConfig.from_dict(tiny_drafter_config(TARGET.config, block_size=BLOCK, **{**TINY_DFLASH2, **keys}))
    c = GroupedCausalConv(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        c.base_kernel.copy_(torch.randn(c.base_kernel.shape, generator=g))
        c.kernel_projection.weight.copy_(torch.randn(c.kernel_projection.weight.shape, generator=g) * 0.2)
    return c


def formula(x, dyn, base, group_size, block):
    """y[t, c] = sum_{s <= min(t, taps-1)} (base[s, c] + dyn[t, s, c // group_size]) * x[t - s, c], t inside the
    block: the module doc's formula, one output element at a time."""
    b, q, h = x.shape
    y = torch.zeros_like(x)
    for n in range(b):
        for t in range(q):
            for c in range(h):
                for s in range(min(t % block, base.shape[0] - 1) + 1):
                    y[n, t, c] += (base[s, c] + dyn[n, t, s, c // group_size]) * x[n, t - s, c]
    return y


@torch.no_grad()
def test_convolution_is_the_formula_on_both_sides():
    c = conv()
    x = torch.randn(2, 2 * BLOCK, 64, generator=torch.Generator().manual_seed(1))  # two blocks per row
    dyn = c.kernel_projection(x).view(2, 2 * BLOCK, 2, c.taps, c.groups)
    y, side1 = c.prepare(x)
    torch.testing.assert_close(y, formula(x, dyn[:, :, 0], c.base_kernel[0], c.group_size, BLOCK))
    out = torch.randn_like(x)
    torch.testing.assert_close(c.finish(out, side1), formula(out, dyn[:, :, 1], c.base_kernel[1], c.group_size,
                                                             BLOCK))


@torch.no_grad()
def test_convolution_is_causal_and_stays_inside_its_block():
    c = conv()
    x = torch.randn(1, 2 * BLOCK, 64, generator=torch.Generator().manual_seed(2))
    base, _ = c.prepare(x)
    for j in (0, 3, BLOCK - 1, BLOCK):  # change one position: only it and the next taps - 1 of its block move
        x2 = x.clone()
        x2[0, j] += 1.0
        moved = (c.prepare(x2)[0] - base).abs().amax(dim=-1)[0] > 0
        block_end = (j // BLOCK + 1) * BLOCK
        assert moved.nonzero()[:, 0].tolist() == list(range(j, min(j + c.taps, block_end))), j


def test_fresh_convolution_is_the_identity_and_rejects_partial_blocks():
    cfg = DFlashConfig.from_dict(tiny_drafter_config(TARGET.config, block_size=BLOCK, **TINY_DFLASH2))
    c = GroupedCausalConv(cfg)
    x = torch.randn(1, BLOCK, 64)
    y, side1 = c.prepare(x)
    assert torch.equal(y, x) and torch.equal(c.finish(x, side1), x)
    with pytest.raises(ValueError, match="whole blocks"):
        c.prepare(torch.randn(1, BLOCK + 1, 64))


def test_published_parameter_names_and_shapes():
    d = tiny_dflash2_drafter(TARGET.config, block_size=BLOCK)
    shapes = {k: tuple(v.shape) for k, v in d.state_dict().items() if "_conv." in k or "selector" in k}
    taps, groups, v, r = 3, 64 // 16, TARGET.config.vocab_size, 8
    assert shapes == {
        **{f"layers.0.{side}_conv.base_kernel": (2, taps, 64) for side in ("attention", "mlp")},
        **{f"layers.0.{side}_conv.kernel_projection.weight": (2 * taps * groups, 64) for side in ("attention", "mlp")},
        "candidate_selector.predecessor_codebook": (v, r), "candidate_selector.successor_codebook": (v, r),
        "candidate_selector.hidden_projection.weight": (r, 64)}


def selector_inputs(n=3, length=BLOCK - 1, seed=0):
    d = tiny_dflash2_drafter(TARGET.config, block_size=BLOCK)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, length, 64, generator=g)
    logits = d.draft_logits(hidden, TARGET.lm_head.weight)
    return d, hidden, logits, torch.randint(256, (n,), generator=g)


@torch.no_grad()
def test_greedy_path_takes_the_best_transition_at_each_position():
    d, hidden, logits, anchors = selector_inputs()
    sel = d.candidate_selector
    block = d.propose(hidden, TARGET.lm_head.weight, anchors)
    assert block.tokens.shape == (3, BLOCK - 1) and block.q.shape == block.candidates.shape == (3, BLOCK - 1, 4)
    top = logits.topk(4, dim=-1)
    assert torch.equal(block.candidates, top.indices)
    previous = anchors
    for i in range(BLOCK - 1):
        scores = top.values[:, i] + (sel.predecessor_codebook[previous] * sel.hidden_projection(hidden[:, i])
                                     )[:, None, :].mul(sel.successor_codebook[top.indices[:, i]]).sum(-1)
        previous = top.indices[:, i].gather(1, scores.argmax(-1, keepdim=True))[:, 0]
        assert torch.equal(block.tokens[:, i], previous), i
    assert torch.equal(block.q.amax(-1), torch.ones(3, BLOCK - 1))  # greedy: point masses
    # the transitions matter: the path is not the argmax of the draft logits everywhere
    assert not torch.equal(block.tokens, logits.argmax(-1))


@torch.no_grad()
def test_sampled_path_draws_from_the_q_it_reports():
    """20,000 copies of one block at temperature 0.7 (and a greedy row per 4): the token at position 1 follows
    q_1 and the token at position 2 follows the q_2 reported for its predecessor (grouped chi-square by the
    position-1 choice, threshold 1e-4, detects TV >= 0.04); greedy rows keep the argmax path."""
    d, hidden, logits, anchors = selector_inputs(n=1, length=2)
    n = 20_000
    temps = torch.full((n,), 0.7)
    temps[::4] = 0.0
    g = torch.Generator().manual_seed(6)
    block = d.candidate_selector.walk(hidden.expand(n, -1, -1), logits.expand(n, -1, -1), anchors.expand(n), temps, g)
    greedy_path = d.propose(hidden, TARGET.lm_head.weight, anchors).tokens
    assert (block.tokens[::4] == greedy_path).all()
    sampled = temps > 0
    slots = (block.candidates == block.tokens[:, :, None]).int().argmax(-1)[sampled]
    q = block.q[sampled]
    groups = [(torch.bincount(slots[:, 0], minlength=4), q[0, 0])]
    for first in range(4):
        rows = slots[:, 0] == first
        if rows.any():
            assert torch.allclose(q[rows, 1], q[rows][0, 1])  # q_2 depends on the predecessor only
            groups.append((torch.bincount(slots[rows, 1], minlength=4), q[rows][0, 1]))
    pvalue, draws, df, _ = grouped_chi2(groups)
    assert pvalue > 1e-4, (pvalue, draws, df)
    assert detectable_tv(draws, df, 1e-4) < 0.04
    assert len(groups) > 2 and (q[:, 0] < 0.9).all()  # q is not a point mass: draws really vary
