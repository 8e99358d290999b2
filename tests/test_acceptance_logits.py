"""verify_sampled_logits (the sampled verify rule on logits, for batches without top-k / top-p / min-p) against the
definition it replaces there, verify_sampled(processed_probs(logits, s, filtered=False)):
- greedy rows (temperature 0) equal verify_greedy bit for bit, ties and bfloat16 logits included;
- sampled rows: the joint law of (commit_len, emitted tokens) equals verify_sampled's exact law, enumerated here in
  float64 and checked with one grouped chi-square over every (draft vector, temperature) block; verify_sampled itself
  passes the same check, so the enumeration is the definition's law and not a second derivation;
- with the same generator seed the two rules emit the same tokens (they consume it identically), chunked or not;
- planted bugs (the rejected draft not excluded, the bonus from the wrong row, temperature missing from the
  acceptance probability) make the law check fail.
"""

import pytest
import torch

from _stats import detectable_tv, grouped_chi2
from test_acceptance import BLOCK_PROBS, DRAFT_KINDS
from test_mutations_algorithm import plant

from sglang_dflash import acceptance
from sglang_dflash.acceptance import verify_greedy, verify_sampled, verify_sampled_logits
from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs

ALPHA = 1e-4
# The block of test_acceptance.py as logits (token 5 has probability 0 everywhere: logit -inf), at three temperatures
# so that a rule ignoring temperature anywhere moves mass: T = 1 gives BLOCK_PROBS itself.
BLOCK_LOGITS = BLOCK_PROBS.log()
TEMPERATURES = (1.0, 0.6, 1.8)


def dense(drafts, logits, temperature, generator):
    """The definition: verify_sampled on processed_probs(filtered=False) rows."""
    n, b, v = logits.shape
    s = SamplingTensors.from_params([SamplingParams(temperature=float(t)) for t in temperature], v)
    probs = processed_probs(logits.reshape(n * b, v), s.repeat_interleave(b), filtered=False).view(n, b, v)
    return verify_sampled(drafts, probs, generator)


def exact_law(drafts, logits, temperature):
    """verify_sampled's law of (a = accepted drafts, t = emitted token) as a [B * V] float64 vector (cell a * V + t):
    P(a, t) = prod_{i<a} p_i(d_i) * p_a(t) * [t != d_a when a < B-1], p_i = softmax(l_i / T) in float64."""
    b, v = logits.shape
    p = torch.softmax(logits.double() / temperature, dim=-1)
    law, reach = torch.zeros(b, v, dtype=torch.float64), 1.0
    for a in range(b):
        law[a] = reach * p[a]
        if a < b - 1:
            law[a, drafts[a]] = 0.0  # a rejected draft is never its own replacement
            reach *= float(p[a, drafts[a]])
    assert abs(float(law.sum()) - 1) < 1e-12
    return law.reshape(-1)


def law_check(rule, n=90_000, seed=11):
    """Runs `rule` on n rows, each a (draft vector, temperature) block of the product DRAFT_KINDS x TEMPERATURES, and
    returns (p-value, draws, df) of one grouped chi-square of the (a, t) cells against exact_law per block. The
    emitted tokens must also have the layout the worker relies on (accepted drafts, t, then -1)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(d, t) for d in range(len(DRAFT_KINDS)) for t in TEMPERATURES]
    kind = torch.arange(n) % len(blocks)
    drafts = DRAFT_KINDS[[blocks[k][0] for k in kind.tolist()]]
    temperature = torch.tensor([blocks[k][1] for k in kind.tolist()], dtype=torch.float32)
    b, v = BLOCK_LOGITS.shape
    commit, tokens = rule(drafts, BLOCK_LOGITS.expand(n, b, v).contiguous(), temperature, g)
    a = commit - 1
    col = torch.arange(b)[None, :]
    padded = torch.cat([drafts, torch.full((n, 1), -1)], dim=1)
    emitted = tokens.gather(1, a[:, None])[:, 0]
    layout = torch.where(col < a[:, None], padded, torch.full_like(padded, -1)).scatter(1, a[:, None], emitted[:, None])
    assert torch.equal(tokens, layout), "tokens are not [accepted drafts, emitted token, -1 ...]"
    assert ((emitted >= 0) & (emitted < v)).all()
    cell = a * v + emitted
    groups = [(torch.bincount(cell[kind == k], minlength=b * v),
               exact_law(DRAFT_KINDS[d], BLOCK_LOGITS, t)) for k, (d, t) in enumerate(blocks)]
    pvalue, draws, df, impossible = grouped_chi2(groups)
    return pvalue, draws, df, impossible


def test_exact_law_is_verify_sampleds():
    """The enumerated law is the definition's: verify_sampled on the processed probabilities passes the check."""
    pvalue, draws, df, impossible = law_check(dense)
    assert not impossible and pvalue > ALPHA, (pvalue, draws, df)


def test_logits_rule_has_the_exact_law():
    """(commit_len, tokens) of verify_sampled_logits follow verify_sampled's exact law on 90,000 rows of 9 blocks.
    Power (grouped chi-square at ALPHA = 1e-4, 95% against the worst direction, _stats.detectable_tv): a mean TV of
    ~0.018 over the rows; the planted bugs below move far more, or put draws on probability-0 cells."""
    pvalue, draws, df, impossible = law_check(verify_sampled_logits)
    assert not impossible, "a draw landed on a cell of probability 0 (a rejected draft re-emitted, or token 5)"
    assert pvalue > ALPHA, (pvalue, draws, df)
    assert detectable_tv(draws, df, ALPHA) < 0.02, (draws, df)


LOGITS_BUGS = {  # bug: (old source, new source) in verify_sampled_logits
    "rejected draft not excluded": ("torch.full_like(kept, -torch.inf)", "kept"),
    "next token from the last draft's row": ("target_logits[rows, accepted] /",
                                             "target_logits[rows, accepted.clamp(max=b - 2)] /"),
    "next token from the row before": ("target_logits[rows, accepted] /",
                                       "target_logits[rows, (accepted - 1).clamp(min=0)] /"),
    "acceptance probability at temperature 1": ("temp[start:stop, None, None])",
                                                "torch.ones_like(temp[start:stop, None, None]))"),
    "acceptance probability without temperature in the draft logit": ("[:, :, 0] / temp[:, None]", "[:, :, 0]"),
}


@pytest.mark.parametrize("bug", list(LOGITS_BUGS))
def test_law_check_catches(monkeypatch, bug):
    old, new = LOGITS_BUGS[bug]
    plant(monkeypatch, acceptance, "verify_sampled_logits", old, new)
    pvalue, draws, df, impossible = law_check(acceptance.verify_sampled_logits)
    assert impossible or pvalue < 1e-8, (bug, pvalue, draws, df)


def random_case(n, b, v, seed, greedy_share=0.3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, b, v, generator=g) * 3).to(dtype)
    logits[0, :, 3] = logits[0, :, 7] = logits[0].float().amax(-1) + 1  # exact ties: the first index wins
    # drafts: the target's argmax often (so greedy rows accept several), random otherwise
    drafts = torch.where(torch.rand(n, b - 1, generator=g) < 0.6, logits[:, :-1].argmax(-1),
                         torch.randint(v, (n, b - 1), generator=g))
    drafts[0] = 7  # a tied token that is not the first maximal index: greedy rejects it
    temperature = torch.rand(n, generator=g) * 1.5 + 0.3
    temperature[torch.rand(n, generator=g) < greedy_share] = 0.0
    temperature[0] = 0.0
    return drafts, logits, temperature


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 2, 5])
def test_greedy_rows_equal_verify_greedy(dtype, b):
    drafts, logits, temperature = random_case(256, b, 50, seed=b, dtype=dtype)
    greedy = temperature == 0
    want = verify_greedy(drafts, logits)
    got = verify_sampled_logits(drafts, logits, temperature, torch.Generator().manual_seed(0))
    assert torch.equal(got[0][greedy], want[0][greedy]) and torch.equal(got[1][greedy], want[1][greedy])
    everyone = verify_sampled_logits(drafts, logits, torch.zeros_like(temperature))  # an all-greedy batch
    assert torch.equal(everyone[0], want[0]) and torch.equal(everyone[1], want[1])
    if b > 1:
        assert {1, b} <= set(want[0].tolist())  # both full rejection and full acceptance occur


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 4])
def test_same_seed_same_tokens_as_the_definition(dtype, b, monkeypatch):
    """Both rules draw uniforms [N, B-1] then exponentials [N, V] from the generator, so with one seed they pick the
    same tokens except where float rounding (p versus log p) decides a draw: a row-for-row check of the coupling,
    with the draft rows' log-sum-exp split into many ragged chunks."""
    drafts, logits, temperature = random_case(600, b, 300, seed=5, dtype=dtype)
    want = dense(drafts, logits.float(), temperature, torch.Generator().manual_seed(9))
    got = verify_sampled_logits(drafts, logits, temperature, torch.Generator().manual_seed(9))
    same = (got[0] == want[0]) & (got[1] == want[1]).all(dim=1)
    assert same.float().mean() >= 0.995, f"{int((~same).sum())} of {len(same)} rows differ"
    monkeypatch.setattr(acceptance, "_LSE_CHUNK_ELEMENTS", 7 * max(b - 1, 1) * 300 + 1)  # 7 requests, ragged end
    chunked = verify_sampled_logits(drafts, logits, temperature, torch.Generator().manual_seed(9))
    assert torch.equal(chunked[0], got[0]) and torch.equal(chunked[1], got[1])


def test_banned_tokens_are_never_accepted_or_emitted():
    """A token with logit -inf (logit_bias -inf, a grammar mask) has probability 0: never accepted as a draft, never
    the replacement or the bonus, at any temperature."""
    g = torch.Generator().manual_seed(2)
    n, b, v = 4000, 4, 12
    logits = torch.randn(n, b, v, generator=g)
    logits[..., 4] = -torch.inf
    drafts = torch.full((n, b - 1), 4)
    drafts[::2] = logits[::2, :-1].argmax(-1)
    drafts[::4, -1] = 4  # the likely path, then the banned token last
    temperature = torch.tensor([0.0, 0.5, 1.0, 2.0]).repeat(n // 4)
    commit, tokens = verify_sampled_logits(drafts, logits, temperature, g)
    assert not (tokens == 4).any()
    assert (commit > 1).any()


def test_benchmark_script_runs_both_rules():
    """benchmarks/sampled_verify_bench.py (run by hand, on the GPU too): both rules run on its inputs, in process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.sampled_verify_bench import RULES, measure

    for rule in RULES:
        row = measure(rule, 3, 4, 64, "bfloat16", "cpu", reps=1)
        assert row["rule"] == rule and row["ms"] > 0 and row["logits_mib"] > 0
