"""Seeded sampling (issue #46 item 3): draws keyed by (seed, position), reproducible and exact.

- The counter-based uniforms (sampling.seeded_uniforms): a pure function of (seed, position, index), uniform, and
  independent across each argument (chi-square on single values and on pairs that differ in one argument).
- sampling.seeded_sample follows the processed distribution (over seeds and along one seed's positions), and a row's
  draw does not depend on the batch around it nor on the batch's `filtered` flag.
- acceptance.verify_seeded / tree_acceptance.verify_tree_seeded emit the target's own seeded draw at every position
  whatever the drafts, the width and the tree.
- The reference engine: a seeded request's output is its seeded target-only output token for token (DFlash chain,
  DFlash2, tree), alone or in a batch, whatever the engine's generator; the Markov target's role-wise chi-square
  (tests/test_reference_engine.py) over requests with distinct seeds.
"""

import dataclasses
import types

import pytest
import torch
from _stats import chi2_pvalue

from sglang_dflash.acceptance import seeded_targets, verify_greedy_ids, verify_seeded
from sglang_dflash.draft_tree import build_draft_tree, chain_tree
from sglang_dflash.reference import ReferenceEngine
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs, seeded_sample, seeded_uniforms
from sglang_dflash.tree_acceptance import verify_tree_seeded

ALPHA = 1e-4  # fixed inputs: the outcome is the same every run


def st(params: list[SamplingParams], v: int) -> SamplingTensors:
    return SamplingTensors.from_params(params, v)


# ------------------------------------------------------------------------------------------- the uniforms
def test_uniforms_are_a_pure_function_of_seed_position_index():
    seeds = torch.tensor([0, 1, -1, 1 << 40, (1 << 62) + 5])
    pos = torch.tensor([0, 7, 7, 123456, 3])
    idx = torch.arange(1000)
    a, b = seeded_uniforms(seeds, pos, idx), seeded_uniforms(seeds.clone(), pos.clone(), idx.clone())
    assert a.dtype == torch.float32 and a.shape == (5, 1000) and torch.equal(a, b)
    assert (a > 0).all() and (a < 1).all()
    # one row alone is the same row (no dependence on the batch), and a [N, K] index gives the same values
    assert torch.equal(seeded_uniforms(seeds[3:4], pos[3:4], idx), a[3:4])
    assert torch.equal(seeded_uniforms(seeds, pos, idx.expand(5, 1000)), a)
    # every argument matters: the high bits of the seed too
    for other in ((seeds + 1, pos), (seeds, pos + 1), (seeds + (1 << 33), pos)):
        assert (seeded_uniforms(*other, idx) != a).float().mean() > 0.99


def test_uniforms_stay_inside_the_open_interval_at_the_extreme_hashes():
    """The largest and smallest hashes map strictly inside (0, 1) in float32, so the Gumbel noise -log(-log U) is
    finite (a U of exactly 1.0 would give +inf: that token would win every race)."""
    from sglang_dflash.sampling import _unit_interval

    u = _unit_interval(torch.tensor([0, 1, (1 << 32) - 2, (1 << 32) - 1]))
    assert (u > 0).all() and (u < 1).all(), u
    assert torch.isfinite(u.log().neg().log().neg()).all()


def test_uniforms_are_uniform():
    u = seeded_uniforms(torch.arange(200), torch.arange(200) * 3 + 11, torch.arange(5000))  # 10^6 values
    counts = torch.histc(u, bins=256, min=0, max=1)
    assert chi2_pvalue(counts, torch.ones(256)) > ALPHA


@pytest.mark.parametrize("neighbour", ["seed + 1", "position + 1", "index + 1", "seed 2^32 apart",
                                       "seed + 1, position - 1"])
def test_uniforms_are_independent_across_each_argument(neighbour):
    """Pairs of uniforms whose keys differ in one argument (or shift two of them against each other): their joint
    8 x 8 histogram is uniform (a correlation or a shared stream would pile mass on the diagonal)."""
    n = 300
    seeds, pos, idx = torch.arange(n) * 7919, torch.arange(n) * 13 + 5, torch.arange(1000)
    shifted = {"seed + 1": (seeds + 1, pos, idx), "position + 1": (seeds, pos + 1, idx),
               "index + 1": (seeds, pos, idx + 1), "seed 2^32 apart": (seeds + (1 << 32), pos, idx),
               "seed + 1, position - 1": (seeds + 1, pos - 1, idx)}[neighbour]
    a, b = seeded_uniforms(seeds, pos, idx), seeded_uniforms(*shifted)
    cells = ((a * 8).long() * 8 + (b * 8).long()).reshape(-1)
    assert chi2_pvalue(torch.bincount(cells, minlength=64), torch.ones(64)) > ALPHA


# ------------------------------------------------------------------------------------------- the draw
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -8.0, 1.2])
PARAMS = {
    "T 1": SamplingParams(temperature=1.0),
    "T 0.5": SamplingParams(temperature=0.5),
    "T 1.5, top-k 4": SamplingParams(temperature=1.5, top_k=4),
    "T 0.8, top-p 0.7": SamplingParams(temperature=0.8, top_p=0.7),
    "T 1.2, min-p 0.1": SamplingParams(temperature=1.2, min_p=0.1),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_seeded_sample_follows_the_processed_distribution(name):
    """20,000 draws of one row: over distinct seeds (one per request), and along one seed's positions (one request's
    stream); both against processed_probs."""
    n, v = 20_000, LOGITS.numel()
    s = st([PARAMS[name]] * n, v)
    p = processed_probs(LOGITS[None], st([PARAMS[name]], v))[0]
    logits = LOGITS.expand(n, v)
    for seeds, pos in ((torch.arange(n) + 10**6, torch.full((n,), 41)), (torch.full((n,), 5), torch.arange(n))):
        draws = seeded_sample(logits, s, seeds, pos)
        counts = torch.bincount(draws, minlength=v)
        assert counts[p == 0].sum() == 0, (name, counts)
        assert chi2_pvalue(counts, p) > ALPHA, (name, counts, p)


def test_seeded_sample_depends_on_the_row_alone():
    """A row's draw is the same alone or in any batch, with the batch's `filtered` flag set or not (neutral rows);
    greedy rows take the argmax."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=g) * 3
    params = [SamplingParams(temperature=t) for t in (0.7, 1.0, 1.3, 0.0)] * 16
    s = st(params, 50)
    seeds, pos = torch.arange(64) * 31, torch.arange(64) + 100
    batch = seeded_sample(logits, s, seeds, pos)
    assert torch.equal(batch, seeded_sample(logits, s, seeds, pos, filtered=False))
    for i in range(0, 64, 7):
        assert seeded_sample(logits[i:i + 1], s[i:i + 1], seeds[i:i + 1], pos[i:i + 1]) == batch[i]
    greedy = s.temperature == 0
    assert torch.equal(batch[greedy], logits[greedy].argmax(-1))
    assert (batch[~greedy] != logits[~greedy].argmax(-1)).any()  # the sampled rows really sample


# ------------------------------------------------------------------------------------------- the rules
def test_verify_seeded_emits_the_targets_seeded_draws_whatever_the_drafts_and_width():
    g = torch.Generator().manual_seed(5)
    n, w, v = 200, 6, 8
    logits = torch.randn(n, w, v, generator=g)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4), SamplingParams()] * 66
    params += [SamplingParams(temperature=1.0, top_p=0.8)] * 2
    s, seeds, prefix = st(params, v), torch.arange(n) + 7, torch.arange(n) * 3 + 20
    x = seeded_targets(logits, s, seeds, prefix[:, None] + torch.arange(w))
    # drafts: the target's own draws with random corruptions, so every commit length occurs
    drafts = torch.where(torch.rand(n, w - 1, generator=g) < 0.8, x[:, :-1], torch.randint(v, (n, w - 1), generator=g))
    for k in range(w):  # verifying only the first k drafts (the adaptive widths)
        commit, tokens = verify_seeded(drafts[:, :k], logits[:, :k + 1], s, seeds, prefix)
        col = torch.arange(k + 1)[None]
        assert torch.equal(tokens, torch.where(col < commit[:, None], x[:, :k + 1], -1)), k
        assert torch.equal((commit, tokens)[0], verify_greedy_ids(drafts[:, :k], x[:, :k + 1])[0])
    assert set(commit.tolist()) == set(range(1, w + 1))
    # the tree rule: a chain tree commits what the chain rule commits; a real tree emits X at every node it walks
    chain = chain_tree(torch.zeros(n, dtype=torch.long), drafts)
    t_commit, t_tokens, _ = verify_tree_seeded(chain, logits, s, seeds, prefix)
    assert torch.equal(t_commit, commit) and torch.equal(t_tokens, tokens)
    tree = build_draft_tree(torch.zeros(n, dtype=torch.long), logits[:, 1:] + torch.randn(n, w - 1, v, generator=g), 5)
    t_commit, t_tokens, path = verify_tree_seeded(tree, logits[:, :5], s, seeds, prefix)
    x_tree = seeded_targets(logits[:, :5], s, seeds, prefix[:, None] + tree.depth)
    for i in range(n):
        nodes = path[i, :t_commit[i]].tolist()
        assert t_tokens[i, :t_commit[i]].tolist() == [x_tree[i, j].item() for j in nodes]


def test_seeded_rules_are_graph_capturable():
    """No host sync, no data-dependent shape, no Python value copied to the device (tests/_capturable.py): the
    seeded chain rule and the tree's seeded targets (the worker then runs the greedy tree kernel on them) can run
    inside a CUDA graph; the seeded DFlash2 walk adds no refused op to the walk's own (its one_hot reads are the
    unseeded walk's too)."""
    from _capturable import _Recorder, assert_capturable

    from sglang_dflash.dflash2 import CandidateSelector

    g = torch.Generator().manual_seed(6)
    n, w, v = 3, 4, 30
    logits = torch.randn(n, w, v, generator=g)
    s = st([SamplingParams(temperature=0.9), SamplingParams(temperature=1.1, top_k=5), SamplingParams()], v)
    seeds, prefix = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    drafts = torch.randint(v, (n, w - 1), generator=g)
    assert_capturable(verify_seeded, drafts, logits, s, seeds, prefix)
    assert_capturable(verify_seeded, drafts, logits, s, seeds, prefix, filtered=False)
    tree = build_draft_tree(torch.zeros(n, dtype=torch.long), torch.randn(n, w - 1, v, generator=g), 4)
    assert_capturable(seeded_targets, logits, s, seeds, prefix[:, None] + tree.depth)
    selector = CandidateSelector(types.SimpleNamespace(selector_top_k=4, vocab_size=v, selector_rank=3, hidden_size=8))
    args = (torch.randn(n, w - 1, 8, generator=g), torch.randn(n, w - 1, v, generator=g), torch.tensor([1, 2, 3]),
            torch.tensor([0.0, 0.8, 1.2]))
    refused = []
    for extra in ((), (None, seeds, prefix)):
        rec = _Recorder()
        with torch.no_grad(), rec:
            selector.walk(*args, *extra)
        refused.append(sorted(rec.refused))
    assert refused[1] == refused[0], refused


# ------------------------------------------------------------------------------------------- the engine
def _markov():
    from test_reference_engine import markov_dflash2, markov_pair

    target, drafter = markov_pair()
    return target, {"dflash": (drafter, None), "dflash2": (markov_dflash2()[1], None), "tree": (drafter, 6)}


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "tree"])
def test_seeded_generate_is_the_seeded_target_only_stream(kind):
    """A seeded request emits its seeded target-only tokens, token for token: whatever the drafts (DFlash, DFlash2
    drawn with the same noise, a tree), the engine's generator, and the requests batched with it (seeded, unseeded,
    greedy). Different seeds give different outputs. Fails on a rule that draws from the generator."""
    target, drafters = _markov()
    drafter, tree_size = drafters[kind]
    v = target.config.vocab_size
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(v, (3,), generator=g).tolist() for _ in range(24)]
    kinds = [dict(temperature=0.8), dict(temperature=1.3, top_k=3), dict(temperature=1.0, top_p=0.8)]
    seeded = [SamplingParams(max_new_tokens=24, seed=100 + i, **kinds[i % 3]) for i in range(24)]
    base = ReferenceEngine(target, seed=0).generate_target_only(prompts, seeded)
    spec = ReferenceEngine(target, drafter, seed=1, tree_size=tree_size).generate(prompts, seeded)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert sum(map(len, (r.output_ids for r in spec))) / sum(len(r.commit_lens) for r in spec) > 1.5, \
        "few multi-token commits: the equality says little about the verify"
    # batched with unseeded sampled and greedy requests, another engine seed: the seeded rows do not move
    others = [SamplingParams(max_new_tokens=24, temperature=0.9), SamplingParams(max_new_tokens=24)] * 4
    mixed = ReferenceEngine(target, drafter, seed=2, tree_size=tree_size).generate(prompts[:8] + prompts,
                                                                                   others + seeded)
    assert [r.output_ids for r in mixed[8:]] == [r.output_ids for r in base]
    reseeded = [dataclasses.replace(p, seed=p.seed + 1000) for p in seeded]
    again = ReferenceEngine(target, drafter, seed=1, tree_size=tree_size).generate(prompts, reseeded)
    assert sum(a.output_ids != b.output_ids for a, b in zip(again, spec)) > 12


@pytest.mark.parametrize("kind, kw", [("dflash", dict(temperature=0.6)), ("dflash2", dict(temperature=1.4, top_k=3)),
                                      ("tree", dict(temperature=0.8, top_p=0.8))])
def test_seeded_output_follows_the_target_distribution(kind, kw):
    """The role-wise chi-square of tests/test_reference_engine.py (every emitted token against its exact conditional,
    grouped by prefill sample / block position / bonus) over 1,500 requests with distinct seeds, with the power
    that test states (a mean TV error of MAX_TV detected at every role, the bonus's included)."""
    from _stats import detectable_tv
    from test_reference_engine import MARKOV_ALPHA, MAX_TV, sampled_distribution_failures

    target, drafters = _markov()
    drafter, tree_size = drafters[kind]
    params = SamplingParams(max_new_tokens=20, **kw)
    failures, seen, commits = sampled_distribution_failures(target, drafter, params, 1500, MARKOV_ALPHA,
                                                            tree_size=tree_size, seeded=True)
    assert not failures, f"{kind} {kw}: seeded tokens do not follow the target at {failures}"
    assert len(set(commits)) >= 4, "every acceptance length must occur"
    for name, draws, df in seen:
        assert detectable_tv(draws, df, MARKOV_ALPHA) < MAX_TV, (kind, name, draws, df)


def test_unseeded_requests_keep_the_generators_rules(monkeypatch):
    """A batch without a seeded sampled request never reaches the seeded rules (nor draws the random keys): its
    draws are the engine generator's, as before; a greedy request with a seed changes nothing either."""
    from sglang_dflash.reference import engine as engine_module

    def refuse(*a, **k):
        raise AssertionError("a seeded rule ran in a batch without a seeded sampled request")

    for name in ("verify_seeded", "verify_tree_seeded", "seeded_sample"):
        monkeypatch.setattr(engine_module, name, refuse)
    target, drafters = _markov()
    prompts = [[1, 2, 3], [4, 5, 0]] * 2
    params = [SamplingParams(max_new_tokens=12, temperature=1.0), SamplingParams(max_new_tokens=12, seed=3)] * 2
    for drafter, tree_size in drafters.values():
        ReferenceEngine(target, drafter, seed=4, tree_size=tree_size).generate(prompts, params)
