"""Issue #34 item 3, the adaptive floor on CPU: `sglang-dflash serve`'s exact server (its command from
sglang_dflash.serve.build_command: SmolLM2-135M-Instruct + the shipped drafter, adaptive widths) against the same
command without the speculative flags, on this machine's CPU. Sequential chat requests as the README's client sends
them (c = 1, greedy, max_tokens 96): the first --per-set items of gsm, HumanEval and MT-Bench from
benchmarks/data/prompts.jsonl, or the lines of --prompts (issue #47 item 1: prompts no drafter saw). Plain runs first
and again last (its own drift). Prints and writes tok/s per run, the ratios, greedy equality and each answer's
acceptance length; the servers' logs go next to the JSON.

    python -m benchmarks.cpu_floor --per-set 4 --out benchmarks/results/cpu-floor-smollm2
    python -m benchmarks.cpu_floor --prompts benchmarks/data/unseen_prompts.txt --out benchmarks/results/cpu-floor-unseen/run1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SPEC_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-draft-tokens",
              "--speculative-draft-attention-backend")


def without_speculation(argv: list[str]) -> list[str]:
    """The same launch_server command with every speculative flag and its value dropped."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in SPEC_FLAGS:
            skip = True
        else:
            out.append(a)
    return out


def run_method(name, argv, env, port, prompts, max_tokens, out_dir: Path) -> dict:
    from openai import OpenAI

    from sglang_dflash.testing.server import Server

    server = Server(argv, out_dir / f"{name}.log", port, "127.0.0.1", env=env).start()
    try:
        server.wait_healthy(300)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0)  # first-request costs out of the timed part
        tokens, texts, accept = 0, [], []
        t0 = time.time()
        for p in prompts:
            r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": p}],
                                               max_tokens=max_tokens, temperature=0,
                                               extra_body={"return_meta_info": True})
            tokens += r.usage.completion_tokens
            texts.append(r.choices[0].message.content)
            accept.append((r.choices[0].meta_info or {}).get("spec_accept_length"))
        seconds = time.time() - t0
    finally:
        server.stop()
    print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tok/s", flush=True)
    return dict(method=name, tokens=tokens, seconds=round(seconds, 2), tok_s=round(tokens / seconds, 3),
                accept_length=accept, texts=texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-set", type=int, default=4)
    p.add_argument("--prompts", type=Path, default=None,
                   help="a text file, one chat prompt per line, in place of the project's sets (e.g. "
                        "benchmarks/data/unseen_prompts.txt: written for this check, never in any drafter's data)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)

    from benchmarks.prompts import load
    from sglang_dflash.serve import build_command, default_drafter, prepare_default_target, stub_libcuda_dir

    if args.prompts:
        prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    else:
        groups = load(Path(__file__).parent / "data" / "prompts.jsonl", ["gsm", "humaneval", "mtbench"])
        prompts = [it["turns"][0] for g in groups.values() for it in g[:args.per_set]]
    cmd = build_command(prepare_default_target(), default_drafter(), args.port, stub_dir=stub_libcuda_dir(),
                        offline=True)
    env = {**os.environ, **cmd.env}
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: run_method(name, a, env, args.port, prompts, args.max_tokens, args.out)
            for name, a in (("plain", without_speculation(cmd.argv)), ("ours", cmd.argv),
                            ("plain-rerun", without_speculation(cmd.argv)))}
    summary = dict(command="python -m benchmarks.cpu_floor " + " ".join(argv), cpus=os.cpu_count(),
                   date=time.strftime("%Y-%m-%d"), prompts=len(prompts), max_tokens=args.max_tokens,
                   ours_over_plain=round(runs["ours"]["tok_s"] / runs["plain"]["tok_s"], 3),
                   ours_over_plain_rerun=round(runs["ours"]["tok_s"] / runs["plain-rerun"]["tok_s"], 3),
                   greedy_equal=sum(a == b for a, b in zip(runs["ours"]["texts"], runs["plain"]["texts"])))
    (args.out / "floor.json").write_text(json.dumps({**summary, "runs": list(runs.values())}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
