"""End to end on CPU: the real `sglang.launch_server` with our DFLASH worker vs the same server without speculation.

Both servers run a float32 tiny Qwen3 target with peaky logits (--dtype float32: SGLang would serve it in float16);
the DFLASH one uses a drafter trained for a few hundred CPU steps on the target's own greedy continuations, and every
test asserts that some verify step committed several tokens (compare.assert_multi_token). Greedy outputs must be
token-for-token identical (near-ties under the measured float32 noise excused, none expected: see compare.py). Every
test runs twice: with overlap scheduling (SGLang's default, the scheduler prepares step n+1 while step n's results
are still pending) and with --disable-overlap-schedule. One baseline server (conftest.baseline, no overlap) serves both.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import shutil
import time

import pytest

pytestmark = pytest.mark.server
torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, assert_radix_hit  # noqa: E402
from .compare import assert_valid_sample  # noqa: E402
from .compare import ALPHA, Histogram, check_all, check_greedy, complete, generate, greedy, next_logprobs  # noqa: E402
from .compare import log_count, wait_all_healthy  # noqa: E402
from .compare import client as _client  # noqa: E402
from .compare import port  # noqa: E402
from .models import TRAIN_PROMPT_SEED, random_prompts  # noqa: E402

MAX_TOKENS = 48
MODES = {"overlap": 30000, "no_overlap": 30002}  # mode -> port of its DFLASH server


@pytest.fixture(scope="module", params=list(MODES))
def servers(request, dflash_pair, baseline):
    """A DFLASH server in the given scheduling mode (started and stopped per mode) and the shared baseline."""
    mode = request.param
    root, target, draft, info = dflash_pair
    args = list(CPU_SERVER_ARGS)
    if mode == "overlap":
        args.remove("--disable-overlap-schedule")
    # --enable-cache-report: without it SGLang leaves usage.prompt_tokens_details empty (radix hits unprovable)
    args += FLOAT32 + SPEC_ARGS + ["--speculative-draft-model-path", str(draft), "--enable-cache-report"]
    env = {**cpu_server_env(root / "stub"), **FULL_BLOCK}  # the full block every step (see compare.FULL_BLOCK)
    spec = launch_server(target, port(MODES[mode]), root / f"spec_{mode}.log", args, env)
    try:
        wait_all_healthy(baseline, spec)
        ready = [ln for ln in spec.log_path.read_text(errors="replace").splitlines()
                 if "sglang-dflash worker ready" in ln]
        assert ready and re.search(rf"\boverlap={mode == 'overlap'}\b", ready[0]), \
            f"the worker's ready line does not confirm mode {mode}: {ready}"
        yield {"base": baseline, "spec": spec, "vocab": info["vocab"], "target": str(target), "mode": mode}
    finally:
        spec.stop()


def _complete(server, model, prompt, **kw):
    return complete(server, model, prompt, **kw)


def _check(servers, prompt, base_ids, spec_ids, extra=None):
    """One prompt's greedy DFLASH output equals the baseline's; 0 excused ties (none expected on this target)."""
    assert check_greedy(servers["base"], prompt, base_ids, spec_ids, MAX_TOKENS, extra) == 0, \
        f"a near-tie divergence was excused for {prompt}; this test allows none"


def test_concurrent_equality_with_abort_stop_sampling(servers):
    base, spec, model, vocab = servers["base"], servers["spec"], servers["target"], servers["vocab"]
    prompts = random_prompts(18, vocab, seed=7)

    # Stop string: taken from the middle of the baseline's own text, so it certainly occurs.
    probe = _complete(base, model, prompts[0], max_tokens=MAX_TOKENS, temperature=0)
    stop = probe.text[len(probe.text) // 2: len(probe.text) // 2 + 3]
    assert stop.strip(), f"degenerate stop string {stop!r} from {probe.text!r}"

    def greedy_gen(server, p):
        return greedy(server, p, MAX_TOKENS)

    def abort_one():
        # A long request whose client gives up after 1 s: SGLang aborts it on disconnect; its slots must come back.
        c = openai.OpenAI(base_url=spec.url + "/v1", api_key="none", timeout=1.0, max_retries=0)
        try:
            c.completions.create(model=model, prompt=prompts[1], max_tokens=1500, temperature=0,
                                 extra_body={"ignore_eos": True})
        except (openai.APITimeoutError, openai.APIConnectionError):
            return "aborted"
        return "finished"

    with cf.ThreadPoolExecutor(max_workers=24) as pool:
        spec_f = [pool.submit(greedy_gen, spec, p) for p in prompts]
        abort_f = pool.submit(abort_one)
        one_f = pool.submit(_complete, spec, model, prompts[2], max_tokens=1, temperature=0)
        stop_f = pool.submit(_complete, spec, model, prompts[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
        samp_f = pool.submit(_complete, spec, model, prompts[3], max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9,
                             seed=1234)
        base_f = [pool.submit(greedy_gen, base, p) for p in prompts]
        base_one = pool.submit(_complete, base, model, prompts[2], max_tokens=1, temperature=0)
        base_stop = pool.submit(_complete, base, model, prompts[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
        spec_out = [f.result() for f in spec_f]
        base_out = [f.result() for f in base_f]
        one, b_one, st, b_st, samp = (f.result() for f in (one_f, base_one, stop_f, base_stop, samp_f))
        assert abort_f.result() == "aborted"

    check_all(base, prompts, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], MAX_TOKENS,
              max_excused_prompts=0)
    assert_multi_token([s["meta_info"] for s in spec_out], "18 concurrent greedy requests")

    assert list(one.token_ids) == list(b_one.token_ids) and len(one.token_ids) == 1
    assert st.finish_reason == b_st.finish_reason == "stop"
    assert st.text == b_st.text and stop not in st.text
    assert samp.finish_reason in ("length", "stop") and len(samp.token_ids) >= 1
    assert all(0 <= t < vocab for t in samp.token_ids)
    if samp.finish_reason == "length":
        assert len(samp.token_ids) == MAX_TOKENS

    # The server still serves correctly after the abort (its KV slots were released, nothing is stuck).
    again = greedy(spec, prompts[4], MAX_TOKENS)
    _check(servers, prompts[4], base_out[4]["output_ids"], again["output_ids"])


def test_shared_prefix_radix_hit(servers):
    """A request sharing a 40-token prefix with a finished one hits the radix cache in the DFLASH server (the draft
    context K/V of the cached prefix is reused, not recomputed), and its output still equals the baseline's."""
    base, spec, model, vocab = servers["base"], servers["spec"], servers["target"], servers["vocab"]
    # The shared head is the looping prompt (see test_acceptance_above_one) followed by its own greedy
    # continuation, and `second` continues that loop: the drafter knows it, so the request that hits the cache
    # commits several tokens per step (on a random head it committed 1 token per step, proving nothing about the
    # draft context K/V reused from the cache).
    loop = random_prompts(18, vocab, seed=7)[5]
    text = loop + greedy(base, loop, MAX_TOKENS)["output_ids"]
    assert len(text) >= 42, f"the looping prompt's text is only {len(text)} tokens"
    head = text[:40]
    first, second = head + [11, 12, 13], text[:42]
    spec_first = greedy(spec, first, MAX_TOKENS)
    spec_second = greedy(spec, second, MAX_TOKENS)  # native API: meta_info carries cached_tokens and spec counts
    # the OpenAI path reports the hit in usage (with --enable-cache-report); now the whole prompt is cached
    r = _client(spec).completions.create(model=model, prompt=second, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert spec_second["meta_info"]["cached_tokens"] >= len(head), \
        f"expected a radix hit of >= {len(head)} tokens, meta_info says {spec_second['meta_info']['cached_tokens']}"
    assert_radix_hit(r.usage, len(second) - 1)
    for prompt, ids in ((first, spec_first["output_ids"]), (second, spec_second["output_ids"]),
                        (second, list(r.choices[0].token_ids))):
        _check(servers, prompt, greedy(base, prompt, MAX_TOKENS)["output_ids"], ids)
    assert_multi_token([spec_second["meta_info"]], "the request that hit the radix cache")


def test_acceptance_above_one(servers):
    spec, vocab = servers["spec"], servers["vocab"]
    # Prompt 5 of the concurrent set drives the target into a short loop that the trained drafter has learned:
    # the reference engine (sglang_dflash.reference) commits 13.2 tokens per step on it with this pair.
    body = {"input_ids": random_prompts(18, vocab, seed=7)[5], "sampling_params": {"max_new_tokens": 64,
                                                                                    "temperature": 0}}
    meta = generate(spec, body)["meta_info"]
    accept = meta.get("spec_accept_length")
    assert accept is not None, f"no spec_accept_length in meta_info: {sorted(meta)}"
    # 12.8 measured (64 tokens in 5 steps). Well above 1 is not enough: a context K/V written slightly wrong (a
    # layer's norm, RoPE or projection) still accepts some drafts, so hold the server close to the oracle.
    assert accept >= 10.0, f"accept length {accept}: the reference engine gets 13.2 on this prompt with this pair"
    assert spec.alive()


def test_new_request_admitted_beside_a_full_batch(servers):
    """22 long requests fill 22 of the server's 24 request slots; a short one sent then must be admitted at once
    (serving/admission.py), as plain decoding would: SGLang's DFLASH default would hold it until 4 slots are free,
    i.e. until long requests finish. It must finish before any long one."""
    spec, vocab = servers["spec"], servers["vocab"]
    prompts = random_prompts(23, vocab, seed=29, lo=8, hi=16)
    # sampled at T = 1: few drafts accepted, so the long requests take many steps (greedy, the trained drafter
    # commits ~13 tokens per step on this pair and they would be over before the short one arrives)
    long_body = {"sampling_params": {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}}
    t0 = time.monotonic()

    def timed(prompt, body):
        out = generate(spec, {**body, "input_ids": list(prompt)})
        assert "output_ids" in out, out
        return time.monotonic() - t0

    with cf.ThreadPoolExecutor(23) as pool:
        longs = [pool.submit(timed, p, long_body) for p in prompts[:22]]
        time.sleep(1.5)  # the 22 are prefilled and decoding (a few hundred ms on CPU)
        assert not any(f.done() for f in longs), "the long requests ended too early to fill the batch"
        short = pool.submit(timed, prompts[22], {"sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        finished_short = short.result(timeout=300)
        first_long = min(f.result(timeout=300) for f in longs)
    assert finished_short < first_long, (
        f"the short request finished at {finished_short:.1f} s, after the first long one ({first_long:.1f} s): "
        "its admission waited for free slots")
    assert log_count(spec, "admitted as in plain decoding") >= 1


# Penalties, min_tokens, grammars and logprobs are applied per block position and compared with plain decoding in
# test_controls_cpu.py (which also checks that a custom logit processor is refused with HTTP 400). Here: the
# controls at their neutral values are accepted and change nothing.
def test_neutral_sampling_controls_change_nothing(servers):
    spec, base, vocab = servers["spec"], servers["base"], servers["vocab"]
    prompt = random_prompts(18, vocab, seed=7)[5]  # the looping prompt: the drafter knows it (multi-token commits)
    neutral = greedy(spec, prompt, MAX_TOKENS, {"frequency_penalty": 0.0, "presence_penalty": 0.0,
                                                "repetition_penalty": 1.0, "min_new_tokens": 0})
    _check(servers, prompt, greedy(base, prompt, MAX_TOKENS)["output_ids"], neutral["output_ids"])
    assert_multi_token([neutral["meta_info"]], "a request with neutral penalties")
    assert spec.alive()


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.05}
TOP_K = 3
BIAS = {"77": 4.0, "301": 3.0}  # logit_bias (token id -> added logit): large enough to change greedy choices here


def test_mixed_greedy_and_sampled_batch(servers):
    """Greedy rows in a batch that also holds sampled rows stay identical to the baseline and commit several tokens
    per step (so they go through the sampled acceptance rule as top_k = 1 rows); sampled rows (temperature, top-p,
    min-p; top-k on half of them) are complete and every sampled token lies inside the target's processed support.
    A greedy row with logit_bias equals the baseline with the same bias (the verify adds it to every block row)."""
    spec, base, model, vocab = servers["spec"], servers["base"], servers["target"], servers["vocab"]
    # the drafter's own training prompts (models.build_pair): the assertion below needs multi-token commits in the
    # mixed batch, and on unseen random prompts a 300-step tiny drafter may accept nothing (equality holds on any)
    greedy_p = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)[:8]
    sampled_p = random_prompts(8, vocab, seed=42)
    biased_p = greedy_p[0]

    def sampled(i, p):
        sp = {"max_new_tokens": MAX_TOKENS, "sampling_seed": 100 + i, **SAMPLED}
        if i % 2:
            sp["top_k"] = TOP_K
        r = generate(spec, {"input_ids": p, "sampling_params": sp})
        assert "output_ids" in r, r
        return r

    with cf.ThreadPoolExecutor(max_workers=24) as pool:
        # sampled first, so the greedy requests join a running batch that already holds sampled rows
        samp_f = [pool.submit(sampled, i, p) for i, p in enumerate(sampled_p)]
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS) for p in greedy_p]
        bias_f = pool.submit(greedy, spec, biased_p, MAX_TOKENS, {"logit_bias": BIAS})
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in greedy_p]
        b_bias_f = pool.submit(greedy, base, biased_p, MAX_TOKENS, {"logit_bias": BIAS})
        samp, spec_out, base_out = ([f.result() for f in fs] for fs in (samp_f, spec_f, base_f))
        biased, b_biased = bias_f.result(), b_bias_f.result()

    check_all(base, greedy_p, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], MAX_TOKENS,
              max_excused_prompts=0)
    assert_multi_token([s["meta_info"] for s in spec_out], "greedy rows of a mixed greedy/sampled batch")
    assert b_biased["output_ids"] != base_out[0]["output_ids"], "the logit_bias changes nothing: pick another"
    _check(servers, biased_p, b_biased["output_ids"], biased["output_ids"], {"logit_bias": BIAS})
    for i, (p, r) in enumerate(zip(sampled_p, samp)):
        toks, finish = r["output_ids"], r["meta_info"]["finish_reason"]["type"]
        assert finish in ("length", "stop") and toks, (finish, toks)
        if finish == "length":
            assert len(toks) == MAX_TOKENS
        assert all(0 <= t < vocab for t in toks)
        assert_valid_sample(base, p, toks, vocab, **SAMPLED, top_k=TOP_K if i % 2 else 0)
    # sampling actually happened (not a greedy fallback): some sampled output differs from its greedy output
    greedy_of_sampled = [greedy(base, p, MAX_TOKENS)["output_ids"] for p in sampled_p[:4]]
    assert any(g != s["output_ids"] for g, s in zip(greedy_of_sampled, samp)), \
        "every sampled output equals its greedy output"


# On this prompt a verify ignoring temperature would move the (t1, t2) distribution by TV 0.14 (0.06 at T = 0.7),
# one ignoring top_k by 0.7; n = 1200 over ~16 cells detects TV >= ~0.085 (80% power, alpha 1e-3): asserted below.
HIST = {"temperature": 0.5, "top_k": 4}
N_HIST = 1200
def test_sampled_histogram_matches_target(servers):
    """N_HIST requests of one prompt (max_new_tokens 2, temperature + top_k, distinct seeds) through the DFLASH
    server: the first token is SGLang's own sampler (prefill), the second comes from our verify step (accept the
    draft d_1 with probability p(d_1), else sample the residual). The histogram of (t1, t2) must follow the target's
    exact processed joint distribution, computed from the baseline's full-vocabulary logprobs, by a chi-square test
    at ALPHA. Its power is computed and asserted each run: detectable_tv (80% power), and the TV that a verify
    ignoring temperature or top-k would produce here must exceed it. A few longer requests of the same prompt in
    the batch show that sampled rows commit several tokens per step."""
    if servers["mode"] != "overlap":
        pytest.skip("the verify's sampling does not depend on the scheduling mode: one run (overlap) suffices")
    from sglang_dflash.sampling import SamplingParams, SamplingTensors, processed_probs

    base, spec, vocab = servers["base"], servers["spec"], servers["vocab"]
    prompt = random_prompts(18, vocab, seed=7)[5]  # the prompt the drafter knows best: its drafts are often kept
    params = [{"max_new_tokens": 2, "sampling_seed": 1000 + i, **HIST} for i in range(N_HIST)]
    params += [{"max_new_tokens": MAX_TOKENS, "sampling_seed": i, **HIST} for i in range(8)]
    t0 = time.time()
    out = generate(spec, {"input_ids": [prompt] * len(params), "sampling_params": params}, timeout=600.0)
    assert isinstance(out, list) and len(out) == len(params), str(out)[:500]
    wall = time.time() - t0
    assert_multi_token([o["meta_info"] for o in out[N_HIST:]], "sampled requests (temperature + top_k)")
    pairs = [tuple(o["output_ids"]) for o in out[:N_HIST]]
    assert all(len(p) == 2 for p in pairs), [p for p in pairs if len(p) != 2][:5]

    def dist(lps, **kw):  # our sampling module's processed distribution over the vocabulary, float64
        logits = torch.tensor([[lps[t] for t in range(vocab)]], dtype=torch.float64)
        s = SamplingTensors.from_params([SamplingParams(**kw)], vocab)
        return processed_probs(logits, s)[0].double()

    first = next_logprobs(base, prompt, vocab)
    p1 = dist(first, temperature=HIST["temperature"], top_k=HIST["top_k"])
    joint, wrong_t, wrong_k = {}, {}, {}
    for t1 in p1.nonzero()[:, 0].tolist():
        lps = next_logprobs(base, prompt + [t1], vocab)
        for name, table, kw in (("exact", joint, HIST), ("T ignored", wrong_t, {"top_k": HIST["top_k"]}),
                                ("top_k ignored", wrong_k, {"temperature": HIST["temperature"]})):
            p2 = dist(lps, **{"temperature": 1.0, **kw})
            for t2 in p2.nonzero()[:, 0].tolist():
                table[(t1, t2)] = p1[t1].item() * p2[t2].item()
    verdict = Histogram(pairs, joint)
    tv_t, tv_k = verdict.tv_of(wrong_t), verdict.tv_of(wrong_k)
    pvalue, d_min, cells = verdict.pvalue, verdict.detectable_tv, verdict.cells
    print(f"histogram: n={N_HIST} requests in {wall:.1f} s, {cells} cells, chi-square p={pvalue:.3g}; detects "
          f"TV >= {d_min:.3f} with 80% power at alpha={ALPHA}; TV of a verify ignoring temperature {tv_t:.3f}, "
          f"ignoring top_k {tv_k:.3f}")
    assert tv_t > d_min and tv_k > d_min, (
        f"the histogram test lacks power here: detects TV >= {d_min:.3f}, but ignoring temperature moves the "
        f"distribution by {tv_t:.3f} and ignoring top_k by {tv_k:.3f}: raise N_HIST or change HIST")
    verdict.check("DFLASH's sampled (t1, t2) histogram")
