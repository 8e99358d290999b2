"""GPU check of seeded sampling (issue #46 item 3): do two runs of the same seeded load give the same outputs?

    python -m benchmarks.seeded_repro --build-tiny /tmp/tiny-pair --out $OUT/seeded
    python -m benchmarks.seeded_repro --target /tmp/smollm2 --chat --out $OUT/seeded \
        --draft sglang_dflash/assets/SmolLM2-135M-Instruct-DFlash-b16 --server-args "... --dtype bfloat16"

For each configuration (`--configs`, default: adaptive widths; adaptive + --enable-deterministic-inference; k pinned
to B-1 + --enable-deterministic-inference) one DFLASH server (ours: overlap + CUDA graphs) answers --prompts seeded
sampled requests (--temperature, top_p 0.95, sampling_seed = 1000 + i) three times: one at a time (run A), one at a
time again (run B), and all at once inside a batch with as many unseeded sampled and greedy requests (run C).
Reported per configuration: how many outputs are identical in A vs B and A vs C, the first differing position of the
others, the accept length, and the seeded batch's wall time next to the same batch without seeds (the seeded rules'
cost: the noise over [bs, W, V] in torch). Exit code 0 whatever the counts (a measurement); 1 if a server fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import time
from pathlib import Path

from benchmarks.gpu_e2e import build_tiny, post
from sglang_dflash.testing import launch_server, worker_env

# configuration -> (--enable-deterministic-inference?, environment). Without that flag SGLang 0.5.17 runs sgl_kernel's
# rmsnorm, which has no float32 kernel: the H200 runs of 2026-11-28 lost the no-flag server to it twice (prefill graph
# capture, then the verify graphs' capture), so on a GPU the no-flag configurations serve the float32 pair in bfloat16
CONFIGS = {
    "adaptive": (False, {}),
    "adaptive+det": (True, {}),
    "fixed+det": (True, {"SGLANG_DFLASH_ADAPTIVE": "0"}),
    "fixed": (False, {"SGLANG_DFLASH_ADAPTIVE": "0"}),
}


def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    diffs = [first_difference(x, y) for x, y in zip(a, b)]
    return {"identical": sum(d is None for d in diffs), "of": len(diffs),
            "first_difference_at": sorted(d for d in diffs if d is not None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--build-tiny", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--configs", default="adaptive,adaptive+det,fixed+det")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--chat", action="store_true", help="chat prompts through the target's template (real weights)")
    ap.add_argument("--cpu-stub", type=Path, help="run on SGLang's CPU engine (smoke test of this script): the stub "
                    "libcuda folder (tests' dflash_pair root / 'stub'); --server-args then default to the CPU ones")
    ap.add_argument("--wait-s", type=float, default=400)
    ap.add_argument("--server-args", default=None,
                    help="default: triton attention, float32, decode CUDA graphs to bs 64")
    args = ap.parse_args(argv)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cpu_stub:
        from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env

        base_env = cpu_server_env(args.cpu_stub)
        args.server_args = args.server_args or " ".join(CPU_SERVER_ARGS + ["--dtype", "float32",
                                                                          "--speculative-draft-attention-backend",
                                                                          "torch_native"])
    args.server_args = args.server_args or ("--attention-backend triton --mem-fraction-static 0.25 --cuda-graph-max-bs "
                                            "64 --grammar-backend none --sampling-backend pytorch --dtype float32")
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = build_tiny(args.build_tiny) if args.build_tiny else (Path(args.target), Path(args.draft))
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    if args.chat:
        from transformers import AutoTokenizer

        from benchmarks.prompts import chat_prompt_ids

        prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(str(target)), 2 * args.prompts)
    elif args.build_tiny:  # the prompts the tiny drafter was trained on (gpu_e2e.build_tiny): multi-token commits
        rng = random.Random(123)
        prompts = [[rng.randrange(5, vocab) for _ in range(rng.randrange(4, 24))] for _ in range(48)][:2 * args.prompts]
    else:
        rng = random.Random(7)
        prompts = [[rng.randrange(5, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(2 * args.prompts)]
    mine, fillers = prompts[:args.prompts], prompts[args.prompts:]
    sampled = {"temperature": args.temperature, "top_p": 0.95, "max_new_tokens": args.max_new_tokens,
               "ignore_eos": True}
    spec_args = args.server_args.split() + ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
                                            str(draft)]
    summary = {"target": str(target), "draft": str(draft), "server_args": args.server_args, "configs": {},
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        summary["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # reported, not hidden
        summary["device"] = f"unknown ({e})"
    rc = 0
    for name in [c for c in args.configs.split(",") if c]:
        deterministic, extra_env = CONFIGS[name]
        extra_args = (["--enable-deterministic-inference"] if deterministic
                      else [] if args.cpu_stub else ["--dtype", "bfloat16"])
        env = {**worker_env(base_env, builtin=False), **extra_env}
        server = launch_server(target, 30000, args.out / f"{name}.log", spec_args + extra_args, env)
        try:
            server.wait_healthy(args.wait_s)

            def ask(prompt, params):
                return post(server.url + "/generate", {"input_ids": prompt, "sampling_params": params})

            def seeded(i):
                return {**sampled, "sampling_seed": 1000 + i}

            def batch(with_seeds: bool):
                bodies = [(p, seeded(i) if with_seeds else sampled) for i, p in enumerate(mine)]
                bodies += [(p, sampled if j % 2 else {"temperature": 0, "max_new_tokens": args.max_new_tokens,
                                                      "ignore_eos": True}) for j, p in enumerate(fillers)]
                order = list(range(len(bodies)))
                random.Random(len(bodies)).shuffle(order)
                t0 = time.time()
                with cf.ThreadPoolExecutor(len(bodies)) as pool:
                    outs = dict(zip(order, pool.map(lambda k: ask(*bodies[k]), order)))
                return [outs[k] for k in range(len(bodies))][:len(mine)], time.time() - t0

            ask(mine[0], seeded(0))  # warm-up (widths explored, kernels compiled)
            a = [ask(p, seeded(i)) for i, p in enumerate(mine)]
            b = [ask(p, seeded(i)) for i, p in enumerate(mine)]
            batch(False)  # warm the batch sizes
            c, seeded_wall = batch(True)
            _, unseeded_wall = batch(False)
            ids = [[o["output_ids"] for o in run] for run in (a, b, c)]
            steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in a)
            toks = sum(len(o["output_ids"]) for o in a)
            summary["configs"][name] = {
                "A_vs_B (c=1 twice)": agreement(ids[0], ids[1]),
                "A_vs_C (c=1 vs in a batch)": agreement(ids[0], ids[2]),
                "accept_length_c1": round(toks / steps, 3) if steps else None,
                "batch_wall_s_seeded": round(seeded_wall, 2), "batch_wall_s_unseeded": round(unseeded_wall, 2)}
            print(name, json.dumps(summary["configs"][name]), flush=True)
        except Exception as e:  # a failed server is reported and fails the run
            summary["configs"][name] = {"error": repr(e), "log_tail": server.log_tail()}
            rc = 1
        finally:
            server.stop()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
