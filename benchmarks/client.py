"""Closed-loop load against SGLang's native ``/generate`` (streamed), one record per request turn.

Why the native API: its final ``meta_info`` carries per-request ``spec_verify_ct`` and accepted-draft counts (the
OpenAI endpoints do not), and ``output_ids`` for the greedy cross-check. Prompts go as ``input_ids`` built with the
model's chat template on the client side, so servers started with ``--skip-tokenizer-init`` work the same way.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import orjson


@dataclass
class Sampling:
    temperature: float
    max_new_tokens: int
    ignore_eos: bool = False

    def params(self) -> dict[str, Any]:
        p = {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "ignore_eos": self.ignore_eos}
        if self.temperature > 0:
            p.update(top_p=1.0, top_k=-1, min_p=0.0)
        return p


class ChatTemplater:
    """messages -> input_ids with the model's chat template; output ids -> text for the next turn."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    @classmethod
    def from_path(cls, path: str) -> "ChatTemplater":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, messages: list[dict]) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        # base models without a template: plain concatenation
        return self.tok("\n\n".join(m["content"] for m in messages))["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


async def sse_chunks(resp: aiohttp.ClientResponse):
    """The JSON chunks of a streamed SGLang answer (``data: {...}`` lines), up to ``data: [DONE]``."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield orjson.loads(payload)


async def generate(session: aiohttp.ClientSession, url: str, input_ids: list[int], sampling: Sampling,
                   timeout_s: float) -> dict:
    """One streamed /generate request; returns timings (monotonic s), token counts, spec counters, output ids."""
    body = {"input_ids": input_ids, "sampling_params": sampling.params(), "stream": True}
    rec: dict[str, Any] = {"t_start": time.perf_counter(), "t_first": None, "t_end": None, "error": None,
                           "input_ids": input_ids, "prompt_tokens": len(input_ids), "completion_tokens": 0, "spec_verify_ct": None,
                           "spec_accept_tokens": None, "output_ids": [], "finish_reason": None}
    last: dict | None = None
    try:
        # the streamed chunks are parsed with orjson: the client shares the host's cores with the server it
        # measures and parses one chunk per streamed step, each carrying the output so far (a 1,024-id chunk:
        # 0.76 ms with json, 0.10 ms with orjson, measured on a 2-core machine); a slow parse shows up as latency
        async with session.post(url + "/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                rec["t_end"] = time.perf_counter()
                return rec
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    rec["error"] = str(chunk["error"])[:300]
                    break
                if rec["t_first"] is None and (chunk.get("output_ids") or chunk.get("text")):
                    rec["t_first"] = time.perf_counter()
                last = chunk
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["t_end"] = time.perf_counter()
    if last is not None and rec["error"] is None:
        meta = last.get("meta_info", {})
        rec["output_ids"] = list(last.get("output_ids") or [])
        rec["completion_tokens"] = int(meta.get("completion_tokens", len(rec["output_ids"])))
        rec["prompt_tokens"] = int(meta.get("prompt_tokens", rec["prompt_tokens"]))
        rec["spec_verify_ct"] = meta.get("spec_verify_ct")
        rec["spec_accept_tokens"] = meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))
        fr = meta.get("finish_reason")
        rec["finish_reason"] = fr.get("type") if isinstance(fr, dict) else fr
    elif rec["error"] is None:
        rec["error"] = "stream ended without a result"
    return rec


async def run_conversation(session, url: str, item: dict, sampling: Sampling, templater: ChatTemplater | None,
                           timeout_s: float) -> list[dict]:
    """All turns of one item in order; turn k carries the model's earlier answers in its history."""
    out = []
    if "input_ids" in item:  # random-token prompt, single turn
        r = await generate(session, url, item["input_ids"], sampling, timeout_s)
        r.update(dataset=item["dataset"], uid=item["uid"], turn=0)
        return [r]
    if templater is None:
        raise ValueError(f"dataset {item['dataset']!r} needs a tokenizer for its chat template. Fix: pass "
                         "--tokenizer PATH, or serve a model with a tokenizer, or use --datasets random")
    messages: list[dict] = []
    for t, user in enumerate(item["turns"]):
        messages.append({"role": "user", "content": user})
        r = await generate(session, url, templater.encode(messages), sampling, timeout_s)
        r.update(dataset=item["dataset"], uid=item["uid"], turn=t)
        out.append(r)
        if r["error"]:
            break
        messages.append({"role": "assistant", "content": templater.decode(r["output_ids"])})
    return out


async def closed_loop(url: str, items: list[dict], concurrency: int, sampling: Sampling,
                      templater: ChatTemplater | None, timeout_s: float = 600.0,
                      on_done: Callable[[int], None] | None = None) -> tuple[list[dict], float]:
    """``concurrency`` workers, each sending its next conversation as soon as the last one finished.

    Returns (records, wall seconds from the first send to the last completion).
    """
    queue: asyncio.Queue = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    records: list[dict] = []

    async def worker(session):
        while True:
            try:
                it = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            recs = await run_conversation(session, url, it, sampling, templater, timeout_s)
            records.extend(recs)
            if on_done:
                on_done(len(recs))

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(items)))))
        wall = time.perf_counter() - t0
    return records, wall


def get_json(url: str, path: str, timeout_s: float = 10.0) -> dict | None:
    """GET a JSON endpoint synchronously (server info); None if it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as r:
            return orjson.loads(r.read())
    except Exception:
        return None


def flush_cache(url: str, timeout_s: float = 30.0) -> bool:
    """POST /flush_cache (SGLang: empties the radix cache once no request runs); whether the server said yes."""
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=timeout_s) as r:
            return 200 <= r.status < 300
    except OSError:
        return False

