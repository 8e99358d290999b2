"""The one command: benchmark a running SGLang server over prompt sets x temperatures x a concurrency sweep.

    python -m benchmarks.bench --url http://127.0.0.1:30000 --method none --out runs/x
    python -m benchmarks.bench --url ... --method builtin --datasets random --temperatures 0 \
        --random-input-len 128 --ignore-eos --out runs/x           # random-weight cost run (--skip-tokenizer-init)

Writes ``OUT/<method>.json`` (per level: output tok/s, TTFT / TPOT / latency p50 and p99, tau, errors; plus the
command, date, device, versions and the server's arguments) and, for greedy levels, ``OUT/<method>.outputs.jsonl.gz``
(output ids per request, for the cross-check against the no-speculation run that ``benchmarks.report`` does).
``--method`` is only a label; the server decides what actually runs (benchmarks.driver starts the right one).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gzip
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from . import prompts as P
from . import server_metrics, stats
from .client import ChatTemplater, Sampling, closed_loop, flush_cache, get_json

DEFAULT_CONCURRENCY = (1, 8, 32, 64, 128)
SERVER_KEYS = ("model_path", "tokenizer_path", "served_model_name", "speculative_algorithm",
               "speculative_draft_model_path", "speculative_num_draft_tokens", "speculative_dflash_block_size",
               "attention_backend", "speculative_draft_attention_backend", "sampling_backend", "cuda_graph_max_bs",
               "disable_cuda_graph", "max_running_requests", "load_format", "speculative_draft_load_format",
               "disable_overlap_schedule", "mem_fraction_static", "chunked_prefill_size", "max_prefill_tokens",
               "skip_tokenizer_init", "dtype", "kv_cache_dtype", "disable_radix_cache", "enable_fp32_lm_head", "version")


def csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def csv_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def environment() -> dict:
    """Device, versions and date, for the results file."""
    env = {"date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version()}
    for mod in ("sglang", "torch", "transformers", "sglang_dflash"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    try:
        # the GPUs this process sees: nvidia-smi lists every GPU of the host unless told which
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        which = ["-i", visible] if visible and all(x.strip().isdigit() for x in visible.split(",")) else []
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader",
                            *which], capture_output=True, text=True, timeout=20)
        env["device"] = q.stdout.strip() or None
    except Exception:
        env["device"] = None
    return env


def server_info(url: str) -> dict:
    info = get_json(url, "/get_server_info") or {}
    model = get_json(url, "/get_model_info") or {}
    out = {k: info.get(k) for k in SERVER_KEYS if k in info}
    out.update({k: model[k] for k in ("model_path", "tokenizer_path") if k in model})
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        out["internal_state_avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
    return out


def level_items(data: list[dict], concurrency: int, rounds: int, min_convs: int, max_convs: int | None) -> list[dict]:
    """The conversations of one level: rounds x concurrency of them (at least min_convs), cycling through the set."""
    n = max(min_convs, rounds * concurrency)
    if max_convs:
        n = min(n, max_convs)
    out = []
    for i in range(n):
        it = dict(data[i % len(data)])
        it["rep"] = i // len(data)
        out.append(it)
    return out


def make_templater(spec: str, url: str) -> ChatTemplater | None:
    if spec == "none":
        return None
    path = spec
    if spec == "server":
        model = get_json(url, "/get_model_info") or {}
        path = model.get("tokenizer_path") or model.get("model_path")
        if not path:
            return None
    try:
        return ChatTemplater.from_path(path)
    except Exception as e:
        print(f"[bench] no tokenizer at {path!r} ({type(e).__name__}: {e}); only --datasets random will work",
              file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    datasets = args.datasets.split(",")
    text_sets = [d for d in datasets if d != "random"]
    groups = P.load(args.prompts, text_sets) if text_sets else {}
    if "random" in datasets:
        groups["random"] = P.random_items(max(args.min_convs, args.rounds * max(args.concurrency)),
                                          args.random_input_len, args.random_vocab, seed=args.seed)
    templater = make_templater(args.tokenizer, args.url) if text_sets else None

    result = {"method": args.method, "url": args.url, "command": " ".join(map(shlex.quote, sys.argv)),
              "args": {k: v for k, v in vars(args).items()}, "env": environment(),
              "server": server_info(args.url), "random_weights": args.random_weights, "levels": [], "notes": list(args.note or [])}
    greedy_out = []
    total = sum(len(level_items(groups[d], c, args.rounds, args.min_convs, args.max_convs))
                * (2 if d == "mtbench" else 1) for d in groups for c in args.concurrency) * len(args.temperatures)
    bar = tqdm(total=total, desc=f"{args.method}", unit="req", disable=args.no_progress, dynamic_ncols=True)

    if args.warmup:
        warm = Sampling(0.0, 16, ignore_eos=True)
        some = [groups[d][0] for d in groups][: args.warmup]
        asyncio.run(closed_loop(args.url, some * max(1, args.warmup // max(len(some), 1)), args.warmup, warm,
                                templater, args.timeout_s))

    for d in groups:
        for temp in args.temperatures:
            sampling = Sampling(temp, args.max_new_tokens, ignore_eos=args.ignore_eos)
            for c in args.concurrency:
                items = level_items(groups[d], c, args.rounds, args.min_convs, args.max_convs)
                bar.set_postfix_str(f"{d} T={temp:g} c={c}")
                if args.level_warmup:  # this level's shapes (MoE kernels per token count, widths the policy
                    # picks) compiled and learned before the clock starts; then the prompts leave the radix cache
                    warm_level = Sampling(temp, args.level_warmup, ignore_eos=True)
                    asyncio.run(closed_loop(args.url, items[:c], c, warm_level, templater, args.timeout_s))
                    flush_cache(args.url)
                before = server_metrics.scrape(args.url) if args.server_metrics else None
                recs, wall = asyncio.run(closed_loop(args.url, items, c, sampling, templater, args.timeout_s,
                                                     on_done=bar.update))
                s = stats.summarize(recs, wall)
                s.update(dataset=d, temperature=temp, concurrency=c)
                if args.server_metrics:  # the server's own account of the level's TTFT (server_metrics.py)
                    s["server_stage_ms"] = server_metrics.level_means_ms(before, server_metrics.scrape(args.url))
                errs = [r["error"] for r in recs if r.get("error")]
                if errs:
                    s["first_error"] = errs[0]
                result["levels"].append(s)
                tqdm.write(f"[{args.method}] {d:9s} T={temp:g} c={c:3d}: {s['output_tok_s']} tok/s, "
                           f"TPOT p50 {s['tpot_ms_p50']} ms, TTFT p50 {s['ttft_ms_p50']} ms, tau {s['tau']}, "
                           f"errors {s['errors']}")
                if temp == 0:
                    seen: dict[tuple, int] = {}
                    for r in recs:
                        k = (d, r["uid"], r["turn"], c)
                        seen[k] = seen.get(k, -1) + 1
                        greedy_out.append({"dataset": d, "uid": r["uid"], "turn": r["turn"], "concurrency": c,
                                           "rep": seen[k], "ids": r["output_ids"], "prompt": r.get("input_ids"),
                                           "max_new": args.max_new_tokens, "ignore_eos": args.ignore_eos})
    bar.close()
    path = out / f"{args.method}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    if greedy_out:
        with gzip.open(out / f"{args.method}.outputs.jsonl.gz", "wt") as f:
            for g in greedy_out:
                f.write(json.dumps(g) + "\n")
    print(f"[bench] wrote {path}")
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--method", default="server", help="label for the results: none | builtin | ours | ...")
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--prompts", default=str(P.DEFAULT_PATH), help="prepared JSONL (benchmarks.prompts)")
    p.add_argument("--datasets", default="humaneval,mtbench,gsm", help="comma list of humaneval,mtbench,gsm,random")
    p.add_argument("--concurrency", type=csv_ints, default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--temperatures", type=csv_floats, default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens (cost runs)")
    p.add_argument("--rounds", type=int, default=2, help="conversations per level = rounds x concurrency ...")
    p.add_argument("--min-convs", type=int, default=8, help="... but at least this many")
    p.add_argument("--max-convs", type=int, default=None, help="... and at most this many")
    p.add_argument("--tokenizer", default="server", help="tokenizer path for chat templates | server | none")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-vocab", type=int, default=32000, help="random prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="short warm-up requests before the sweep (0: none)")
    p.add_argument("--level-warmup", type=int, default=0, metavar="TOKENS",
                   help="before each level: one wave of its own first c prompts with TOKENS new tokens, then "
                        "/flush_cache, so the timed level starts warm (kernels compiled for its shapes, the width "
                        "policy's statistics) and without those prompts in the radix cache (0: off)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per request")
    p.add_argument("--random-weights", action="store_true",
                   help="the checkpoints are random (dummy load): tau is reported as a step count, never as acceptance")
    p.add_argument("--note", action="append", help="free text stored in the results (repeatable)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--server-metrics", action="store_true",
                   help="per level, the server's mean TTFT stages from /metrics (server started with --enable-metrics)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    res = run(args)
    return 1 if any(l["errors"] for l in res["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
