"""The serving tests' judges can fail: compare.py's tie rule, multi-token and radix-hit checks fed synthetic outputs.

No server: compare.generate is replaced by a toy deterministic "baseline" whose next token is a hash of the
context, with a runner-up one id above it at a logprob gap of 1.0, except at chosen contexts where the gap is
tiny (a near-tie) or moderate. Each failing case is a bug the old rules let through (the mutation it catches).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from . import compare

VOCAB = 64


class ToyBase:
    """A greedy baseline over token ids; gaps[context] overrides the top-2 gap after that context."""

    def __init__(self, gaps: dict[tuple, float] | None = None):
        self.gaps = gaps or {}
        self.calls = []

    def top(self, ids) -> int:
        return 5 + (sum(ids) * 7 + len(ids)) % (VOCAB - 10)

    def continue_greedy(self, ids, n) -> list[int]:
        ids, out = list(ids), []
        for _ in range(n):
            out.append(self.top(ids))
            ids.append(out[-1])
        return out

    def generate(self, server, body, timeout=300.0):
        ids, sp = body["input_ids"], body["sampling_params"]
        self.calls.append(body)
        if body.get("return_logprob"):
            t = self.top(ids)
            gap = self.gaps.get(tuple(ids), 1.0)
            return {"meta_info": {"output_top_logprobs": [[(-1.0, t, None), (-1.0 - gap, t + 1, None),
                                                           (-9.0, t + 2, None)]]}}
        out = self.continue_greedy(ids, sp["max_new_tokens"])
        return {"output_ids": out, "meta_info": {"completion_tokens": len(out)}}


PROMPT = [7, 8, 9]
N = 12


@pytest.fixture
def toy(monkeypatch):
    def make(gaps=None):
        base = ToyBase(gaps)
        monkeypatch.setattr(compare, "generate", base.generate)
        return base
    return make


def _tie_branch(base, at: int):
    """The baseline's output, and an output that takes the runner-up at position `at` and then continues exactly
    as the baseline does from there (what a correct DFLASH server may produce at a genuine near-tie)."""
    out = base.continue_greedy(PROMPT, N)
    ctx = PROMPT + out[:at]
    alt = out[:at] + [out[at] + 1]
    return out, ctx, alt + base.continue_greedy(PROMPT + alt, N - len(alt))


def test_identical_outputs_excuse_nothing(toy):
    base = toy()
    out = base.continue_greedy(PROMPT, N)
    assert compare.check_greedy(None, PROMPT, out, list(out), N) == 0
    assert base.calls == []  # nothing to look up


def test_runner_up_at_a_near_tie_with_matching_continuation_is_excused(toy):
    base = toy()
    out, ctx, spec = _tie_branch(base, 4)
    base.gaps[tuple(ctx)] = compare.TIE_TOL / 2
    assert spec != out
    assert compare.check_greedy(None, PROMPT, out, spec, N) == 1


def test_wrong_rest_after_an_excused_tie_fails(toy):
    # mutation: the old rule stopped comparing at the first excused divergence; here DFLASH takes the tie's other
    # branch and then emits the baseline's ORIGINAL tail (a stale-context bug), which the continuation exposes
    base = toy()
    out, ctx, _ = _tie_branch(base, 4)
    base.gaps[tuple(ctx)] = compare.TIE_TOL / 2
    spec = out[:4] + [out[4] + 1] + out[5:]
    with pytest.raises(pytest.fail.Exception, match="greedy divergence"):
        compare.check_greedy(None, PROMPT, out, spec, N)


def test_a_token_other_than_the_runner_up_fails_even_at_a_tie(toy):
    # mutation: the old rule excused ANY token when the gap was under 1e-4
    base = toy()
    out, ctx, _ = _tie_branch(base, 4)
    base.gaps[tuple(ctx)] = 0.0
    spec = out[:4] + [out[4] + 2] + base.continue_greedy(PROMPT + out[:4] + [out[4] + 2], N - 5)
    with pytest.raises(pytest.fail.Exception, match="top-2"):
        compare.check_greedy(None, PROMPT, out, spec, N)


def test_runner_up_beyond_the_measured_tolerance_fails(toy):
    # mutation: the old rule excused the runner-up up to a gap of 5e-3 (one observed float16 case)
    base = toy()
    out, ctx, spec = _tie_branch(base, 4)
    base.gaps[tuple(ctx)] = 2e-3
    with pytest.raises(pytest.fail.Exception, match="gap 0.002"):
        compare.check_greedy(None, PROMPT, out, spec, N)


def test_ties_are_bounded_per_output_and_per_test(toy):
    base = toy()
    out, ctx, spec = _tie_branch(base, 2)
    base.gaps[tuple(ctx)] = 0.0
    with pytest.raises(pytest.fail.Exception, match="near-tie divergences in one output"):
        compare.check_greedy(None, PROMPT, out, spec, N, max_excused=0)
    # per-test cap: the same excused prompt twice, cap 1 -> fails; counts are per prompt
    assert compare.check_all(None, [PROMPT, PROMPT], [out, out], [spec, out], N, max_excused_prompts=1) == [1, 0]
    with pytest.raises(AssertionError, match="2 of 2 prompts diverged"):
        compare.check_all(None, [PROMPT, PROMPT], [out, out], [spec, spec], N, max_excused_prompts=1)


def test_length_difference_without_token_difference_fails(toy):
    base = toy()
    out = base.continue_greedy(PROMPT, N)
    with pytest.raises(pytest.fail.Exception, match="lengths differ"):
        compare.check_greedy(None, PROMPT, out, out[:-1], N)
    with pytest.raises(AssertionError, match="empty DFLASH output"):
        compare.check_all(None, [PROMPT], [out], [[]], N, max_excused_prompts=0)


def test_multi_token_check():
    one_per_step = [{"completion_tokens": 48, "spec_verify_ct": 46}, {"completion_tokens": 48, "spec_verify_ct": 47},
                    {"completion_tokens": 1}]  # every commit 1 token (finishing step counted or not), a prefill-only
    with pytest.raises(AssertionError, match="no verify step committed more than 1 token"):
        compare.assert_multi_token(one_per_step, "synthetic")
    compare.assert_multi_token(one_per_step + [{"completion_tokens": 48, "spec_verify_ct": 45}], "synthetic")


def test_radix_hit_check():
    def usage(cached):
        details = None if cached is None else SimpleNamespace(cached_tokens=cached)
        return SimpleNamespace(prompt_tokens_details=details)

    compare.assert_radix_hit(usage(40), 40)
    # mutation: a server without --enable-cache-report (no details), or a miss
    with pytest.raises(AssertionError, match="enable-cache-report"):
        compare.assert_radix_hit(usage(None), 40)
    with pytest.raises(AssertionError, match="radix hit"):
        compare.assert_radix_hit(usage(3), 40)


def _toy_joint(skew: float = 0.0) -> dict:
    """16 outcomes (t1, t2) of a two-token draw; skew moves mass towards the first outcome of each t1."""
    p1 = [0.45, 0.25, 0.18, 0.12]
    p2 = [0.5, 0.3, 0.15, 0.05]
    q2 = [p2[0] + skew] + [x - skew / 3 for x in p2[1:]]
    return {(a, b): p1[a] * q2[b] for a in range(4) for b in range(4)}


def _draw(joint: dict, n: int, seed: int) -> list:
    import random

    rng = random.Random(seed)
    return rng.choices(list(joint), weights=list(joint.values()), k=n)


def test_histogram_accepts_the_exact_distribution_and_rejects_a_mutant():
    exact, mutant = _toy_joint(), _toy_joint(skew=0.12)  # the mutant: TV 0.12 from exact
    good = compare.Histogram(_draw(exact, 1200, seed=1), exact)
    good.check("exact draws")
    assert good.cells == 16 and 0.08 < good.detectable_tv < 0.09  # n = 1200 over 16 cells at alpha 1e-3
    assert abs(good.tv_of(mutant) - 0.12) < 1e-9 and good.tv_of(mutant) > good.detectable_tv
    # mutation: draws from the mutant (a verify with the wrong distribution) must fail
    with pytest.raises(AssertionError, match="departs from the exact distribution"):
        compare.Histogram(_draw(mutant, 1200, seed=1), exact).check("mutant draws")
    # a draw outside the support fails outright
    with pytest.raises(AssertionError, match="outside the support"):
        compare.Histogram(_draw(exact, 1199, seed=2) + [(9, 9)], exact).check("out-of-support draw")


def test_wider_tie_rule_takes_a_flat_top_and_nothing_more():
    """judge_greedy's top_k (benchmarks/greedy_judge.py on random targets): a divergence to the plain server's
    third-best token within tie_tol of the best is excused at top_k = 5 and not at 2; one 0.5 below the best is
    refused either way."""
    from sglang_dflash.testing.greedy_check import judge_greedy

    def top(ids):  # best 10, then 11 and 12 within 0.125, then 13 at 0.5 below
        return [(-1.0, 10), (-1.0625, 11), (-1.125, 12), (-1.5, 13), (-9.0, 14)]

    def cont(ids, n):
        return [10] * n

    base = [10] * 6
    for spec, k, ok in (([12] + [10] * 5, 5, True), ([12] + [10] * 5, 2, False), ([13] + [10] * 5, 5, False)):
        v = judge_greedy([1, 2], base, spec, 6, top, cont, tie_tol=0.25, max_excused=3, top_k=k)
        assert (v.failure is None) == ok, (spec, k, v.failure)
