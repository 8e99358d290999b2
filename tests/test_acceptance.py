"""The verification rules and the processed distribution, tested on their own (pure functions)."""

import pytest
import torch

from _stats import chi2_pvalue, detectable_tv, grouped_chi2

from sglang_dflash.acceptance import verify_greedy, verify_sampled, verify_sampled_q
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs, sample_from_probs


def st(n, v, **kw):
    return SamplingTensors.from_params([SamplingParams(**kw)] * n, v)


def test_verify_greedy_accepts_longest_matching_prefix():
    # target argmax per block row: row i predicts position i+1
    target_tokens = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    logits = torch.nn.functional.one_hot(target_tokens, 10).float()
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [8, 4, 5]])
    commit, tokens = verify_greedy(drafts, logits)
    assert commit.tolist() == [4, 2, 1]
    assert tokens.tolist() == [[3, 4, 5, 6], [3, 4, -1, -1], [3, -1, -1, -1]]


def test_greedy_rows_as_point_masses_reduce_to_verify_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5, 12, generator=g) * 3
    drafts = torch.where(torch.rand(64, 4, generator=g) < 0.7, logits[:, :-1].argmax(-1),
                         torch.randint(12, (64, 4), generator=g))
    probs = processed_probs(logits.view(-1, 12), st(64 * 5, 12, temperature=0.0)).view(64, 5, 12)
    a = verify_greedy(drafts, logits)
    b = verify_sampled(drafts, probs, g)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert {1, 5} <= set(a[0].tolist())  # both full rejection and full acceptance occur


def test_processed_probs_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    p = processed_probs(logits, st(1, 5, temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0, 0, 0]]))
    p = processed_probs(logits, st(1, 5, temperature=1.0, top_p=0.8))  # mass before token 3 is 0.85 > 0.8
    torch.testing.assert_close(p, torch.tensor([[0.4, 0.3, 0.15, 0, 0]]) / 0.85)
    p = processed_probs(logits, st(1, 5, temperature=1.0, min_p=0.3))  # keep p >= 0.12
    torch.testing.assert_close(p, torch.tensor([[0.4, 0.3, 0.15, 0, 0]]) / 0.85)
    p = processed_probs(logits, st(1, 5, temperature=0.0))
    assert p.tolist() == [[1.0, 0, 0, 0, 0]]
    hot = processed_probs(logits, st(1, 5, temperature=0.5))
    torch.testing.assert_close(hot, torch.softmax(logits / 0.5, -1))


def test_unfiltered_fast_path_equals_the_full_rule_when_filters_are_neutral():
    """The worker skips the vocabulary sort when SGLang says no row filters; that must not change the distribution,
    greedy rows (temperature 0) included, which stay exact point masses on the first maximal index."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 2
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # an exact tie: the first index wins
    temps = [0.0, 1.0, 0.0, 0.7, 1.3, 0.0]
    s = SamplingTensors.from_params([SamplingParams(temperature=t) for t in temps], 40)
    fast, full = processed_probs(logits, s, filtered=False), processed_probs(logits, s)
    torch.testing.assert_close(fast, full)
    for i, t in enumerate(temps):
        if t == 0:
            assert fast[i].tolist() == torch.nn.functional.one_hot(logits[i].argmax(), 40).float().tolist()
    assert fast[2, 7] == 1.0


def test_sample_from_probs_matches_distribution():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 40_000
    draws = sample_from_probs(p.expand(n, 5).contiguous(), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=5)
    assert counts[4] == 0
    assert chi2_pvalue(counts, p) > 1e-3


# One block of B = 4 rows (row i predicts block position i+1, row 3 gives the bonus after full acceptance), written
# out so that each planted bug moves visible mass: every row has a token of probability 0, the likely drafts are
# accepted together often enough (0.6 * 0.7 * 0.6 = 25%) to observe the bonus many times, and the bonus row puts
# 0.35 on the likely last draft (token 2), the mass a bug that removes the last draft from the bonus would lose.
BLOCK_PROBS = torch.tensor([
    [0.60, 0.15, 0.10, 0.10, 0.05, 0.00],
    [0.05, 0.70, 0.10, 0.10, 0.05, 0.00],
    [0.10, 0.10, 0.60, 0.15, 0.05, 0.00],
    [0.15, 0.10, 0.35, 0.30, 0.10, 0.00],
])
DRAFT_KINDS = torch.tensor([
    [0, 1, 2],  # the likely path: mostly accepted, full acceptance 25%
    [4, 0, 3],  # unlikely drafts: mostly rejected, the replacement (residual) path
    [5, 5, 5],  # drafts of probability 0: never accepted, the residual is p itself
])
ALPHA = 1e-4  # per check; ~10 checks in this file's distribution tests, so a harmless re-roll fails < 0.1% of seeds
ROLE_NAMES = ("first token", "position 1", "position 2", "bonus after full acceptance")


def emitted_distribution_failures(drafts, probs, kinds, tokens, alpha=ALPHA):
    """For each block position j, the tokens emitted there by rows that kept drafts d_1..d_j (for a correct rule,
    exactly the rows whose emitted tokens 0..j-1 equal the drafts) must follow row j of their block: one grouped
    chi-square per position over the distinct blocks (`kinds` labels them). Returns [(role, p-value, draws, df)] of
    the positions that fail, and [(role, draws, df)] of all of them."""
    b = probs.shape[1]
    failures, seen = [], []
    for j in range(b):
        kept = (tokens[:, :j] == drafts[:, :j]).all(dim=1)
        ended = kept & (tokens[:, j] < 0)  # a step that emitted its drafts d_1..d_j yet stopped: the replacement
        if ended.any():  # of a rejected draft equalled that draft, which an exact rule never samples
            failures.append((ROLE_NAMES[j - 1], "a replacement equal to its rejected draft", int(ended.sum()), 0))
            kept &= ~ended
        groups = []
        for k in kinds.unique().tolist():
            rows = kept & (kinds == k)
            first = rows.nonzero()[0, 0] if rows.any() else None
            if first is not None:
                groups.append((torch.bincount(tokens[rows, j], minlength=probs.shape[-1]), probs[first, j]))
        pvalue, n, df, _ = grouped_chi2(groups)
        seen.append((ROLE_NAMES[j], n, df))
        if pvalue <= alpha:
            failures.append((ROLE_NAMES[j], pvalue, n, df))
    return failures, seen


def test_verify_sampled_emits_target_distribution():
    """A batch of n = 90,000 copies of one block (BLOCK_PROBS), a third with each draft vector of DRAFT_KINDS: at every
    block position, first token, positions 1 and 2 (accepted draft or replacement) and the bonus after full
    acceptance, the emitted token must follow the target's row for that position, and tokens of probability 0 never
    appear. The same positions are checked by the engine-level test in test_reference_engine.py.

    Power (grouped chi-square, threshold ALPHA = 1e-4, >= 95% power against the worst-case direction of the error;
    _stats.detectable_tv, confirmed by simulation; seed 7 gives these draws):
        first token   n = 90,000  df 12  detects TV >= 0.012
        position 1    n = 19,454  df  8  detects TV >= 0.024
        position 2    n = 12,699  df  8  detects TV >= 0.030
        bonus         n =  7,543  df  6  detects TV >= 0.037
    The bugs planted in test_mutations_algorithm.py move, on the likely path, TV 0.09-0.105 (accepting 15% too
    often: 0.15 * p(d)), 0.35 (bonus without the last draft's mass) and 0.21-0.24 (replacement keeping the rejected
    draft's mass: p(d) * (1 - p(d)))."""
    g = torch.Generator().manual_seed(7)
    n = 90_000
    kinds = torch.arange(n) % len(DRAFT_KINDS)
    drafts = DRAFT_KINDS[kinds]
    probs = BLOCK_PROBS.expand(n, *BLOCK_PROBS.shape).contiguous()
    commit, tokens = verify_sampled(drafts, probs, g)
    failures, seen = emitted_distribution_failures(drafts, probs, kinds, tokens)
    assert not failures, f"emitted tokens do not follow the target at (role, p-value, draws, df) {failures}"
    for role, draws, df in seen:  # the power stated above, enforced
        assert detectable_tv(draws, df, ALPHA) < 0.04, (role, draws, df)
    assert set(commit.tolist()) == {1, 2, 3, 4}


def test_verify_sampled_with_logit_bias():
    """logit_bias (a request field the reference engine lacks; the worker adds it to the target logits before
    processed_probs) enters the verify rule only through p: a banned token (bias -inf) proposed as a draft is never
    accepted and never emitted, a boosted one is emitted at its boosted rate, at every block position and the bonus.
    Drafts: the biased target's likely path, and a path that proposes the banned token at each position."""
    g = torch.Generator().manual_seed(3)
    v, b, n = 8, 4, 60_000
    logits = torch.randn(b, v, generator=g)
    bias = torch.zeros(v)
    bias[3], bias[6] = -float("inf"), 2.0
    s = SamplingTensors.from_params([SamplingParams(temperature=0.8, top_p=0.95)] * b, v)
    block = processed_probs(logits + bias, s)
    assert (block[:, 3] == 0).all() and (block[:, 6] > 0.4).all()
    kinds = torch.arange(n) % 2
    drafts = torch.stack([block[:-1].argmax(-1), torch.full((b - 1,), 3)])[kinds]
    probs = block.expand(n, b, v).contiguous()
    commit, tokens = verify_sampled(drafts, probs, g)
    assert not (tokens == 3).any(), "a banned token (logit_bias -inf) was emitted"
    failures, seen = emitted_distribution_failures(drafts, probs, kinds, tokens)
    assert not failures, f"emitted tokens do not follow the biased target at {failures}"
    assert min(draws for _, draws, _ in seen) > 5_000 and (commit == b).any()


# ------------------------------------------------------------------ drafts drawn from q (DFlash2's selector)
# The target block of verify_sampled_q's tests: B = 4 rows over V = 8 tokens, token 7 of probability 0 everywhere,
# and in every row mass outside any candidate set below (the residual must reach the whole vocabulary).
Q_BLOCK_PROBS = torch.tensor([
    [0.40, 0.20, 0.10, 0.10, 0.08, 0.07, 0.05, 0.00],
    [0.05, 0.45, 0.20, 0.10, 0.08, 0.07, 0.05, 0.00],
    [0.10, 0.05, 0.40, 0.25, 0.08, 0.07, 0.05, 0.00],
    [0.20, 0.10, 0.30, 0.25, 0.05, 0.05, 0.05, 0.00],
])
Q_CANDIDATES = torch.tensor([  # K = 3 candidates per draft position, for each kind of draft distribution
    [[0, 1, 2], [1, 2, 3], [2, 3, 0]],  # near p: mostly accepted
    [[7, 5, 0], [7, 6, 1], [7, 4, 2]],  # far from p, a candidate of probability 0: the residual path
    [[0, 1, 2], [1, 2, 3], [2, 3, 0]],  # greedy rows: q a point mass (on the first candidate)
    [[0, 1, 2], [1, 2, 3], [2, 3, 0]],  # conditional: q_i depends on the token drafted at i - 1
])
Q_ROWS = torch.tensor([[0.60, 0.25, 0.15], [0.60, 0.30, 0.10], [0.55, 0.35, 0.10]])  # kind 0, per position
Q_FAR = torch.tensor([[0.50, 0.40, 0.10], [0.40, 0.30, 0.30], [0.60, 0.20, 0.20]])  # kind 1
Q_CONDITIONAL = torch.tensor([[0.10, 0.30, 0.60], [0.70, 0.20, 0.10], [0.34, 0.33, 0.33]])  # kind 3, by previous slot


def draft_from_q(n: int, g: torch.Generator):
    """n blocks, a quarter of each kind: candidates [n, 3, K], q [n, 3, K] and drafts [n, 3] drawn here from q,
    position by position (kind 3's q at position i > 0 is Q_CONDITIONAL's row for the slot drafted at i - 1)."""
    kinds = torch.arange(n) % len(Q_CANDIDATES)
    q = torch.stack([Q_ROWS, Q_FAR, torch.eye(3)[[0, 0, 0]], Q_ROWS])[kinds].clone()
    slots = torch.empty(n, 3, dtype=torch.long)
    for i in range(3):
        if i > 0:
            conditional = kinds == 3
            q[conditional, i] = Q_CONDITIONAL[slots[conditional, i - 1]]
        slots[:, i] = torch.multinomial(q[:, i], 1, generator=g)[:, 0]
    candidates = Q_CANDIDATES[kinds]
    return kinds, candidates, q, candidates.gather(2, slots[:, :, None])[:, :, 0]


def test_verify_sampled_q_emits_target_distribution():
    """Drafts drawn from q over K = 3 candidates (near p, far from p with a candidate of probability 0, point
    masses, q depending on the previous draft), 120,000 blocks: at every block position and the bonus after full
    acceptance the emitted token follows the target's row, a replacement never equals its rejected draft, and
    tokens of probability 0 never appear (the grouped chi-square of emitted_distribution_failures, one group per
    kind).

    Power (threshold ALPHA = 1e-4, >= 95% against the worst-case direction, _stats.detectable_tv; seed 5):
        first token  n = 120,000  df 24  detects TV >= 0.011
        position 1   n =  59,175  df 24  detects TV >= 0.016
        position 2   n =  34,119  df 24  detects TV >= 0.021
        bonus        n =  21,158  df 24  detects TV >= 0.027
    The bugs planted in test_mutations_algorithm.py move TV far more on some kind (accepting with p(d) instead of
    p(d) / q(d): kind 0 keeps drafts of q 0.6 with probability 0.4 instead of 0.67)."""
    g = torch.Generator().manual_seed(5)
    n = 120_000
    kinds, candidates, q, drafts = draft_from_q(n, g)
    probs = Q_BLOCK_PROBS.expand(n, *Q_BLOCK_PROBS.shape).contiguous()
    commit, tokens = verify_sampled_q(drafts, probs, candidates, q, g)
    failures, seen = emitted_distribution_failures(drafts, probs, kinds, tokens)
    assert not failures, f"emitted tokens do not follow the target at (role, p-value, draws, df) {failures}"
    for role, draws, df in seen:  # the power stated above, enforced
        assert detectable_tv(draws, df, ALPHA) < 0.03, (role, draws, df)
    assert set(commit.tolist()) == {1, 2, 3, 4} and not (tokens == 7).any()
    # The law alone cannot see a rule that accepts too rarely (accepting d with p(d), the point-mass rule, is exact
    # for drafts from any q): d_1 must be kept with probability sum_c min(p(c), q(c)), here within 4.5 sigma.
    for kind in range(len(Q_CANDIDATES)):
        rows = kinds == kind
        p = Q_BLOCK_PROBS[0, candidates[rows][0, 0]]
        expected = torch.minimum(p, q[rows][0, 0]).sum().item()
        kept = (commit[rows] > 1).double().mean().item()
        sigma = (expected * (1 - expected) / rows.sum().item()) ** 0.5
        assert abs(kept - expected) < 4.5 * sigma, f"kind {kind}: d_1 kept at rate {kept:.4f}, not {expected:.4f}"


def test_point_mass_q_is_verify_sampled_draw_for_draw():
    """A one-hot q (a greedy draft) turns the rule into verify_sampled's, consuming the generator the same way."""
    g = torch.Generator().manual_seed(2)
    n, b, v, k = 512, 5, 12, 3
    probs = torch.softmax(torch.randn(n, b, v, generator=g) * 2, dim=-1)
    candidates = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n * (b - 1))]).view(n, b - 1, k)
    pick = torch.randint(k, (n, b - 1), generator=g)
    drafts = candidates.gather(2, pick[:, :, None])[:, :, 0]
    q = torch.nn.functional.one_hot(pick, k).float()
    a = verify_sampled(drafts, probs, torch.Generator().manual_seed(9))
    c = verify_sampled_q(drafts, probs, candidates, q, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert len(set(a[0].tolist())) > 2
