"""Reproduces compare.GAP_NOISE_MEASURED: float32 decode-vs-extend noise of the top-2 logprob gap (not a test).

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.serving.measure_tie_noise qwen3   # or gemma3

One baseline server (--dtype float32) of the tiny target: for each prompt of the serving tests, 48 greedy tokens
with the decode kernel's top-2 logprobs at every position, then one prefill of prompt + output for the extend
kernel's, and a float64 transformers recompute. Prints the largest |gap difference| of each pair and the smallest
gaps. About a minute on 2 cores.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch
import transformers as tf

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server

from .compare import FLOAT32, generate, port
from .models import build_gemma3_pair, build_pair, random_prompts


def measure(target, vocab, root: Path) -> dict[str, list[float]]:
    prompts = (random_prompts(18, vocab, seed=7) + random_prompts(8, vocab, seed=41)
               + random_prompts(8, vocab, seed=61, lo=12, hi=40) + random_prompts(6, vocab, seed=51, lo=40, hi=90))
    server = launch_server(target, port(30101), root / "measure_tie_noise.log", CPU_SERVER_ARGS + FLOAT32,
                           cpu_server_env(root / "stub"))
    gaps = {"decode": [], "extend": [], "float64": []}
    try:
        server.wait_healthy(600)
        model = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
        for p in prompts:
            r = generate(server, {"input_ids": p, "return_logprob": True, "top_logprobs_num": 2,
                                  "sampling_params": {"max_new_tokens": 48, "temperature": 0}})
            out = r["output_ids"]
            e = generate(server, {"input_ids": p + out, "return_logprob": True, "top_logprobs_num": 2,
                                  "logprob_start_len": len(p) - 1,
                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([p + out])).logits[0], -1)
            for k in range(len(out)):
                dec = sorted(r["meta_info"]["output_top_logprobs"][k], reverse=True)
                ext = sorted(e["meta_info"]["input_top_logprobs"][k + 1], reverse=True)
                top = lp[len(p) - 1 + k].topk(2).values
                gaps["decode"].append(dec[0][0] - dec[1][0])
                gaps["extend"].append(ext[0][0] - ext[1][0])
                gaps["float64"].append((top[0] - top[1]).item())
    finally:
        server.stop()
    return gaps


def main(which: str) -> None:
    root = Path(os.environ.get("SGLANG_DFLASH_TEST_CACHE", "/tmp/dflash_test_cache"))
    target, _, info = (build_pair if which == "qwen3" else build_gemma3_pair)(root)
    g = measure(target, info["vocab"], root)
    print(f"{which}: {len(g['decode'])} positions")
    for a, b in (("decode", "extend"), ("decode", "float64"), ("extend", "float64")):
        d = [abs(x - y) for x, y in zip(g[a], g[b])]
        print(f"|gap {a} - gap {b}|: max {max(d):.3g}, median {statistics.median(d):.3g}")
    print("smallest decode gaps:", [f"{x:.3g}" for x in sorted(g["decode"])[:5]])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3")
