"""Sampling controls through the DFLASH server (CPU, float32) against the plain server on the same prompts (issue #11).

Penalties (frequency / presence / repetition) and min_new_tokens are applied to every verify row with the state
plain decoding would have behind that row (sglang_dflash/penalties.py, unit-tested bit for bit in
tests/test_penalties.py); logprobs are the target's own, from the verify rows. Here, end to end:
- greedy with each penalty (and frequency + presence) equals the plain server token for token, and the penalty
  changes the output (so an ignored penalty fails);
- min_tokens holds back a stop token the unconstrained output stops at, exactly like the plain server;
- logprobs, top logprobs, token-id logprobs and input logprobs equal the plain server's within 1e-4 (native API,
  OpenAI completions and chat), also with a penalty; a sampled request's logprobs equal the target's
  temperature-scaled log-probabilities of its own tokens;
- greedy under regex / json_schema grammars equals the plain server and the text is valid; an open grammar on the
  looping prompt keeps drafts accepted, so the masks are computed along accepted chains;
- one concurrent batch holding every control at once (and free greedy / sampled rows): greedy rows equal, sampled
  rows with penalties inside the processed support of the penalised target;
- a custom logit processor is refused with HTTP 400 naming it (the plain server serves the same request).
Each group asserts that some verify step committed several tokens (the multi-token path ran).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import math
import re
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import (FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, check_all, check_greedy,  # noqa: E402
                      client, full_logprobs, generate, greedy, port, processed, wait_all_healthy, with_grammar)
from .models import random_prompts  # noqa: E402

PORT = 30007
MAX_TOKENS = 32
LOGPROB_TOL = 1e-4
EOS = 1  # the tiny tokenizer's <|endoftext|>
# Never the repetition penalty together with an additive one on one request: SGLang 0.5.17's exact (non-overlap)
# plain path applies its penalizers in the iteration order of a set of classes, a hash order that changes from one
# server process to the next, so which of the two comes first (and the result) varies between launches of the same
# plain server. Our worker always applies the additive penalties first, then the repetition scaling, the order of
# SGLang's overlap path.
PENALTIES = [{"frequency_penalty": 0.6}, {"presence_penalty": 0.8}, {"repetition_penalty": 1.3},
             {"frequency_penalty": 0.4, "presence_penalty": 0.3}]
# Penalties strong enough to change outputs also break the loops the drafter learned (its drafts follow the
# unpenalised target), so every verify commits 1 token. A tenth of each keeps the loop prompt's drafts accepted while
# the penalty is in force at every block row: that exercises the multi-token path with penalties, and its logprobs
# still move by >= 0.05 (500x the tolerance).
def weak(penalty: dict) -> dict:
    return {k: (1 + (v - 1) / 10 if k == "repetition_penalty" else v / 10) for k, v in penalty.items()}


WEAK = {"frequency_penalty": 0.05, "presence_penalty": 0.05}
WEAK_REP = {"repetition_penalty": 1.02}


@pytest.fixture(scope="module")
def servers(dflash_pair, baseline):
    """The shared baseline (conftest: xgrammar and custom logit processors on, --disable-overlap-schedule: SGLang's
    exact plain decoding with penalties; its overlap path is not: it feeds the penalizers req.output_ids[-1] while
    preparing a step, before the previous step's token is known, so every penalty lags one token and the first decode
    step penalises the last prompt token. Our worker is exact) and a DFLASH server with the same switches. The DFLASH
    server runs overlap scheduling (SGLang's default): the controls' state advances on the worker's stream, and the
    grammar matchers through SGLang's grammar barrier, while the scheduler already prepares the next step; it also
    chunks prefills (12 tokens)."""
    pytest.importorskip("xgrammar")
    root, target, draft, info = dflash_pair
    env = cpu_server_env(root / "stub")
    args = [a for a in with_grammar(CPU_SERVER_ARGS) if a != "--disable-overlap-schedule"]
    # chunked prefill too: prompts over 12 tokens are prefilled in pieces, and a request's penalty state must be
    # the one reset at its last chunk (earlier chunks' placeholder tokens are not output)
    args += FLOAT32 + SPEC_ARGS + ["--speculative-draft-model-path", str(draft), "--chunked-prefill-size", "12"]
    spec = launch_server(target, port(PORT), root / "spec_controls.log", args, {**env, **FULL_BLOCK})
    try:
        wait_all_healthy(baseline, spec)
        yield {"base": baseline, "spec": spec, "vocab": info["vocab"], "target": str(target)}
    finally:
        spec.stop()


def _prompts(vocab, n=6):
    # prompt 5 of this set drives the target into a loop the drafter knows (multi-token commits)
    return random_prompts(18, vocab, seed=7)[:n]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: "+".join(sorted(p)))
def test_greedy_with_penalty_equal(servers, penalty):
    base, spec = servers["base"], servers["spec"]
    prompts = _prompts(servers["vocab"])
    loop = prompts[5]
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS, penalty) for p in prompts]
        weak_f = pool.submit(greedy, spec, loop, MAX_TOKENS, weak(penalty))
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS, penalty) for p in prompts]
        free_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in prompts]
        spec_out, base_out, free = ([f.result() for f in fs] for fs in (spec_f, base_f, free_f))
        weak_out = weak_f.result()
    base_ids = [b["output_ids"] for b in base_out]
    assert any(b != f["output_ids"] for b, f in zip(base_ids, free)), \
        f"{penalty} changes no output of the plain server: the test could not see it ignored"
    check_all(base, prompts, base_ids, [s["output_ids"] for s in spec_out], MAX_TOKENS, max_excused_prompts=0,
              extra=penalty)
    w = weak(penalty)
    assert check_greedy(base, loop, greedy(base, loop, MAX_TOKENS, w)["output_ids"], weak_out["output_ids"],
                        MAX_TOKENS, w, max_excused=0) == 0
    assert_multi_token([weak_out["meta_info"]], f"the looping prompt with {w}")


def _stop_case(base, prompts, at=2):
    """(prompt, token) pairs where the plain greedy output's token at index `at` is new: used as a stop token, the
    free output stops there, and min_new_tokens must hold it back."""
    cases = []
    for p in prompts:
        out = greedy(base, p, MAX_TOKENS)["output_ids"]
        if len(out) > at and out[at] not in out[:at] and out[at] != EOS:
            cases.append((p, out[at]))
    assert cases, "no prompt has a fresh token to stop at"
    return cases


def test_min_tokens_holds_stop_tokens(servers):
    base, spec = servers["base"], servers["spec"]
    cases = _stop_case(base, _prompts(servers["vocab"], 10))[:4]
    m = 12
    for p, tok in cases:
        free = greedy(base, p, MAX_TOKENS, {"stop_token_ids": [tok]})["output_ids"]
        assert len(free) == 3 and free[-1] == tok, f"the stop token {tok} does not end the free output: {free}"
        extra = {"stop_token_ids": [tok], "min_new_tokens": m}
        b, s = greedy(base, p, MAX_TOKENS, extra), greedy(spec, p, MAX_TOKENS, extra)
        assert check_greedy(base, p, b["output_ids"], s["output_ids"], MAX_TOKENS, extra, max_excused=0) == 0
        out = s["output_ids"]
        assert len(out) >= m and tok not in out[:m - 1] and EOS not in out[:m - 1], (m, tok, out)
    # the OpenAI name of the control
    r = client(spec).completions.create(model=servers["target"], prompt=cases[0][0], max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"min_tokens": m, "stop_token_ids": [cases[0][1]],
                                                                   "return_token_ids": True})
    assert len(r.choices[0].token_ids) >= m


def _lp_body(prompt, extra=None, token_ids=True):
    # token_ids=False in batches mixing other requests: SGLang 0.5.17's prefill result processing fails on a batch
    # where only some requests ask for token-id logprobs (move_logprobs_to_cpu calls .tolist() on the [] rows),
    # with or without speculation
    body = {"input_ids": list(prompt), "return_logprob": True, "top_logprobs_num": 4, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, **(extra or {})}}
    if token_ids:
        body["token_ids_logprob"] = [5, 6, 7]
    return body


def _close(a, b, what):
    assert a is not None and b is not None and abs(a - b) <= LOGPROB_TOL, f"{what}: {a} vs {b}"


def _assert_logprobs_equal(spec_meta, base_meta, what):
    """Output (and input) logprobs of two answers with the same tokens: values within LOGPROB_TOL, same ids
    (top-logprob ids compared as sets of those clearly inside the top, a near-tie at the cut may swap)."""
    for key in ("output_token_logprobs", "input_token_logprobs"):
        s, b = spec_meta[key], base_meta[key]
        assert len(s) == len(b), f"{what} {key}: {len(s)} vs {len(b)} entries"
        for j, (x, y) in enumerate(zip(s, b)):
            assert x[1] == y[1], f"{what} {key}[{j}]: token {x[1]} vs {y[1]}"
            if y[0] is None:
                assert x[0] is None
                continue
            _close(x[0], y[0], f"{what} {key}[{j}] (token {x[1]})")
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert (key in spec_meta) == (key in base_meta), f"{what}: {key} in one answer only"
        if key not in base_meta:
            continue
        s, b = spec_meta[key], base_meta[key]
        assert len(s) == len(b), f"{what} {key}: {len(s)} vs {len(b)} rows"
        for j, (rs, rb) in enumerate(zip(s, b)):
            ds, db = {t: lp for lp, t, _ in rs}, {t: lp for lp, t, _ in rb}
            assert len(ds) == len(db), f"{what} {key}[{j}]: {len(ds)} vs {len(db)} entries"
            for t, lp in db.items():
                if t in ds:
                    _close(ds[t], lp, f"{what} {key}[{j}] token {t}")
                else:  # only a near-tie at the top-k cut may swap an id
                    assert abs(lp - min(db.values())) <= LOGPROB_TOL, f"{what} {key}[{j}]: token {t} missing"


@pytest.mark.parametrize("extra", [None, WEAK, WEAK_REP], ids=["plain", "additive", "repetition"])
def test_logprobs_equal_native(servers, extra):
    base, spec = servers["base"], servers["spec"]
    prompts = _prompts(servers["vocab"])
    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        spec_f = [pool.submit(generate, spec, _lp_body(p, extra)) for p in prompts]
        base_f = [pool.submit(generate, base, _lp_body(p, extra)) for p in prompts]
        spec_out, base_out = [f.result() for f in spec_f], [f.result() for f in base_f]
    for p, s, b in zip(prompts, spec_out, base_out):
        assert "output_ids" in s, s
        assert check_greedy(base, p, b["output_ids"], s["output_ids"], MAX_TOKENS, extra, max_excused=0) == 0
        _assert_logprobs_equal(s["meta_info"], b["meta_info"], f"prompt {p}")
        assert len(s["meta_info"]["output_token_logprobs"]) == len(s["output_ids"])
    assert_multi_token([s["meta_info"] for s in spec_out], "greedy requests with logprobs")


def test_logprobs_equal_openai(servers):
    base, spec, model = servers["base"], servers["spec"], servers["target"]
    prompt = _prompts(servers["vocab"])[5]
    kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    s, b = client(spec).completions.create(**kw).choices[0], client(base).completions.create(**kw).choices[0]
    assert s.text == b.text
    for j, (x, y) in enumerate(zip(s.logprobs.token_logprobs, b.logprobs.token_logprobs, strict=True)):
        _close(x, y, f"completions token_logprobs[{j}]")
    for j, (x, y) in enumerate(zip(s.logprobs.top_logprobs, b.logprobs.top_logprobs, strict=True)):
        for t, lp in y.items():
            _close(x.get(t), lp, f"completions top_logprobs[{j}][{t!r}]")
    msgs = [{"role": "user", "content": "def forward(self, x):"}]
    kw = dict(model=model, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3)
    s, b = client(spec).chat.completions.create(**kw).choices[0], client(base).chat.completions.create(**kw).choices[0]
    assert s.message.content == b.message.content
    for j, (x, y) in enumerate(zip(s.logprobs.content, b.logprobs.content, strict=True)):
        assert x.token == y.token
        _close(x.logprob, y.logprob, f"chat logprob[{j}]")
        # keyed by the token's bytes too: distinct tokens can render as the same text (two byte tokens both
        # print as U+FFFD), which would collide in a text-keyed dict
        top_s = {(t.token, tuple(t.bytes or ())): t.logprob for t in x.top_logprobs}
        for t in y.top_logprobs:
            _close(top_s.get((t.token, tuple(t.bytes or ()))), t.logprob, f"chat top_logprobs[{j}][{t.token!r}]")


def _temperature_logprobs(lps: dict[int, float], temperature: float) -> dict[int, float]:
    scaled = {t: lp / temperature for t, lp in lps.items()}
    top = max(scaled.values())
    z = top + math.log(sum(math.exp(v - top) for v in scaled.values()))
    return {t: v - z for t, v in scaled.items()}


def test_sampled_logprobs_are_the_targets(servers):
    """A sampled request's reported logprob of each of its tokens is the target's log-probability of that token at
    temperature T given the request's own text (from the plain server's full-vocabulary logprobs)."""
    base, spec, vocab = servers["base"], servers["spec"], servers["vocab"]
    # the looping prompt at a low temperature: the samples mostly follow the loop, so drafts get accepted
    prompt, t = _prompts(vocab)[5], 0.4
    bodies = [{"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {
        "max_new_tokens": 24, "temperature": t, "sampling_seed": seed}} for seed in range(4)]
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(lambda b: generate(spec, b), bodies))
    for out in outs:
        toks = out["output_ids"]
        meta = out["meta_info"]
        rows = full_logprobs(base, prompt, toks, vocab)
        for j, ((lp, tok, _), full) in enumerate(zip(meta["output_token_logprobs"], rows, strict=True)):
            assert tok == toks[j]
            want = _temperature_logprobs(full, t)
            _close(lp, want[tok], f"sampled token {j} ({tok})")
            for top_lp, top_tok, _ in meta["output_top_logprobs"][j]:
                _close(top_lp, want[top_tok], f"top logprob of {top_tok} at sampled position {j}")
    assert_multi_token([o["meta_info"] for o in outs], "the sampled requests")


SAMPLED_PEN = {"temperature": 0.8, "top_k": 3, "frequency_penalty": 0.7, "presence_penalty": 0.4}


def _assert_penalised_support(base, prompt, tokens, vocab, sp):
    """Every sampled token lies inside the top-k support of the penalised, temperature-scaled target (frequency
    and presence penalties are additive, so they apply to logprobs as to logits)."""
    counts = collections.Counter()
    for k, (tok, lps) in enumerate(zip(tokens, full_logprobs(base, prompt, tokens, vocab))):
        bias = {t: -(sp["frequency_penalty"] * c + sp["presence_penalty"]) for t, c in counts.items()}
        support = processed(lps, sp["temperature"], top_k=sp["top_k"], bias=bias)
        assert tok in support, f"token {tok} at output position {k} is outside the penalised top-{sp['top_k']}"
        counts[tok] += 1


def test_mixed_batch_with_every_control(servers):
    base, spec, vocab = servers["base"], servers["spec"], servers["vocab"]
    prompts = random_prompts(8, vocab, seed=51) + [_prompts(vocab)[5]]
    stop_p, stop_tok = _stop_case(base, prompts)[0]
    loop, open_regex = _open_regex(servers)
    greedy_rows = [(prompts[0], None), (prompts[1], {"frequency_penalty": 0.6}),
                   (prompts[2], {"presence_penalty": 0.8}), (prompts[3], {"repetition_penalty": 1.3}),
                   (stop_p, {"stop_token_ids": [stop_tok], "min_new_tokens": 10}),
                   (prompts[4], {"logit_bias": {"77": 4.0, "301": 3.0}, "frequency_penalty": 0.3}),
                   (prompts[8], weak({"repetition_penalty": 1.3})), (prompts[8], None),
                   (prompts[0], {"regex": CLOSED, "presence_penalty": 0.3}), (loop, {"regex": open_regex})]
    with cf.ThreadPoolExecutor(max_workers=24) as pool:
        samp_f = [pool.submit(generate, spec, {"input_ids": prompts[5 + i], "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "sampling_seed": 10 + i, **SAMPLED_PEN}}) for i in range(2)]
        free_f = pool.submit(generate, spec, {"input_ids": prompts[7], "sampling_params": {
            "max_new_tokens": MAX_TOKENS, "temperature": 0.9, "sampling_seed": 3}})
        lp_f = pool.submit(generate, spec, _lp_body(prompts[8], WEAK, token_ids=False))
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS, x) for p, x in greedy_rows]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS, x) for p, x in greedy_rows]
        base_lp = pool.submit(generate, base, _lp_body(prompts[8], WEAK, token_ids=False))
        samp, spec_out, base_out = ([f.result() for f in fs] for fs in (samp_f, spec_f, base_f))
        free, lp, blp = free_f.result(), lp_f.result(), base_lp.result()
    for (p, x), s, b in zip(greedy_rows, spec_out, base_out):
        assert check_greedy(base, p, b["output_ids"], s["output_ids"], MAX_TOKENS, x, max_excused=0) == 0
    assert stop_tok not in spec_out[4]["output_ids"][:9] and len(spec_out[4]["output_ids"]) >= 10
    assert lp["output_ids"] == blp["output_ids"]
    _assert_logprobs_equal(lp["meta_info"], blp["meta_info"], "the logprob row of the mixed batch")
    for i, r in enumerate(samp):
        assert "output_ids" in r, r
        _assert_penalised_support(base, prompts[5 + i], r["output_ids"], vocab, SAMPLED_PEN)
    assert "output_ids" in free and free["output_ids"], free
    assert_multi_token([s["meta_info"] for s in spec_out], "greedy rows of the mixed batch")


# A closed grammar (it must end within the budget, so the finished text is checked in full) and an open one built
# from the looping prompt's own tokens: the target's unconstrained greedy continuation stays allowed, so the
# drafter's drafts keep being accepted and the grammar masks are computed along accepted chains (multi-token).
CLOSED = r"(yes|no|maybe)( (yes|no|maybe)){0,5}\."
EBNF = 'root ::= "{\\"ok\\": " ("true" | "false") "}"'


def _open_regex(servers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(servers["target"])
    loop = _prompts(servers["vocab"])[5]
    free = greedy(servers["base"], loop, MAX_TOKENS)["output_ids"]
    pieces = sorted({tok.decode([t]) for t in free} - {""}, key=len, reverse=True)
    return loop, "(" + "|".join(re.escape(p) for p in pieces) + ")*"


def _capped(open_regex: str, n: int = 10) -> str:
    """The open grammar ended after n pieces: rows past the cap allow only the end, so a verify that masked every
    row with the bonus's state would keep the drafter's loop going past it."""
    return open_regex[:-1] + "{0,%d}" % n


def test_grammar_greedy_equal_and_valid(servers):
    base, spec = servers["base"], servers["spec"]
    loop, open_regex = _open_regex(servers)
    rows = [(p, {"regex": CLOSED}) for p in _prompts(servers["vocab"], 4)]
    rows += [(loop, {"regex": open_regex}), (rows[1][0], {"ebnf": EBNF}), (loop, {"regex": _capped(open_regex)}),
             # JSON lets whitespace run on, and this random target fills the budget with it: equality only
             (loop, {"json_schema": '{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                                    '"required": ["ok"], "additionalProperties": false}'})]
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS, x) for p, x in rows]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS, x) for p, x in rows]
        spec_out, base_out = [f.result() for f in spec_f], [f.result() for f in base_f]
    for (p, x), s, b in zip(rows, spec_out, base_out):
        assert check_greedy(base, p, b["output_ids"], s["output_ids"], MAX_TOKENS, x, max_excused=0) == 0
        assert s["text"] == b["text"]
    for s in spec_out[:4]:
        assert s["meta_info"]["finish_reason"]["type"] == "stop", s["meta_info"]["finish_reason"]
        assert re.fullmatch(CLOSED, s["text"]), f"{s['text']!r} does not match {CLOSED}"
    assert re.fullmatch(open_regex, spec_out[4]["text"])
    assert spec_out[5]["meta_info"]["finish_reason"]["type"] == "stop"
    assert json.loads(spec_out[5]["text"]).keys() == {"ok"}
    free = greedy(base, rows[0][0], MAX_TOKENS)["output_ids"]
    assert free != base_out[0]["output_ids"], "the grammar changes nothing: the test could not see it ignored"
    assert_multi_token([spec_out[4]["meta_info"]], "the open grammar on the looping prompt")
    capped = spec_out[6]
    assert capped["meta_info"]["finish_reason"]["type"] == "stop" and len(capped["output_ids"]) < MAX_TOKENS, \
        f"the capped grammar did not end the looping output: {capped['meta_info']['finish_reason']}"
    assert_multi_token([capped["meta_info"]], "the capped grammar on the looping prompt")


def test_custom_logit_processor_refused(servers):
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    spec, base = servers["spec"], servers["base"]
    body = {"input_ids": [5, 6, 7], "custom_logit_processor": DisallowedTokensLogitsProcessor().to_str(),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                "custom_params": {"token_ids": [8, 9]}}}
    r = generate(spec, body)
    assert r.get("status") == 400 and "custom_logit_processor" in r["error"] \
        and "not supported with --speculative-algorithm DFLASH" in r["error"], r
    assert "output_ids" in generate(base, body), "the plain server should serve the same request"
    assert spec.alive()
