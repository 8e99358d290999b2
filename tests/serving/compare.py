"""Talking to the CPU test servers and comparing a DFLASH server's output with a no-speculation baseline.

Greedy outputs must be token-for-token identical. The one excuse is float32 noise at a near-tie of the baseline
(check_greedy): a verify scores a token with an extend kernel, the baseline with a decode kernel, and where the
baseline's top-2 logprobs are closer than that noise the two may legitimately pick different tokens. A divergence is
excused only when the DFLASH token is the baseline's runner-up (the two tokens are exactly the baseline's top-2)
AND their gap is under TIE_TOL; the baseline is then re-run from the divergence (prompt + output up to and including
the DFLASH token) and the rest of the DFLASH output must equal that continuation, recursively (MAX_EXCUSED deep).
The rule itself is `sglang_dflash.testing.greedy_check` (shared with benchmarks/soak.py); this module measured its
float32 tolerance and fails the test. Tests cap how many prompts may be excused at all.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import math
import os
import time
import urllib.error
import urllib.request

import openai
import pytest

from sglang_dflash.testing.greedy_check import judge_greedy

# Float32 noise of the top-2 logprob gap, measured on the baseline servers (--dtype float32) of the tiny Qwen3 target
# (40 prompts of the serving tests x 48 greedy tokens, 1,855 positions) and of the tiny Gemma-3 target (the same
# prompts, 1,920 positions): at every position the gap the decode kernel reports (output_top_logprobs) against the
# gap the extend kernel reports for the same sequence (input_top_logprobs of one prefill), and both against a float64
# transformers recompute. Largest differences, Qwen3 / Gemma-3: decode vs extend 2.9e-6 / 4.4e-6, decode vs float64
# 1.7e-6 / 2.7e-6, extend vs float64 2.6e-6 / 3.6e-6 (medians under 1e-6); no argmax differs from float64's. The
# smallest real gaps on those positions are 2.7e-4 / 3.1e-3, so with TIE_TOL at 10x the noise no divergence on them
# can be excused, and tests cap excused prompts at 0. Without --dtype float32 SGLang serves these float32
# checkpoints in float16 (dtype "auto"): decode and extend then differed by up to 7.8e-3 and 7 of the Qwen3
# target's 1,855 positions were exact ties, which is why every server in tests/serving passes FLOAT32.
GAP_NOISE_MEASURED = 4.4e-6
TIE_TOL = 10 * GAP_NOISE_MEASURED
FLOAT32 = ["--dtype", "float32"]
MAX_EXCUSED = 3  # excused divergences in one output before it fails anyway (each needs a near-tie: rare)
SPEC_ARGS = ["--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", "16",
             "--speculative-draft-attention-backend", "torch_native"]
# The worker's adaptive verify width (default on) picks each step's number of drafts k from CPU wall-clock step
# times and running acceptance; with these tiny drafters it often picks k = 0 (plain decode steps: seen in
# test_shared_prefix_radix_hit, every step committed 1 token), which would leave the multi-token verify / accept /
# commit path, the thing these tests exist to check, unexercised, and each test's coverage timing-dependent. So
# the DFLASH test servers run the full block every step (SGLang's fixed behaviour, and what the acceptance-length
# checks compare with the reference engine) through the worker's own control; test_adaptive_cpu.py forces width
# switches with its k schedule. A worker without the control ignores the variable.
FULL_BLOCK = {"SGLANG_DFLASH_ADAPTIVE": "0"}


def with_grammar(args: list[str]) -> list[str]:
    """Server args with xgrammar and custom logit processors on (the shared baseline's and the controls' servers)."""
    args = list(args)
    args[args.index("--grammar-backend") + 1] = "xgrammar"
    return args + ["--enable-custom-logit-processor"]
STARTUP_S = 420  # a cold start on a busy 2-core machine takes 35-200 s
# Added to every test server's port, so that two checkouts can run tests/serving on one machine at once (a server
# whose port is taken dies, while wait_healthy would get its answer from the other checkout's server).
PORT_OFFSET = int(os.environ.get("SGLANG_DFLASH_TEST_PORT_OFFSET", "0"))


def port(p: int) -> int:
    return p + PORT_OFFSET


def client(server, timeout=180.0):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=timeout, max_retries=0)


def complete(server, model, prompt, **kw):
    r = client(server).completions.create(model=model, prompt=prompt, extra_body={"return_token_ids": True,
                                                                                   **kw.pop("extra_body", {})}, **kw)
    return r.choices[0]


def generate(server, body: dict, timeout=300.0) -> dict:
    """POST /generate; returns the JSON answer, or {"status": code, "error": text} for an HTTP error."""
    req = urllib.request.Request(server.url + "/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode(errors="replace")}


def greedy(server, prompt, max_tokens: int, extra: dict | None = None, timeout=300.0) -> dict:
    """One greedy /generate answer (output_ids, meta_info); fails on an HTTP error."""
    r = generate(server, {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": max_tokens,
                                                                         "temperature": 0, **(extra or {})}}, timeout)
    assert "output_ids" in r, f"greedy request failed: {r}"
    return r


def top2(base, ids) -> list[tuple[float, int]]:
    """The baseline's two most likely next tokens after ids, as [(logprob, token)] best first."""
    meta = generate(base, {"input_ids": list(ids), "return_logprob": True, "top_logprobs_num": 2,
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0}})["meta_info"]
    return [(lp, tok) for lp, tok, _ in sorted(meta["output_top_logprobs"][0], reverse=True)[:2]]


def check_greedy(base, prompt, base_ids, spec_ids, max_tokens: int, extra: dict | None = None,
                 max_excused: int = MAX_EXCUSED, tie_tol: float = TIE_TOL) -> int:
    """How many near-tie divergences were excused in spec_ids (0: identical to base_ids); fails otherwise.

    The rule is `sglang_dflash.testing.greedy_check.judge_greedy`: at a divergence the baseline's top-2 after the
    shared context must be exactly the two tokens with a logprob gap <= tie_tol (TIE_TOL, measured on the tiny
    targets; a real target passes its own); the baseline then continues greedily from the DFLASH token (same
    `extra` sampling params as the original requests, e.g. ignore_eos) and the rest must equal it, recursively."""
    verdict = judge_greedy(prompt, base_ids, spec_ids, max_tokens, lambda ids: top2(base, ids),
                           lambda ids, n: greedy(base, ids, n, extra)["output_ids"], tie_tol, max_excused)
    if verdict.failure:
        pytest.fail(verdict.failure)
    return len(verdict.excused)


def check_all(base, prompts, base_ids, spec_ids, max_tokens: int, max_excused_prompts: int,
              extra: dict | None = None, tie_tol: float = TIE_TOL) -> list[int]:
    """check_greedy for every prompt; at most max_excused_prompts prompts may carry an excused divergence.
    Returns the per-prompt excused counts (a prompt with a nonzero count followed the DFLASH branch of a tie)."""
    counts = []
    for p, b, s in zip(prompts, base_ids, spec_ids, strict=True):
        assert len(s), f"empty DFLASH output for {p}"
        counts.append(check_greedy(base, p, b, s, max_tokens, extra, tie_tol=tie_tol))
    n = sum(c > 0 for c in counts)
    assert n <= max_excused_prompts, (f"{n} of {len(prompts)} prompts diverged at near-ties (limit "
                                      f"{max_excused_prompts}): ties under {tie_tol:.3g} should be rare here")
    return counts


def compare_greedy(base, spec, prompts, max_tokens: int, max_workers: int, max_excused_prompts: int,
                   extra: dict | None = None, timeout=300.0) -> list[dict]:
    """Greedy /generate of every prompt from the DFLASH server and the baseline, all submitted at once (the DFLASH
    ones first) on max_workers threads, then check_all. Returns the DFLASH answers' meta_info."""
    with cf.ThreadPoolExecutor(max_workers=max_workers) as pool:
        spec_f = [pool.submit(greedy, spec, p, max_tokens, extra, timeout) for p in prompts]
        base_f = [pool.submit(greedy, base, p, max_tokens, extra, timeout) for p in prompts]
        spec_out, base_out = [f.result() for f in spec_f], [f.result() for f in base_f]
    check_all(base, prompts, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], max_tokens,
              max_excused_prompts, extra)
    return [s["meta_info"] for s in spec_out]


def extra_committed(meta: dict) -> int:
    """A lower bound on the tokens that multi-token commits added to one DFLASH answer (> 0: some verify step
    committed more than 1 token).

    completion_tokens = 1 (prefill) + the tokens of every verify step; SGLang counts a step in spec_verify_ct only
    if the request is still running after it, so the finishing step is not counted. With every commit 1 token,
    completion_tokens = spec_verify_ct + 2 (or + 1); anything above that came from commits longer than 1."""
    ct = meta.get("spec_verify_ct")
    if not ct:
        return 0
    return meta["completion_tokens"] - 2 - ct


def assert_multi_token(metas, what: str) -> None:
    """Some answer in metas had a verify step commit several tokens, so the multi-token path ran in `what`."""
    extra = [extra_committed(m) for m in metas]
    assert any(e > 0 for e in extra), (
        f"{what}: no verify step committed more than 1 token (completion_tokens - 2 - spec_verify_ct per answer: "
        f"{extra}); the multi-token commit path was not exercised, so this test cannot see its bugs")


def assert_radix_hit(usage, at_least: int) -> None:
    """An OpenAI usage block reports a radix-cache hit of at least `at_least` prompt tokens. SGLang fills
    prompt_tokens_details.cached_tokens only on a server started with --enable-cache-report."""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    assert cached is not None, (f"usage reports no cached_tokens ({usage}): start the server with "
                                f"--enable-cache-report")
    assert cached >= at_least, f"expected a radix hit of >= {at_least} prompt tokens, got {cached} cached"


def wait_all_healthy(*servers, timeout_s: float = STARTUP_S) -> None:
    t0 = time.time()
    for s in servers:
        s.wait_healthy(max(timeout_s - (time.time() - t0), 5.0))


def log_count(server, needle: str) -> int:
    return server.log_path.read_text(errors="replace").count(needle)


def full_logprobs(base, prompt, tokens, vocab) -> list[dict[int, float]]:
    """The baseline's full next-token logprobs (raw logits, temperature 1) for each of tokens after prompt: row k
    is the distribution token k was drawn from. One prefill of prompt + tokens."""
    body = {"input_ids": list(prompt) + list(tokens), "return_logprob": True, "top_logprobs_num": vocab,
            "logprob_start_len": len(prompt) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    meta = generate(base, body)["meta_info"]
    # rows[j]: the distribution of the token at input position start + j; rows[0] is None (the prompt's last
    # token), so token k is judged by rows[k + 1]; the last input token's distribution is the output's (unused).
    rows = meta["input_top_logprobs"]
    assert len(rows) == len(tokens) + 1, f"{len(rows)} logprob rows for {len(tokens)} tokens"
    out = []
    for k in range(len(tokens)):
        lps = {tid: lp for lp, tid, _ in rows[k + 1] if lp is not None}
        assert len(lps) == vocab, f"{len(lps)} logprobs at position {k}, expected the whole vocabulary"
        out.append(lps)
    return out


def next_logprobs(base, ids, vocab) -> dict[int, float]:
    """The baseline's full-vocabulary logprobs (raw logits, temperature 1) of the token after ids."""
    meta = generate(base, {"input_ids": list(ids), "return_logprob": True, "top_logprobs_num": vocab,
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0}})["meta_info"]
    lps = {tid: lp for lp, tid, _ in meta["output_top_logprobs"][0] if lp is not None}
    assert len(lps) == vocab, f"{len(lps)} logprobs after {ids}, expected the whole vocabulary"
    return lps


def processed(lps: dict[int, float], temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, bias: dict[int, float] | None = None) -> dict[int, float]:
    """The target's processed distribution (sglang_dflash.sampling's definition) from full logprobs, in float64:
    bias added to the logits, softmax(logits / T), top-k, top-p (mass before the token, measured before top-k, >
    top_p drops it), min-p; renormalised. Logprobs stand in for logits (they differ by a per-row constant)."""
    scaled = sorted((((lp + (bias or {}).get(t, 0.0)) / temperature, t) for t, lp in lps.items()), reverse=True)
    z = math.log(sum(math.exp(s - scaled[0][0]) for s, _ in scaled)) + scaled[0][0]
    probs = [(math.exp(s - z), t) for s, t in scaled]
    keep, before = {}, 0.0
    for rank, (p, t) in enumerate(probs):
        if (top_k <= 0 or rank < top_k) and before <= top_p and p >= min_p * probs[0][0]:
            keep[t] = p
        before += p
    total = sum(keep.values())
    return {t: p / total for t, p in keep.items()}


def assert_valid_sample(base, prompt, tokens, vocab, temperature, top_p=1.0, min_p=0.0, top_k=0,
                        slack=1e-2) -> None:
    """Every sampled token lies in the support of the target's processed distribution (temperature, top-k, top-p,
    min-p), judged from the baseline's full next-token logprobs at each position (one prefill, all positions).

    ``slack`` (relative) covers float32 kernel noise at the support's edge: one run sampled a token whose p / p_max
    was 0.04994 against min_p 0.05. top_k is exact (a rank is not noisy unless two logprobs tie)."""
    for k, (tok, lps) in enumerate(zip(tokens, full_logprobs(base, prompt, tokens, vocab))):
        assert tok in lps, f"sampled token {tok} at {k} is not in the vocabulary's logprobs"
        scaled = sorted(((lp / temperature, tid) for tid, lp in lps.items()), reverse=True)
        z = math.log(sum(math.exp(s - scaled[0][0]) for s, _ in scaled)) + scaled[0][0]
        probs = [(math.exp(s - z), tid) for s, tid in scaled]
        mass_before, p_tok, rank = 0.0, None, None
        for r, (p, tid) in enumerate(probs):
            if tid == tok:
                p_tok, rank = p, r
                break
            mass_before += p
        if top_k > 0:
            assert rank < top_k, f"token {tok} at output position {k} has rank {rank}, outside top_k={top_k}"
        assert mass_before < top_p + slack, (f"token {tok} at output position {k} lies outside the top_p={top_p} "
                                             f"nucleus (mass before it {mass_before:.4f})")
        assert p_tok >= min_p * probs[0][0] * (1 - slack), (
            f"token {tok} at output position {k} has p={p_tok:.4g} < min_p={min_p} x p_max={probs[0][0]:.4g}")


ALPHA = 1e-3  # false-failure rate of the histogram checks


class Histogram:
    """A chi-square goodness-of-fit verdict for draws (hashable outcomes) against exact probabilities {outcome: p},
    with its power: cells expected under 5 draws are pooled into one; any draw outside the support fails."""

    def __init__(self, draws: list, probs: dict, alpha: float = ALPHA):
        from scipy.stats import chisquare

        self.n, self.alpha, self.support = len(draws), alpha, list(probs)
        self.outside = [d for d in draws if d not in probs]
        counts = collections.Counter(draws)
        total = sum(probs.values())  # float32-built tables sum to 1 only within ~1e-7
        self.expected = [probs[c] / total * self.n for c in self.support]
        self.big = [e >= 5 for e in self.expected]
        obs = [counts[c] for c, b in zip(self.support, self.big) if b]
        exp = [e for e, b in zip(self.expected, self.big) if b]
        pooled = self.n - sum(exp)
        if pooled > 1e-9:
            obs.append(self.n - len(self.outside) - sum(obs))
            exp.append(pooled)
        self.cells = len(exp)
        if self.outside:  # the observed cells no longer sum to n; check() fails on them anyway
            self.pvalue = 0.0
        else:
            self.pvalue = float(chisquare(obs, exp).pvalue) if self.cells > 1 else 1.0
        self.detectable_tv = detectable_tv(self.n, self.cells - 1, alpha)

    def tv_of(self, other: dict) -> float:
        """The total-variation distance between these cells and another distribution's mass on the same cells
        (its mass outside the support counts in full): what this test can see of `other`."""
        total = sum(other.values())
        q = [other.get(c, 0.0) / total for c in self.support]
        mine = [e / self.n for e in self.expected]
        big = [(a, b) for a, b, k in zip(q, mine, self.big) if k]
        small = (sum(a for a, k in zip(q, self.big) if not k), sum(b for b, k in zip(mine, self.big) if not k))
        outside = 1.0 - sum(q)
        return 0.5 * (sum(abs(a - b) for a, b in big + [small]) + outside)

    def check(self, what: str) -> None:
        assert not self.outside, f"{what}: {len(self.outside)} draws outside the support, e.g. {self.outside[:5]}"
        assert self.pvalue > self.alpha, (f"{what} departs from the exact distribution: chi-square p="
                                          f"{self.pvalue:.3g} over {self.cells} cells, n={self.n}")


def detectable_tv(n: int, df: int, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest total-variation distance that a chi-square test of n draws over df + 1 cells rejects at level
    alpha with the given power, whatever the alternative: by Cauchy-Schwarz, an alternative q at TV distance d from
    p has noncentrality n * sum((q - p)^2 / p) >= n * (sum |q - p|)^2 = 4 n d^2."""
    from scipy.stats import chi2, ncx2

    if df < 1:
        return 1.0
    crit = chi2.ppf(1 - alpha, df)
    lo, hi = 0.0, 1e5
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2.sf(crit, df, mid) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))
