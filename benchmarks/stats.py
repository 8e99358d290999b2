"""Pure statistics over per-request records: percentiles, throughput, acceptance length, greedy cross-check.

A record is one request (one turn) as the client saw it::

    {"dataset", "uid", "turn", "t_start", "t_first", "t_end" (s, monotonic), "prompt_tokens", "completion_tokens",
     "spec_verify_ct" (None without speculation), "spec_accept_tokens" (accepted drafts, None if not reported),
     "output_ids" (greedy runs only), "error" (None or a message)}
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}: a percentile is between 0 and 100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def tau(records: Iterable[dict]) -> float | None:
    """Acceptance length over a set of requests: committed tokens per verify step, bonus included.

    Aggregated as sum(completion_tokens) / sum(spec_verify_ct) (token-weighted, not a mean of per-request
    ratios, so that long requests count for what they cost). Same definition as SGLang's per-request
    ``meta_info["spec_accept_length"]`` (tokenizer_manager.py), which counts the prefill token too.
    None when no request reports verify steps (no speculation).
    """
    toks = steps = 0
    for r in records:
        if r.get("error") or not r.get("spec_verify_ct"):
            continue
        toks += r["completion_tokens"]
        steps += r["spec_verify_ct"]
    return toks / steps if steps else None


def tpot(r: dict) -> float | None:
    """Time per output token after the first, seconds (None for single-token outputs)."""
    n = r["completion_tokens"]
    if n <= 1 or r.get("t_first") is None:
        return None
    return (r["t_end"] - r["t_first"]) / (n - 1)


def summarize(records: list[dict], wall_s: float) -> dict:
    """One concurrency level: throughput, latency percentiles (ms), tau, error count."""
    ok = [r for r in records if not r.get("error")]
    out_toks = sum(r["completion_tokens"] for r in ok)
    ttft = [1e3 * (r["t_first"] - r["t_start"]) for r in ok if r.get("t_first") is not None]
    tpots = [1e3 * t for t in (tpot(r) for r in ok) if t is not None]
    lat = [1e3 * (r["t_end"] - r["t_start"]) for r in ok]

    def pct(xs, q):
        v = percentile(xs, q)
        return None if v is None else round(v, 3)

    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "output_tokens": out_toks, "input_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "wall_s": round(wall_s, 4),
        "output_tok_s": round(out_toks / wall_s, 2) if wall_s > 0 else None,
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpots, 50), "tpot_ms_p99": pct(tpots, 99),
        "latency_ms_p50": pct(lat, 50), "latency_ms_p99": pct(lat, 99),
        "tau": None if tau(ok) is None else round(tau(ok), 4),
        "verify_steps": sum(r.get("spec_verify_ct") or 0 for r in ok),
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def crosscheck(baseline: dict[tuple, list[int]], other: dict[tuple, list[int]]) -> dict:
    """Greedy outputs of a method against the no-speculation run, request by request (same key = same prompt).

    ``exact``: outputs identical. ``prefix_frac``: mean over requests of (common prefix / baseline length);
    first divergences in random-weight runs are usually exact bf16 ties in the baseline's top-2 logits
    (see shared/device-stack/README.md), and the baseline itself is not batch-invariant, so a mismatch is a
    lead to follow, not by itself a lossless violation.
    """
    keys = sorted(set(baseline) & set(other), key=str)
    if not keys:
        return {"compared": 0, "exact": 0, "exact_frac": None, "prefix_frac": None, "first_mismatch": None}
    exact = 0
    fracs = []
    first = None
    for k in keys:
        a, b = baseline[k], other[k]
        p = common_prefix(a, b)
        if a == b:
            exact += 1
        elif first is None:
            first = {"key": list(k), "position": p, "baseline_len": len(a), "other_len": len(b)}
        fracs.append(p / max(len(a), 1))
    return {"compared": len(keys), "exact": exact, "exact_frac": round(exact / len(keys), 4),
            "prefix_frac": round(sum(fracs) / len(fracs), 4), "first_mismatch": first}


def step_cost_ratio(plain_tok_s: float, spec_tok_s: float, spec_tau: float) -> float:
    """How many plain decode steps one speculative step costs, from measured throughputs and the measured tau.

    plain: one token per step per request; speculative: tau tokens per step. At the same concurrency,
    spec_tok_s / plain_tok_s = tau / ratio  =>  ratio = tau * plain_tok_s / spec_tok_s.
    """
    return spec_tau * plain_tok_s / spec_tok_s


def implied_speedup(ratio: float, tau_value: float) -> float:
    """Throughput over plain decoding that a drafter reaching ``tau_value`` would give at this step cost."""
    return tau_value / ratio
