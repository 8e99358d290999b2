"""A stand-in for ``python -m sglang.launch_server`` that speaks the parts of the native API the benchmarks use.

For CPU tests and dry runs of the driver and the soak (``--python`` pointing at a wrapper that runs this module).
The next token is a deterministic function of the whole context (`next_token`), so a continuation from any point and
the top-2 after any context agree with a full generation, as a real greedy server's do. With
``--speculative-algorithm`` it commits ``--fake-tau`` tokens per step (default 3) and reports ``spec_verify_ct`` like
SGLang. It prints "sglang_dflash worker active" when run as "ours" (speculative, and the switch variable given by
--fake-switch-var unset), as our plugin's log would.

Served: /health, /health_generate, /get_model_info, /server_info (and /get_server_info), /v1/loads (tokens held by
running requests), /abort_request (by rid), /generate (streamed or not; logprobs: the top-2 at a gap of 1.0), and
/v1/completions, /v1/chat/completions (greedy, return_token_ids). Faults for the soak's own tests: `--fake-corrupt N`
changes one output token of every request whose prompt sum is divisible by N (a lossless bug), `--fake-leak` never
returns a finished request's tokens to the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys

from aiohttp import web

from sglang_dflash.serving.plugin import WORKER_ENV

VOCAB = 1000


def next_token(ctx_sum: int, ctx_len: int) -> int:
    """The fake's greedy token after a context with this sum and length; its runner-up is the next id."""
    return (ctx_sum * 7 + ctx_len) % (VOCAB - 1)


def text_of(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default="fake")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=16)
    p.add_argument("--fake-tau", type=int, default=3)
    p.add_argument("--fake-step-s", type=float, default=0.002)
    p.add_argument("--fake-switch-var", default=WORKER_ENV)
    p.add_argument("--fake-input-limit", type=int, default=4096)
    p.add_argument("--fake-corrupt", type=int, default=0)
    p.add_argument("--fake-leak", action="store_true")
    a, _ = p.parse_known_args(argv)
    return a


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    spec = a.speculative_algorithm is not None
    if spec and a.fake_switch_var not in os.environ:
        print("sglang_dflash worker active (fake)", flush=True)
    per_step = a.fake_tau if spec else 1
    running: dict[str, int] = {}  # rid -> tokens it holds
    aborted: set[str] = set()
    leaked = [0]

    async def health(_):
        return web.Response(text="ok")

    async def model_info(_):
        return web.json_response({"model_path": a.model_path, "tokenizer_path": None, "is_generation": True})

    async def server_info(_):
        return web.json_response({"model_path": a.model_path, "speculative_algorithm": a.speculative_algorithm,
                                  "speculative_num_draft_tokens": a.speculative_num_draft_tokens if spec else None,
                                  "max_req_input_len": a.fake_input_limit, "max_total_num_tokens": 8 * a.fake_input_limit,
                                  "grammar_backend": "none", "version": "fake"})

    async def loads(_):
        return web.json_response({"loads": [{"num_used_tokens": sum(running.values()) + leaked[0],
                                             "num_running_reqs": len(running), "num_waiting_reqs": 0,
                                             "token_usage": 0.0}]})

    async def abort(req):
        aborted.add((await req.json())["rid"])
        return web.Response()

    async def tokens(ids: list[int], n: int, rid: str):
        """Yields (output so far, steps, finish) after each step; holds len(ids) + output tokens while running."""
        s, out, steps = sum(ids), [], 0
        corrupt = a.fake_corrupt and sum(ids) % a.fake_corrupt == 0 and n > 2
        running[rid] = len(ids)
        try:
            while len(out) < n:
                await asyncio.sleep(a.fake_step_s)
                if rid in aborted:
                    yield out, steps, {"type": "abort"}
                    return
                for _ in range(min(per_step, n - len(out))):
                    t = next_token(s, len(ids) + len(out))
                    out.append(t + 1 if corrupt and len(out) == 2 else t)
                    s += out[-1]
                steps += 1
                running[rid] = len(ids) + len(out)
                yield out, steps, ({"type": "length", "length": n} if len(out) >= n else None)
        finally:
            held = running.pop(rid, 0)
            leaked[0] += held if a.fake_leak else 0
            aborted.discard(rid)

    def meta(ids, out, steps, finish, logprob):
        m = {"prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": finish}
        if spec:
            m.update(spec_verify_ct=steps, spec_num_correct_drafts=len(out) - steps)
        if logprob:
            s, tops = sum(ids), []
            for j, t in enumerate(out):
                best = next_token(s, len(ids) + j)
                tops.append([[-0.1, best, None], [-1.1, best + 1, None]])
                s += t
            m.update(output_token_logprobs=[[-0.1 if t == top[0][1] else -1.1, t, None] for t, top in zip(out, tops)],
                     output_top_logprobs=tops)
        return m

    async def generate(req):
        body = await req.json()
        ids, sp = body["input_ids"], body["sampling_params"]
        n, rid = int(sp["max_new_tokens"]), body.get("rid") or os.urandom(8).hex()
        logprob = bool(body.get("return_logprob"))
        if not body.get("stream"):
            last = None
            async for last in tokens(ids, n, rid):
                pass
            out, steps, finish = last
            return web.json_response({"output_ids": out, "text": text_of(out),
                                      "meta_info": meta(ids, out, steps, finish, logprob)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        async with contextlib.aclosing(tokens(ids, n, rid)) as stream:  # a client gone: the request ends now
            async for out, steps, finish in stream:
                chunk = {"output_ids": out, "text": text_of(out), "meta_info": meta(ids, out, steps, finish, logprob)}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def openai(req):
        body = await req.json()
        chat = "messages" in body
        ids = [ord(c) % VOCAB for m in body["messages"] for c in m["content"]] if chat else body["prompt"]
        last = None
        async for last in tokens(ids, int(body["max_tokens"]), os.urandom(8).hex()):
            pass
        out, _, finish = last
        choice = {"index": 0, "finish_reason": finish["type"], "token_ids": out}
        if chat:
            choice.update(message={"role": "assistant", "content": text_of(out)}, prompt_token_ids=ids)
        else:
            choice["text"] = text_of(out)
        return web.json_response({"choices": [choice], "usage": {"prompt_tokens": len(ids),
                                                                 "completion_tokens": len(out)}})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/health_generate", health),
                    web.get("/get_model_info", model_info), web.get("/get_server_info", server_info),
                    web.get("/server_info", server_info), web.get("/v1/loads", loads),
                    web.post("/abort_request", abort), web.post("/generate", generate),
                    web.post("/v1/completions", openai), web.post("/v1/chat/completions", openai)])
    web.run_app(app, host=a.host, port=a.port, shutdown_timeout=0.5, print=lambda *x: print(*x, flush=True))


if __name__ == "__main__":
    main()
