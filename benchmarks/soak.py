"""Soak: a mixed load against a running server for a fixed time, proving nothing is lost (issue #37).

    python -m benchmarks.soak --url http://127.0.0.1:30000 --baseline-url http://127.0.0.1:30001 \\
        --duration-s 300 --concurrency 128 --prompts prompts.json --out soak.json

For --duration-s, `--concurrency` clients each send their next request as soon as the last one ended, drawn from a
seeded mix (`Mix`): greedy and seeded sampled requests, max_new_tokens 1..--max-new-tokens (log-uniform, a tenth
exactly 1), stop strings and stop token ids (drawn from earlier outputs, so they occur), prompts near the server's
input limit, shared prefixes (radix hits), penalties, logprobs, a regex grammar (when the server has a grammar
backend), the OpenAI completions and chat APIs, streams the client drops mid-way, and aborts (/abort_request) during
prefill and during decode. Beside them `--stall-clients` clients open a stream and never read it for --stall-s.
/health and the KV pool (/v1/loads: tokens in use, running and waiting requests) are polled all along.

Then: the pool must return to its idle size (no request running or waiting, tokens in use back to the start's), the
server must answer a real one-token generate (/health_generate), and every greedy answer is replayed on the plain
server (--baseline-url) and judged by `sglang_dflash.testing.greedy_check` (identical, or a near-tie of the plain
server under --tie-tol, then identical after it); every divergence is reported with the plain server's top-2 gap
there. Requests with penalties, stop conditions or a grammar, and the OpenAI ones, must be identical (a tie cannot be
replayed through their state); logprob answers also within --logprob-tol.

Prompt + output stay --reserve tokens under the server's input limit: SGLang reserves 2 B KV slots beyond a
speculative request's length for its next step (B = speculative_num_draft_tokens), so on a KV pool smaller than the
context length + 2 B a request that close to the limit is aborted ("Out of memory even after retracting all other
requests", HTTP 500) where plain decoding serves it. GPU pools exceed the context length by far; the CPU soak's
320-token pool does not (seen there, and why the default reserve is 2 B).

The report (JSON, --out; a summary on stdout): requests and tokens by kind, latency percentiles, mismatches (each
with the plain top-2 gap), errors by kind with examples, faults, health, the pool over time, memory at start and end
(the server's KV numbers, its process group's RSS with --server-pid, GPU memory where nvidia-smi exists), and with
--reference-report (the same soak against the plain server) the requests slower than 2x its p99. `ok` is true when
nothing failed; the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import datetime
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.stats import percentile

from .client import sse_chunks
from sglang_dflash.testing.greedy_check import Divergence, first_diff, judge_greedy

# kind -> weight of the default mix (a kind the server cannot serve, e.g. grammar without a backend, is dropped)
WEIGHTS = {"greedy": 24, "greedy_stream": 8, "prefix": 10, "long": 4, "stop": 8, "penalty": 6, "logprob": 6,
           "grammar": 4, "sampled": 10, "completion": 5, "chat": 4, "disconnect": 4, "abort_prefill": 2,
           "abort_decode": 3}
TIE_KINDS = {"greedy", "greedy_stream", "prefix", "long"}  # plain greedy: a near-tie may be excused and replayed
EXACT_KINDS = {"stop", "penalty", "logprob", "grammar", "completion", "chat"}  # greedy with state: identical
FAULT_KINDS = {"disconnect", "abort_prefill", "abort_decode"}
TOKENIZER_KINDS = {"completion", "chat"}  # the OpenAI APIs: a server started with --skip-tokenizer-init refuses them
# never the repetition penalty together with an additive one: SGLang 0.5.17's plain path orders them by a hash
# that changes between processes (tests/serving/test_controls_cpu.py)
PENALTIES = [{"frequency_penalty": 0.5}, {"presence_penalty": 0.6}, {"repetition_penalty": 1.2},
             {"frequency_penalty": 0.3, "presence_penalty": 0.3}]
REGEX = r"(yes|no|maybe)[a-z ,.]{0,40}"
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.02}


# ------------------------------------------------------------------------------------------------ the request mix
class Mix:
    """Request specs from a seeded random stream: {kind, api, body, stream, fault}. `remember` feeds finished
    greedy outputs back (stop strings and stop ids are drawn from them, so they occur)."""

    def __init__(self, prompts: list[list[int]], vocab: int, max_new: int, input_limit: int, grammar: bool,
                 model: str, weights: dict[str, float] | None = None, seed: int = 0, tokenizer: bool = True):
        self.prompts, self.vocab, self.max_new, self.limit, self.model = prompts, vocab, max_new, input_limit, model
        w = dict(WEIGHTS if weights is None else weights)
        if not grammar:
            w.pop("grammar", None)
        if not tokenizer:  # --skip-tokenizer-init (random-weight shapes): the OpenAI APIs need a tokenizer
            for kind in TOKENIZER_KINDS:
                w.pop(kind, None)
        self.kinds, self.weights = zip(*[(k, v) for k, v in w.items() if v > 0])
        rng = random.Random(seed)
        # shared prefixes: a radix hit for every request built on one after the first
        n = max(8, min(256, input_limit // 3))
        self.prefixes = [self._tokens(rng, n) for _ in range(4)]
        self.texts: list[str] = []
        self.ids: list[int] = []

    def _tokens(self, rng, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(self.prompts) if self.prompts else [rng.randrange(5, self.vocab) for _ in range(16)]
        return out[:n]

    def _max_new(self, rng, prompt_len: int) -> int:
        n = 1 if rng.random() < 0.1 else int(math.exp(rng.uniform(0, math.log(self.max_new))))
        return max(1, min(n, self.max_new, self.limit - prompt_len))

    def remember(self, rec: dict) -> None:
        if rec.get("text"):
            self.texts = (self.texts + [rec["text"]])[-64:]
        self.ids = (self.ids + list(rec.get("output_ids") or [])[:8])[-256:]

    def next(self, rng: random.Random) -> dict:
        kind = rng.choices(self.kinds, self.weights)[0]
        prompt = rng.choice(self.prompts) if self.prompts else self._tokens(rng, rng.randrange(4, 64))
        prompt = list(prompt[: self.limit - 1])
        if kind == "prefix":
            prompt = rng.choice(self.prefixes) + self._tokens(rng, rng.randrange(1, 24))
        elif kind in ("long", "abort_prefill"):
            prompt = self._tokens(rng, self.limit - rng.randrange(2, 34))
        prompt = prompt[: self.limit - 1]
        sp: dict[str, Any] = {"temperature": 0, "max_new_tokens": self._max_new(rng, len(prompt)),
                              "ignore_eos": rng.random() < 0.5}
        spec = {"kind": kind, "api": "generate", "stream": kind == "greedy_stream", "fault": None}
        if kind == "stop" and self.texts:
            if rng.random() < 0.5:
                t = rng.choice(self.texts)
                i = rng.randrange(len(t))
                sp["stop"] = [t[i:i + rng.randrange(1, 4)]]
            else:
                sp["stop_token_ids"] = [rng.choice(self.ids)]
        elif kind == "penalty":
            sp.update(rng.choice(PENALTIES))
        elif kind == "grammar":
            sp.update(regex=REGEX, ignore_eos=False)
        elif kind == "sampled":
            sp.update(SAMPLED, sampling_seed=rng.randrange(1 << 30))
            spec["stream"] = rng.random() < 0.5
        elif kind in FAULT_KINDS:
            sp.update(max_new_tokens=max(sp["max_new_tokens"], min(self.max_new, self.limit - len(prompt))),
                      ignore_eos=True)
            spec.update(stream=True, fault=kind, chunks=rng.randrange(1, 4))
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": sp}
        if kind == "logprob":
            body.update(return_logprob=True, top_logprobs_num=2)
        if kind == "completion":
            spec["api"] = "completions"
            body = {"model": self.model, "prompt": prompt, "max_tokens": sp["max_new_tokens"], "temperature": 0,
                    "return_token_ids": True}
        elif kind == "chat":
            spec["api"] = "chat"
            text = rng.choice(self.texts) if self.texts else "Say something."
            body = {"model": self.model, "messages": [{"role": "user", "content": text[:400]}],
                    "max_tokens": sp["max_new_tokens"], "temperature": 0, "return_token_ids": True,
                    "return_prompt_token_ids": True}
        spec["body"] = body
        return spec


# ------------------------------------------------------------------------------------------------------ one request
def _record(spec: dict) -> dict:
    return {"kind": spec["kind"], "api": spec["api"], "fault": spec["fault"], "body": spec["body"],
            "t_start": time.perf_counter(), "t_first": None, "t_end": None, "error": None, "error_kind": None,
            "output_ids": [], "text": "", "finish": None, "meta": {}, "chunks": 0, "aborted_at": None}


def _fail(rec: dict, kind: str, detail: str) -> dict:
    rec["error_kind"], rec["error"] = kind, detail[:400]
    return rec


async def _native(session, url: str, spec: dict, timeout_s: float) -> dict:
    """One /generate request, streamed or not, with its fault (drop the stream, abort in prefill or decode)."""
    rec = _record(spec)
    rec["rid"] = uuid.uuid4().hex  # the server's request id (its log names it; aborts send it)
    body = dict(spec["body"], stream=spec["stream"], rid=rec["rid"])
    last = None
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return _fail(rec, f"HTTP {r.status}", await r.text())
            if spec["fault"] == "abort_prefill":
                rec["aborted_at"] = "prefill"
                await _abort(session, url, rec["rid"])
            if not spec["stream"]:
                last = orjson.loads(await r.read())
            else:
                async for chunk in sse_chunks(r):
                    if "error" in chunk:
                        return _fail(rec, "stream error", str(chunk["error"]))
                    rec["chunks"] += 1
                    rec["t_first"] = rec["t_first"] or time.perf_counter()
                    last = chunk
                    if spec["fault"] == "disconnect" and rec["chunks"] >= spec["chunks"]:
                        r.close()  # the client goes away mid-stream; the server must abort and free the request
                        rec["t_end"] = time.perf_counter()
                        return rec
                    if spec["fault"] == "abort_decode" and rec["chunks"] == spec["chunks"]:
                        rec["aborted_at"] = "decode"
                        await _abort(session, url, rec["rid"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return _fail(rec, type(e).__name__, str(e))
    finally:
        rec["t_end"] = rec["t_end"] or time.perf_counter()
    if last is None:
        return _fail(rec, "no result", "the answer held no output")
    meta = last.get("meta_info", {})
    fr = meta.get("finish_reason")
    rec.update(output_ids=list(last.get("output_ids") or []), text=last.get("text") or "", meta=meta,
               finish=fr.get("type") if isinstance(fr, dict) else fr)
    return rec


async def _abort(session, url: str, rid: str) -> None:
    async with session.post(url + "/abort_request", json={"rid": rid}) as r:
        if r.status != 200:
            raise aiohttp.ClientError(f"/abort_request answered HTTP {r.status}")


async def _openai(session, url: str, spec: dict, timeout_s: float) -> dict:
    rec = _record(spec)
    path = "/v1/completions" if spec["api"] == "completions" else "/v1/chat/completions"
    try:
        async with session.post(url + path, json=spec["body"], timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            data = await r.read()
            if r.status != 200:
                return _fail(rec, f"HTTP {r.status}", data.decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _fail(rec, type(e).__name__, str(e))
    finally:
        rec["t_end"] = time.perf_counter()
    rec.update(_openai_answer(orjson.loads(data)))
    return rec


def _openai_answer(data: dict) -> dict:
    c = data["choices"][0]
    text = c.get("text") if "text" in c else (c.get("message") or {}).get("content") or ""
    usage = data.get("usage") or {}
    return {"output_ids": list(c.get("token_ids") or []), "text": text, "finish": c.get("finish_reason"),
            "prompt_ids": c.get("prompt_token_ids"), "meta": {"completion_tokens": usage.get("completion_tokens")}}


def check_answer(rec: dict, vocab: int) -> dict:
    """Marks a finished answer that breaks its own request: more tokens than asked, ids outside the vocabulary, an
    empty answer that was neither aborted nor dropped, a grammar answer its regex does not match, missing logprobs."""
    if rec["error"] or rec["fault"] == "disconnect":
        return rec
    body = rec["body"]
    sp = body.get("sampling_params", {})
    asked = sp.get("max_new_tokens", body.get("max_tokens"))
    ids = rec["output_ids"]
    if rec["finish"] == "abort":
        return rec if rec["fault"] else _fail(rec, "aborted", f"an unaborted request finished 'abort': {rec['meta']}")
    if len(ids) > asked:
        return _fail(rec, "too long", f"{len(ids)} tokens for max_new_tokens {asked}")
    if any(not 0 <= t < vocab for t in ids):
        return _fail(rec, "bad token", f"ids outside [0, {vocab}): {[t for t in ids if not 0 <= t < vocab][:5]}")
    if not ids and rec["api"] == "generate":
        return _fail(rec, "empty", f"no output token, finish {rec['finish']}")
    if sp.get("regex") and rec["finish"] == "stop" and not re.fullmatch(sp["regex"], rec["text"]):
        return _fail(rec, "grammar", f"{rec['text']!r} does not match {sp['regex']!r}")
    if body.get("return_logprob") and len(rec["meta"].get("output_token_logprobs") or []) != len(ids):
        return _fail(rec, "logprobs", f"{len(rec['meta'].get('output_token_logprobs') or [])} logprobs for "
                                      f"{len(ids)} tokens")
    return rec


# ---------------------------------------------------------------------------------------------------- the load phase
def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return orjson.loads(r.read())


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return orjson.loads(r.read())


def pool(url: str) -> dict | None:
    """KV pool and queue numbers now: SGLang's /v1/loads (0.5.17: tokens in use exclude what only the radix cache
    holds, so an idle server reads 0), the older /get_load otherwise; None when neither answers."""
    try:
        load = get_json(url + "/v1/loads?include=core,memory,queues")["loads"][0]
        return {k: load.get(k) for k in ("num_used_tokens", "num_running_reqs", "num_waiting_reqs", "token_usage",
                                         "max_total_num_tokens", "memory", "queues")}
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    try:
        load = get_json(url + "/get_load")[0]
        return {"num_used_tokens": load["num_tokens"] - load["num_pending_tokens"], "num_running_reqs":
                load["num_reqs"] - load["num_waiting_reqs"], "num_waiting_reqs": load["num_waiting_reqs"]}
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def memory(server_pid: int | None) -> dict:
    """The server's resident memory (its process tree, `testing.server.process_tree`) and the GPUs' used memory,
    where they can be read."""
    import psutil

    from sglang_dflash.testing.server import process_tree

    out: dict[str, Any] = {}
    if server_pid:
        rss, n = 0, 0
        for pid in process_tree(server_pid):
            try:
                rss += psutil.Process(pid).memory_info().rss
                n += 1
            except psutil.Error:
                continue
        out.update(rss_mb=round(rss / 2**20, 1), processes=n)
    if shutil.which("nvidia-smi"):
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20).stdout.split()
            out["gpu_used_mb"] = [int(x) for x in used]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    return out


async def _poll(url: str, until: asyncio.Event, every_s: float, health: list, pools: list, t0: float) -> None:
    loop = asyncio.get_running_loop()
    while not until.is_set():
        t = round(time.perf_counter() - t0, 2)
        # SGLang's /health answers 503 when nothing came out of the scheduler for 20 s (HEALTH_CHECK_TIMEOUT): wait
        # longer than that, so a failure here is the server's own verdict (a stall, or a dead scheduler)
        ok, p = await asyncio.gather(loop.run_in_executor(None, _healthy, url, "/health", 30.0),
                                     loop.run_in_executor(None, pool, url))
        health.append((t, ok))
        if p is not None:
            pools.append((t, p.get("num_used_tokens"), p.get("num_running_reqs"), p.get("num_waiting_reqs")))
        try:
            await asyncio.wait_for(until.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def _healthy(url: str, path: str = "/health", timeout_s: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


async def _stall(url: str, body: dict, hold_s: float, until: asyncio.Event, stalls: list) -> None:
    """A client that opens a stream and never reads it for hold_s, then hangs up; again until the soak ends."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    payload = json.dumps(dict(body, stream=True)).encode()
    while not until.is_set():
        t = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload))
            await writer.drain()
            try:
                await asyncio.wait_for(until.wait(), hold_s)
            except asyncio.TimeoutError:
                pass
            writer.close()
            stalls.append({"held_s": round(time.perf_counter() - t, 1), "error": None})
        except OSError as e:
            stalls.append({"held_s": round(time.perf_counter() - t, 1), "error": f"{type(e).__name__}: {e}"})
            await asyncio.sleep(1.0)


async def load(url: str, mix: Mix, duration_s: float, concurrency: int, seed: int, timeout_s: float,
               stall_clients: int = 0, stall_s: float = 10.0, poll_s: float = 1.0) -> dict:
    """The load phase: records of every request, health and pool samples, the stall clients' sessions."""
    records: list[dict] = []
    health: list = []
    pools: list = []
    stalls: list = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    done = asyncio.Event()

    async def client(session, i: int):
        rng = random.Random(seed * 1_000_003 + i)
        while time.perf_counter() < deadline:
            spec = mix.next(rng)
            run = _native if spec["api"] == "generate" else _openai
            rec = check_answer(await run(session, url, spec, timeout_s), mix.vocab)
            rec["t_start"] -= t0
            rec["t_end"] -= t0
            rec["t_first"] = rec["t_first"] - t0 if rec["t_first"] else None
            records.append(rec)
            if not rec["error"] and spec["kind"] in TIE_KINDS:
                mix.remember(rec)

    stall_body = {"input_ids": mix.prefixes[0], "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                                    "max_new_tokens": max(1, min(
                                                                        mix.max_new, mix.limit - len(mix.prefixes[0])))}}
    # a new connection per request: a pooled keep-alive connection that the server closes while idle (uvicorn: after
    # 5 s) fails the next request sent on it ("Server disconnected"), a client artefact, not a server fault
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        poller = asyncio.create_task(_poll(url, done, poll_s, health, pools, t0))
        stallers = [asyncio.create_task(_stall(url, stall_body, stall_s, done, stalls)) for _ in range(stall_clients)]
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
        done.set()
        await asyncio.gather(poller, *stallers)
    return {"records": records, "health": health, "pools": pools, "stalls": stalls,
            "wall_s": time.perf_counter() - t0}


def wait_idle(url: str, used_at_start: int, timeout_s: float) -> tuple[bool, dict | None, float]:
    """Poll until no request runs or waits and the tokens in use are back to the start's; (idle, last, seconds)."""
    t0, last = time.perf_counter(), None
    while time.perf_counter() - t0 < timeout_s:
        last = pool(url)
        if last is not None and not last["num_running_reqs"] and not last["num_waiting_reqs"] and \
                (last["num_used_tokens"] or 0) <= used_at_start:
            return True, last, time.perf_counter() - t0
        time.sleep(0.5)
    return False, last, time.perf_counter() - t0


# -------------------------------------------------------------------------------------------------- the comparison
def replay_body(rec: dict) -> dict:
    body = {k: v for k, v in rec["body"].items() if k not in ("stream", "rid")}
    return body


class Baseline:
    """The plain server: the same request again, its top-2 after a context, its greedy continuation."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url, self.timeout_s = url, timeout_s

    def answer(self, rec: dict) -> dict:
        if rec["api"] == "generate":
            r = post_json(self.url + "/generate", replay_body(rec), self.timeout_s)
            fr = r["meta_info"].get("finish_reason")
            return {"output_ids": r["output_ids"], "text": r.get("text") or "", "meta": r["meta_info"],
                    "finish": fr.get("type") if isinstance(fr, dict) else fr}
        path = "/v1/completions" if rec["api"] == "completions" else "/v1/chat/completions"
        return _openai_answer(post_json(self.url + path, rec["body"], self.timeout_s))

    def top2(self, ids: list[int], k: int = 2) -> list[tuple[float, int]]:
        """The plain server's k best (logprob, token) after ids (2: the near-tie rule's pair)."""
        meta = post_json(self.url + "/generate", {"input_ids": list(ids), "return_logprob": True,
                                                   "top_logprobs_num": k, "sampling_params": {
                                                       "max_new_tokens": 1, "temperature": 0}})["meta_info"]
        return [(lp, tok) for lp, tok, _ in sorted(meta["output_top_logprobs"][0], reverse=True)[:k]]

    def continue_greedy(self, ids: list[int], n: int, extra: dict) -> list[int]:
        return post_json(self.url + "/generate", {"input_ids": list(ids), "sampling_params": {
            "max_new_tokens": n, "temperature": 0, **extra}})["output_ids"]


def _prompt_ids(rec: dict) -> list[int] | None:
    if rec["api"] == "chat":
        return rec.get("prompt_ids")
    return list(rec["body"]["input_ids"] if rec["api"] == "generate" else rec["body"]["prompt"])


def judge(base: Baseline, rec: dict, tie_tol: float, logprob_tol: float) -> dict | None:
    """None if the answer equals the plain server's; else the mismatch: kind, where, the plain top-2 gap there,
    excused (a near-tie of a plain greedy request whose rest then matched) or not."""
    b = base.answer(rec)
    spec_ids, base_ids = rec["output_ids"], b["output_ids"]
    out = {"kind": rec["kind"], "api": rec["api"], "prompt_len": len(_prompt_ids(rec) or []),
           "max_new": rec["body"].get("sampling_params", {}).get("max_new_tokens", rec["body"].get("max_tokens")),
           "request": replay_body(rec), "rid": rec.get("rid"), "retractions": rec["meta"].get("num_retractions")}
    if spec_ids == base_ids and rec["text"] == b["text"]:
        if rec["body"].get("return_logprob"):
            worst, where = _logprob_diff(rec["meta"], b["meta"])
            if worst > logprob_tol:
                return dict(out, what="logprobs", max_diff=worst, where=where, excused=False)
        return None
    prompt = _prompt_ids(rec)
    i = first_diff(base_ids, spec_ids)
    if i is None:  # same ids, other text (a detokenizer difference)
        return dict(out, what="text", spec_text=rec["text"][:200], base_text=b["text"][:200], excused=False)
    if rec["kind"] in TIE_KINDS:
        extra = {"ignore_eos": True} if rec["body"]["sampling_params"].get("ignore_eos") else {}
        v = judge_greedy(prompt, base_ids, spec_ids, out["max_new"], base.top2,
                         lambda ids, n: base.continue_greedy(ids, n, extra), tie_tol, max_excused=3)
        d = v.failed or (v.excused[0] if v.excused else None)
        return dict(out, what="tokens", excused=v.failure is None, failure=(v.failure or "")[-300:] or None,
                    **(d.as_dict() if d else {"position": i}))
    d = None
    if prompt is not None and i < min(len(base_ids), len(spec_ids)):
        d = Divergence(i, base_ids[i], spec_ids[i], tuple(base.top2(prompt + base_ids[:i])))
    return dict(out, what="tokens", excused=False, lengths=[len(base_ids), len(spec_ids)],
                **(d.as_dict() if d else {"position": i}))


def _logprob_diff(a: dict, b: dict) -> tuple[float, dict | None]:
    """The largest logprob difference between two answers with the same output ids, and where it is.
    output_token_logprobs: the committed token's logprob at each position (same token on both sides). The top-k lists
    are compared rank by rank on their values: two tokens whose logprobs are within the tolerance may trade ranks (a
    near-tie of the distribution, as bf16 rounding at another batch shape swaps them for plain decoding too: on the
    random-weight GPU targets the second place is a near-tie of Gaussian logits every ~20 tokens), so a rank held by
    another token counts by its value, and the report says where."""
    worst, where = 0.0, None
    for key in ("output_token_logprobs", "output_top_logprobs"):
        for pos, (x, y) in enumerate(zip(a.get(key) or [], b.get(key) or [])):
            xs, ys = (x, y) if key == "output_top_logprobs" else ([x], [y])
            if len(xs or []) != len(ys or []):
                return math.inf, {"key": key, "position": pos, "spec": xs, "base": ys}
            for rank, ((lx, tx, *_), (ly, ty, *_)) in enumerate(zip(xs or [], ys or [])):
                diff = math.inf if (tx != ty and key == "output_token_logprobs") else abs(lx - ly)
                if diff > worst:
                    worst, where = diff, {"key": key, "position": pos, "rank": rank, "spec": [lx, tx], "base": [ly, ty]}
    return worst, where


def compare(baseline_url: str, records: list[dict], tie_tol: float, logprob_tol: float, workers: int) -> dict:
    """Every finished greedy answer against the plain server's answer to the same request."""
    base = Baseline(baseline_url)
    todo = [r for r in records if not r["error"] and r["kind"] in TIE_KINDS | EXACT_KINDS and r["finish"] != "abort"]
    mismatches, errors = [], []
    with cf.ThreadPoolExecutor(workers) as pool_:
        for rec, fut in [(r, pool_.submit(judge, base, r, tie_tol, logprob_tol)) for r in todo]:
            try:
                m = fut.result()
            except (OSError, ValueError, KeyError) as e:
                errors.append(f"{rec['kind']}: {type(e).__name__}: {e}"[:300])
                continue
            if m is not None:
                mismatches.append(m)
    return {"compared": len(todo), "mismatches": mismatches, "errors": errors}


# -------------------------------------------------------------------------------------------------------- the report
def summarize(phase: dict, comparison: dict | None, idle: tuple, final_ok: bool, mem: dict, start_pool: dict | None,
              reference: dict | None = None) -> dict:
    recs = phase["records"]
    by_kind: dict[str, dict] = {}
    for r in recs:
        k = by_kind.setdefault(r["kind"], {"requests": 0, "errors": 0, "tokens": 0, "latencies": []})
        k["requests"] += 1
        k["errors"] += bool(r["error"])
        k["tokens"] += len(r["output_ids"])
        if not r["error"] and not r["fault"]:
            k["latencies"].append(r["t_end"] - r["t_start"])
    for k in by_kind.values():
        lat = k.pop("latencies")
        k.update(p50_s=percentile(lat, 50), p99_s=percentile(lat, 99), max_s=max(lat) if lat else None)
    errors: dict[str, int] = {}
    examples: list[dict] = []
    for r in recs:
        if r["error"]:
            errors[r["error_kind"]] = errors.get(r["error_kind"], 0) + 1
            if errors[r["error_kind"]] <= 3:  # a few of each kind, with the request to replay
                examples.append({"kind": r["kind"], "error_kind": r["error_kind"], "error": r["error"],
                                 "rid": r.get("rid"), "retractions": r["meta"].get("num_retractions"),
                                 "request": replay_body(r)})
    latencies = [r["t_end"] - r["t_start"] for r in recs if not r["error"] and not r["fault"]]
    ttft = [r["t_first"] - r["t_start"] for r in recs if r["t_first"] is not None and not r["error"]]
    faults = {f: {"sent": 0, "aborted": 0, "finished": 0} for f in FAULT_KINDS}
    for r in recs:
        if r["fault"] and not r["error"]:
            faults[r["fault"]]["sent"] += 1
            faults[r["fault"]]["aborted" if r["finish"] == "abort" else "finished"] += r["fault"] != "disconnect"
    verify = [(r["meta"].get("completion_tokens") or 0, r["meta"].get("spec_verify_ct") or 0) for r in recs
              if r["api"] == "generate" and not r["error"] and r["meta"].get("spec_verify_ct")]
    health_fail = [t for t, ok in phase["health"] if not ok]
    idle_ok, idle_last, idle_s = idle
    mism = (comparison or {}).get("mismatches", [])
    failures = [m for m in mism if not m.get("excused")]
    report = {
        "requests": len(recs), "tokens": sum(len(r["output_ids"]) for r in recs), "wall_s": round(phase["wall_s"], 1),
        "by_kind": by_kind, "errors": errors, "error_examples": examples,
        "latency_s": {"p50": percentile(latencies, 50), "p90": percentile(latencies, 90),
                      "p99": percentile(latencies, 99), "max": max(latencies) if latencies else None},
        "ttft_s": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99), "max": max(ttft) if ttft else None},
        "faults": faults, "stalls": phase["stalls"],
        "retracted_answers": sum(bool(r["meta"].get("num_retractions")) for r in recs if not r["error"]),
        "spec": {"answers": len(verify), "multi_token_answers": sum(c - 2 - v > 0 for c, v in verify),
                 "tokens_per_verify": (sum(c for c, _ in verify) / max(1, sum(v for _, v in verify)))},
        "compared": (comparison or {}).get("compared", 0), "mismatches": mism, "failures": len(failures),
        "compare_errors": (comparison or {}).get("errors", []),
        "health": {"polls": len(phase["health"]), "failures": health_fail[:50], "final_generate_ok": final_ok},
        "pool": {"start": start_pool, "end": idle_last, "idle_again": idle_ok, "idle_after_s": round(idle_s, 1),
                 "max_used": max((u for _, u, _, _ in phase["pools"] if u is not None), default=None),
                 "samples": phase["pools"][:: max(1, len(phase["pools"]) // 200)]},
        "memory": mem,
    }
    if reference is not None:
        bound = 2 * reference["latency_s"]["p99"]
        slow = [{"kind": r["kind"], "latency_s": round(r["t_end"] - r["t_start"], 3), "max_new":
                 r["body"].get("sampling_params", {}).get("max_new_tokens")} for r in recs
                if not r["error"] and not r["fault"] and r["t_end"] - r["t_start"] > bound]
        report["over_2x_reference_p99"] = {"bound_s": bound, "requests": slow}
    report["ok"] = bool(not failures and not errors and not report["compare_errors"] and not health_fail
                        and final_ok and idle_ok and not any(s["error"] for s in phase["stalls"])
                        and not (reference is not None and report["over_2x_reference_p99"]["requests"]))
    return report


def print_summary(rep: dict) -> None:
    print(f"soak: {rep['requests']} requests, {rep['tokens']} tokens in {rep['wall_s']} s; "
          f"{rep['compared']} greedy answers compared, {len(rep['mismatches'])} mismatches "
          f"({rep['failures']} not excused)")
    for m in rep["mismatches"][:20]:
        print(f"  mismatch {m['kind']} ({m['what']}) at output position {m.get('position')} of a "
              f"{m['prompt_len']}-token prompt: plain top-2 gap {m.get('gap')}, excused {m['excused']}")
    print(f"  errors by kind: {rep['errors'] or 'none'}; compare errors: {len(rep['compare_errors'])}")
    lat = "/".join(f"{x:.3f}" if x is not None else "-" for x in rep["latency_s"].values())
    print(f"  latency p50/p90/p99/max {lat} s; faults {json.dumps(rep['faults'])}; stalled streams "
          f"{len(rep['stalls'])}")
    p = rep["pool"]
    print(f"  pool: max used {p['max_used']}, idle again {p['idle_again']} after {p['idle_after_s']} s "
          f"(start {(p['start'] or {}).get('num_used_tokens')}, end {(p['end'] or {}).get('num_used_tokens')}); "
          f"health failures {len(rep['health']['failures'])}, final generate ok {rep['health']['final_generate_ok']}")
    print(f"  memory: {json.dumps(rep['memory'])}")
    print(f"  ok: {rep['ok']}")


# ------------------------------------------------------------------------------------------------------------- main
def server_facts(url: str) -> dict:
    info = get_json(url + "/server_info")
    limit = info.get("max_req_input_len") or min(x for x in (info.get("context_length"),
                                                             info.get("max_total_num_tokens")) if x)
    spec = info.get("speculative_algorithm")
    return {"input_limit": int(limit), "grammar": (info.get("grammar_backend") or "none") != "none",
            "reserve": 2 * int(info.get("speculative_num_draft_tokens") or 0) if spec else 0,
            "model": info.get("served_model_name") or info.get("model_path"), "speculative_algorithm": spec,
            "tokenizer": not info.get("skip_tokenizer_init"),
            "max_total_num_tokens": info.get("max_total_num_tokens"),
            "version": info.get("version")}


def run(args) -> dict:
    facts = server_facts(args.url)
    if args.baseline_url and not server_facts(args.baseline_url)["grammar"]:
        facts["grammar"] = False  # the plain server could not answer the same request
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else []
    weights = dict(WEIGHTS, **json.loads(args.weights)) if args.weights else None
    reserve = facts["reserve"] if args.reserve is None else args.reserve
    limit = min(facts["input_limit"], args.input_limit or 1 << 30) - reserve
    mix = Mix(prompts, args.vocab, args.max_new_tokens, limit, facts["grammar"], facts["model"], weights, args.seed,
              tokenizer=facts["tokenizer"])
    start_pool = pool(args.url)
    mem_start = memory(args.server_pid)
    phase = asyncio.run(load(args.url, mix, args.duration_s, args.concurrency, args.seed, args.timeout_s,
                             args.stall_clients, args.stall_s, args.poll_s))
    idle = wait_idle(args.url, (start_pool or {}).get("num_used_tokens") or 0, args.idle_timeout_s)
    final_ok = _healthy(args.url, "/health_generate", timeout_s=120)
    mem = {"start": dict(mem_start, kv=(start_pool or {}).get("memory")),
           "end": dict(memory(args.server_pid), kv=(idle[1] or {}).get("memory"))}
    comparison = compare(args.baseline_url, phase["records"], args.tie_tol, args.logprob_tol,
                         args.compare_concurrency) if args.baseline_url else None
    reference = json.loads(Path(args.reference_report).read_text()) if args.reference_report else None
    rep = summarize(phase, comparison, idle, final_ok, mem, start_pool, reference)
    rep.update(command=" ".join(sys.argv), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               url=args.url, baseline_url=args.baseline_url, server=facts,
               config={k: v for k, v in vars(args).items() if k != "func"})
    return rep


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the server under test")
    p.add_argument("--baseline-url", help="a plain server of the same target: every greedy answer is replayed there")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--prompts", help="JSON list of token-id prompts (default: random tokens from --vocab)")
    p.add_argument("--vocab", type=int, required=True, help="the target's vocabulary size (ids are checked in it)")
    p.add_argument("--input-limit", type=int, help="cap on prompt + output tokens (default: the server's)")
    p.add_argument("--reserve", type=int, help="tokens kept free under the limit (default: 2 x the server's "
                   "speculative_num_draft_tokens, SGLang's per-request decode reservation; see the module doc)")
    p.add_argument("--weights", help='JSON {kind: weight} over the default mix, e.g. \'{"chat": 0}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    p.add_argument("--stall-clients", type=int, default=1)
    p.add_argument("--stall-s", type=float, default=20.0)
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--idle-timeout-s", type=float, default=60.0)
    p.add_argument("--tie-tol", type=float, default=0.0, help="plain top-2 gap under which a divergence is a tie")
    p.add_argument("--logprob-tol", type=float, default=1e-4)
    p.add_argument("--compare-concurrency", type=int, default=16)
    p.add_argument("--server-pid", type=int, help="the server's process group leader (for its RSS)")
    p.add_argument("--reference-report", help="the same soak against the plain server: flag requests over 2x its p99")
    p.add_argument("--out", help="write the report here (JSON)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    rep = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=1, default=str) + "\n")
    print_summary(rep)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
