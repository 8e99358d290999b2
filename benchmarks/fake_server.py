"""A stand-in for ``python -m sglang.launch_server`` that speaks the parts of the native API the benchmark uses.

For CPU tests and dry runs of the driver (``--python`` pointing at a wrapper that runs this module). Tokens are a
deterministic function of the prompt; with ``--speculative-algorithm`` it commits ``--fake-tau`` tokens per step
(default 3) and reports ``spec_verify_ct`` like SGLang. It prints "sglang_dflash worker active" when run as "ours"
(speculative, and the switch variable given by --fake-switch-var unset), as our plugin's log would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from aiohttp import web

from sglang_dflash.serving.plugin import WORKER_ENV


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
    a, _ = p.parse_known_args(argv)
    return a


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    spec = a.speculative_algorithm is not None
    if spec and a.fake_switch_var not in os.environ:
        print("sglang_dflash worker active (fake)", flush=True)
    per_step = a.fake_tau if spec else 1

    async def health(_):
        return web.Response(text="ok")

    async def model_info(_):
        return web.json_response({"model_path": a.model_path, "tokenizer_path": None, "is_generation": True})

    async def server_info(_):
        return web.json_response({"model_path": a.model_path, "speculative_algorithm": a.speculative_algorithm,
                                  "speculative_num_draft_tokens": a.speculative_num_draft_tokens if spec else None,
                                  "version": "fake"})

    async def generate(req):
        body = await req.json()
        ids = body["input_ids"]
        sp = body["sampling_params"]
        n = int(sp["max_new_tokens"])
        seed = sum(ids) % 997
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        out, steps = [], 0
        while len(out) < n:
            await asyncio.sleep(a.fake_step_s)
            k = min(per_step, n - len(out))
            out += [(seed + 7 * (len(out) + j)) % 1000 for j in range(k)]
            steps += 1
            meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "finish_reason": None}
            if spec:
                meta.update(spec_verify_ct=steps, spec_num_correct_drafts=len(out) - steps)
            if len(out) >= n:
                meta["finish_reason"] = {"type": "length", "length": n}
            await resp.write(b"data: " + json.dumps({"output_ids": out, "meta_info": meta}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/get_model_info", model_info),
                    web.get("/get_server_info", server_info), web.post("/generate", generate)])
    web.run_app(app, host=a.host, port=a.port, shutdown_timeout=0.5, print=lambda *x: print(*x, flush=True))


if __name__ == "__main__":
    main()
