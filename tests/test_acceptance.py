"""The verification rules and the processed distribution, tested on their own (pure functions)."""

import pytest
import torch

from _stats import chi2_pvalue

from sglang_dflash.acceptance import verify_greedy, verify_sampled
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


@pytest.mark.parametrize("accept_rate_draft", [0, 1])
def test_verify_sampled_emits_target_distribution(accept_rate_draft):
    """Many copies of one block: the first emitted token must follow p_0, and the token after an accepted first
    draft must follow p_1, whichever draft was proposed (a likely one, or an unlikely one)."""
    g = torch.Generator().manual_seed(7)
    v, b, n = 6, 3, 60_000
    probs = torch.softmax(torch.randn(b, v, generator=g) * 1.5, -1)
    draft = probs[:-1].argmax(-1) if accept_rate_draft else probs[:-1].argmin(-1)
    commit, tokens = verify_sampled(draft.expand(n, b - 1).contiguous(), probs.expand(n, b, v).contiguous(), g)
    first = torch.bincount(tokens[:, 0], minlength=v)
    assert chi2_pvalue(first, probs[0]) > 1e-3
    after = tokens[tokens[:, 0] == draft[0], 1]
    second = torch.bincount(after, minlength=v)
    assert chi2_pvalue(second, probs[1]) > 1e-3
    assert (commit == 1).any() and (commit >= 2).any()


def test_verify_sampled_catches_a_wrong_residual():
    """The statistical check above is sharp enough to fail a plausible bug: sampling the replacement token from p
    itself instead of p without the rejected draft."""
    g = torch.Generator().manual_seed(7)
    v, n = 6, 60_000
    probs = torch.softmax(torch.randn(2, v, generator=g) * 1.5, -1)
    draft = probs[:1].argmax(-1)
    accepted = torch.rand(n, generator=g) < probs[0, draft]
    wrong = torch.where(accepted, draft.expand(n), sample_from_probs(probs[0].expand(n, v).contiguous(), g))
    counts = torch.bincount(wrong, minlength=v)
    assert chi2_pvalue(counts, probs[0]) < 1e-6
