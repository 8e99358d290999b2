"""Acceptance length tau of a drafter on held-out prompts, measured with the lossless reference engine.

tau = tokens committed per verify step (accepted drafts + the target's own token), averaged over all verify steps
of all requests of a set (prefill excluded). Greedy runs are also checked token for token against target-only
decoding (the engine is lossless, so any difference is a bug, reported as `greedy_equal: false`).
"""

from __future__ import annotations

import time

import torch

from ..acceptance import accepted_prefix_len
from ..reference.engine import ReferenceEngine, draft_step
from ..sampling import SamplingParams


def measure_tau(target_model, drafter, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                stop_token_ids: tuple[int, ...] = (), seed: int = 0, check_greedy: bool = True,
                batch: int = 8, verbose: bool = False) -> dict:
    engine = ReferenceEngine(target_model, drafter, seed=seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=tuple(stop_token_ids))
    t0 = time.time()
    results = []
    for i in range(0, len(prompts), batch):
        results += engine.generate(prompts[i: i + batch], params)
        if verbose:
            print(f"    T={temperature:g} prompts {i}..{len(results) - 1}: tau "
                  f"{[round(r.mean_acceptance, 2) for r in results[i:]]} ({time.time() - t0:.0f} s)", flush=True)
    spec_s = time.time() - t0
    steps = sum(len(r.commit_lens) for r in results)
    out = {"prompts": len(prompts), "temperature": temperature, "max_new_tokens": max_new_tokens,
           "tau": sum(sum(r.commit_lens) for r in results) / max(1, steps), "verify_steps": steps,
           "output_tokens": sum(len(r.output_ids) for r in results),
           "target_forwards": sum(r.target_forwards for r in results), "spec_wall_s": round(spec_s, 2),
           "per_prompt_tau": [round(r.mean_acceptance, 3) for r in results]}
    if temperature == 0.0 and check_greedy:
        t0 = time.time()
        base = []
        for i in range(0, len(prompts), batch):
            base += engine.generate_target_only(prompts[i: i + batch], params)
        out["baseline_wall_s"] = round(time.time() - t0, 2)
        out["baseline_target_forwards"] = sum(r.target_forwards for r in base)
        out["greedy_equal"] = all(a.output_ids == b.output_ids for a, b in zip(results, base))
    out["outputs"] = [r.output_ids for r in results]
    return out


def evaluate_sets(target_model, drafter, sets: dict[str, list[list[int]]], max_new_tokens: int,
                  temperatures=(0.0, 1.0), stop_token_ids=(), seed: int = 0, check_greedy: bool = True,
                  batch: int = 8, verbose: bool = False, replay: bool = False, pad_id: int = 0,
                  on_result=None) -> dict:
    """{set: {"T=0": metrics, "T=1": metrics}} over the given prompt sets (with replay: also "T=0 replay", the
    teacher-forced greedy tau on the same prompts, a cross-check of the two methods)."""
    report = {}
    with torch.inference_mode():
        for name, prompts in sets.items():
            report[name] = {}
            if replay:
                report[name]["T=0 replay"] = greedy_tau_teacher_forced(target_model, drafter, prompts,
                                                                       max_new_tokens, stop_token_ids, pad_id)
                print(f"  {name:10s} T=0 replay: tau {report[name]['T=0 replay']['tau']:.2f}", flush=True)
            for t in temperatures:
                m = measure_tau(target_model, drafter, prompts, max_new_tokens, t, stop_token_ids, seed, check_greedy,
                                batch, verbose)
                m.pop("outputs")
                report[name][f"T={t:g}"] = m
                print(f"  {name:10s} T={t:g}: tau {m['tau']:.2f} over {m['verify_steps']} steps"
                      + (f", greedy equal: {m['greedy_equal']}" if "greedy_equal" in m else ""), flush=True)
                if on_result is not None:
                    on_result(report)
    return report


@torch.inference_mode()
def greedy_tau_teacher_forced(target_model, drafter, prompts: list[list[int]], max_new_tokens: int,
                              stop_token_ids=(), pad_id: int = 0, batch: int = 16) -> dict:
    """Greedy tau without running the speculative loop: the target's greedy continuation is generated once
    (batched), its hidden states come from one forward per sequence, and the verify steps are replayed: a step at
    anchor a drafts from [x_a, MASK...] with the context rows < a and commits 1 + the leading drafts equal to
    x_{a+1}, x_{a+2}, ... (exactly what greedy verification does, since the target's greedy tokens are x). Much
    cheaper than the engine (one drafter pass per step, no per-step target forward), so it scales to more prompts.
    Differences to the engine: floating-point noise between a full-sequence forward and incremental verifies, and
    the last step counts only drafts inside the known continuation (the engine may count accepted drafts past the
    stop)."""
    from .generate import generate_responses
    from .loop import batch_features

    cfg = drafter.config
    store = generate_responses(target_model, prompts, max_new_tokens, list(stop_token_ids), pad_id, batch,
                               progress=False)
    embed = target_model.get_input_embeddings().weight
    lm_head = target_model.get_output_embeddings().weight
    dev = embed.device
    per_prompt, all_commits = [], []
    for i in range(len(store)):
        x = store.tokens(i).to(dev)
        p, t = int(store.prompt_lens[i]), len(x)
        context = drafter.project_context(batch_features(target_model, cfg.target_layer_ids, x[None])[0])
        commits, a = [], p
        while a - p + 1 < t - p:  # tokens emitted so far: x_p..x_a
            drafts = draft_step(drafter, [int(x[a])], [context[:a]], embed, lm_head)[0]  # the engine's own step
            known = x[a + 1: a + cfg.block_size]
            hit = int(accepted_prefix_len((drafts[: len(known)] == known)[None])[0])
            commits.append(1 + hit)
            a += 1 + hit
        per_prompt.append(sum(commits) / max(1, len(commits)))
        all_commits += commits
    return {"prompts": len(store), "max_new_tokens": max_new_tokens, "tau": sum(all_commits) / max(1, len(all_commits)),
            "verify_steps": len(all_commits), "per_prompt_tau": [round(v, 3) for v in per_prompt],
            "method": "teacher-forced replay of greedy verification (greedy_tau_teacher_forced)"}


def compare_tau(new: dict, base: dict) -> dict:
    """Two `train eval` outputs ({"meta", "results": {set: {"T=t": metrics}}}) side by side, for every (set, T) both
    measured: {set: {"T=t": {"new", "base", "gain" (new / base - 1), "same_prompts"}}}, plus "mean_gain" per T (the
    mean of the sets' gains). Only tau measured on the same prompts compares: `same_prompts` says whether both runs
    decoded the same number of prompts with the same max_new_tokens (the held-out sets are fixed by the prompts file).
    """
    out: dict = {}
    gains: dict[str, list[float]] = {}
    for name, runs in new["results"].items():
        for key, m in runs.items():
            b = base["results"].get(name, {}).get(key)
            if b is None or not key.startswith("T=") or " " in key:
                continue
            same = (m["prompts"], m["max_new_tokens"]) == (b["prompts"], b["max_new_tokens"])
            gain = m["tau"] / b["tau"] - 1
            out.setdefault(name, {})[key] = {"new": round(m["tau"], 4), "base": round(b["tau"], 4),
                                             "gain": round(gain, 4), "same_prompts": same}
            gains.setdefault(key, []).append(gain)
    out["mean_gain"] = {key: round(sum(g) / len(g), 4) for key, g in gains.items()}
    return out


def write_drafter_results(report: dict, meta: dict, out_dir) -> list:
    """One JSON per (set, temperature) of an `evaluate_sets` report, named `{target}-{set}-T{t}.json`, for
    benchmarks/results/drafters/ (compare drafters at a glance). Keys: target, set, temperature, prompts, tau,
    greedy_equal (the greedy output equal to target-only decoding's on this set: the T=0 run's check, repeated on
    the T=1 file since a sampled run has no plain output to compare with; null when it was not checked), plus the
    drafter, device, dtype, max_new_tokens, verify_steps and the command from `meta`."""
    import json
    from pathlib import Path

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for set_name, runs in report.items():
        greedy_equal = runs.get("T=0", {}).get("greedy_equal")
        for key, m in runs.items():
            if not key.startswith("T=") or " " in key:  # "T=0 replay" is a cross-check, not a tau measurement
                continue
            t = float(key[2:])
            row = {"target": meta.get("target"), "set": set_name, "temperature": t, "prompts": m["prompts"],
                   "tau": round(m["tau"], 4), "greedy_equal": greedy_equal, "verify_steps": m["verify_steps"],
                   "max_new_tokens": m["max_new_tokens"]}
            row.update({k: meta[k] for k in ("drafter", "device", "dtype", "date", "command") if k in meta})
            path = out_dir / f"{meta.get('target')}-{set_name}-T{t:g}.json"
            path.write_text(json.dumps(row, indent=1) + "\n")
            written.append(path)
    return written
