"""Acceptance length tau of a drafter on held-out prompts, measured with the lossless reference engine.

tau = tokens committed per verify step (accepted drafts + the target's own token), averaged over all verify steps
of all requests of a set (prefill excluded). Greedy runs are also checked token for token against target-only
decoding (the engine is lossless, so any difference is a bug, reported as `greedy_equal: false`).
"""

from __future__ import annotations

import time

import torch

from ..reference.engine import ReferenceEngine
from ..sampling import SamplingParams


def measure_tau(target_model, drafter, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                stop_token_ids: tuple[int, ...] = (), seed: int = 0, check_greedy: bool = True,
                batch: int = 8) -> dict:
    engine = ReferenceEngine(target_model, drafter, seed=seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                            stop_token_ids=tuple(stop_token_ids))
    t0 = time.time()
    results = []
    for i in range(0, len(prompts), batch):
        results += engine.generate(prompts[i: i + batch], params)
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
                  temperatures=(0.0, 1.0), stop_token_ids=(), seed: int = 0, check_greedy: bool = True) -> dict:
    """{set: {"T=0": metrics, "T=1": metrics}} over the given prompt sets."""
    report = {}
    with torch.inference_mode():
        for name, prompts in sets.items():
            report[name] = {}
            for t in temperatures:
                m = measure_tau(target_model, drafter, prompts, max_new_tokens, t, stop_token_ids, seed, check_greedy)
                m.pop("outputs")
                report[name][f"T={t:g}"] = m
                print(f"  {name:10s} T={t:g}: tau {m['tau']:.2f} over {m['verify_steps']} steps"
                      + (f", greedy equal: {m['greedy_equal']}" if "greedy_equal" in m else ""), flush=True)
    return report
