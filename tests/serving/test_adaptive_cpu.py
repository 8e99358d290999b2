"""Lossless across verify-width switches: k changes from step to step inside every request (CPU server).

The adaptive policy picks k (drafts verified per step, 0..B-1) for each step; k = 0 is a plain decode step that
still writes the drafter's context. Whatever it picks, the output must be the target's. Here the test hook
SGLANG_DFLASH_K_SCHEDULE forces k through a cycle that switches at every step (full block, plain step, short
widths, back-to-back plain steps), on a server that also chunks prefills (16 tokens), retracts requests (a
320-token KV pool) and reuses radix prefixes (--enable-cache-report proves the hits). Greedy outputs must equal
the shared no-speculation baseline; sampled tokens must lie inside the target's processed support; a seeded sampled
request gives the same output alone and in a concurrent batch, whatever widths the schedule puts at its positions.
A second server runs the same schedule with short drafts (SGLANG_DFLASH_SHORT_DRAFT=1: a step of k < B - 1 drafts
runs the drafter on k + 1 positions): the same greedy equality. The policy's decisions themselves are unit-tested in
tests/test_adaptive.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import (FLOAT32, SPEC_ARGS, assert_multi_token, assert_valid_sample, compare_greedy, generate, greedy,  # noqa: E402
                      log_count, port, wait_all_healthy)
from .models import TRAIN_PROMPT_SEED, random_prompts  # noqa: E402

PORT, SHORT_PORT = 30012, 30013  # not 30006: conftest.smollm2_plain's
SCHEDULE = "15,0,3,0,0,7,1,15,2,0"  # every step switches width; plain steps back to back; the full block recurs
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def servers(dflash_pair, baseline):
    root, target, draft, info = dflash_pair
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"]
    args[args.index("--max-total-tokens") + 1] = "320"
    args += ["--chunked-prefill-size", "16", "--schedule-conservativeness", "0.1", "--enable-cache-report",
             *FLOAT32, *SPEC_ARGS, "--speculative-draft-model-path", str(draft)]
    env = cpu_server_env(root / "stub")
    env["SGLANG_DFLASH_K_SCHEDULE"] = SCHEDULE
    spec = launch_server(target, port(PORT), root / "spec_adaptive.log", args, env)
    short = launch_server(target, port(SHORT_PORT), root / "spec_short_draft.log", args,
                          {**env, "SGLANG_DFLASH_SHORT_DRAFT": "1"})
    try:
        wait_all_healthy(baseline, spec, short)
        yield {"base": baseline, "spec": spec, "short": short, "vocab": info["vocab"], "target": str(target)}
    finally:
        short.stop()
        spec.stop()


def test_schedule_is_in_force(servers):
    assert log_count(servers["spec"], f"k schedule [{SCHEDULE.replace(',', ', ')}]") >= 1, (
        "the worker did not report the forced k schedule: the test would not exercise width switches")


@pytest.mark.parametrize("server", ["spec", "short"])
def test_greedy_equal_across_switches(servers, server):
    prompts = random_prompts(12, servers["vocab"], seed=71, lo=8, hi=70)
    metas = compare_greedy(servers["base"], servers[server], prompts, max_tokens=MAX_TOKENS, max_workers=24,
                           max_excused_prompts=1)
    assert_multi_token(metas, "greedy requests under the k schedule")
    if server == "short":  # the narrow steps really drafted k + 1 positions
        assert log_count(servers["short"], "first short draft pass") >= 1


def test_radix_hit_across_switches(servers):
    spec, base = servers["spec"], servers["base"]
    shared = random_prompts(1, servers["vocab"], seed=72, lo=48, hi=49)[0]
    prompts = [shared + tail for tail in random_prompts(3, servers["vocab"], seed=73, lo=3, hi=6)]
    greedy(spec, prompts[0], MAX_TOKENS)  # puts the shared prefix into the radix cache
    metas = compare_greedy(base, spec, prompts[1:], max_tokens=MAX_TOKENS, max_workers=4, max_excused_prompts=0)
    hits = [m["cached_tokens"] for m in metas]
    assert all(h >= 32 for h in hits), f"no radix hit on the shared 48-token prefix: cached_tokens {hits}"


def test_sampled_inside_support_across_switches(servers):
    spec, base = servers["spec"], servers["base"]
    prompt = random_prompts(1, servers["vocab"], seed=74, lo=12, hi=13)[0]
    for seed in (1, 2):
        out = generate(spec, {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "sampling_seed": seed}})
        assert_valid_sample(base, prompt, out["output_ids"], servers["vocab"], 0.8, 0.9, 0.05)


def test_seeded_sampling_is_reproducible_across_switches_and_batches(servers):
    """Issue #46 item 3: seeded sampled requests (sampling_seed) give the same output run alone twice and inside a
    concurrent batch with other seeded, unseeded and greedy requests, although the k schedule (which advances per
    step of the whole server) verifies a different number of drafts at their positions in each run, the batches
    differ, and the small KV pool may retract them. On code that draws from the global generator this fails."""
    spec, vocab = servers["spec"], servers["vocab"]
    known = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)  # the drafter's prompts
    looping = random_prompts(18, vocab, seed=7)[5]  # the prompt the drafter knows best (test_e2e_cpu's histogram)
    # the looping prompt at a low temperature keeps its seeded stream where the drafter is right, so the seeded rule
    # runs multi-token commits whatever the schedule's alignment (at 0.5, seed 17's stream left the loop early and a
    # CI run committed no multi-token step); the other two sample for real
    settings = [{"temperature": 0.2, "top_k": 4}, {"temperature": 0.3}, {"temperature": 0.8, "top_p": 0.9}]
    seeded = [(p, {"max_new_tokens": 32, "sampling_seed": 17 + i, **settings[i]})
              for i, p in enumerate([looping, known[0], known[1]])]
    others = [(known[3 + i], {"max_new_tokens": 32, **({"temperature": 0.8} if i % 2 else {"temperature": 0})})
              for i in range(6)]

    def run(prompt, params):
        out = generate(spec, {"input_ids": prompt, "sampling_params": params})
        assert "output_ids" in out, out
        return out

    alone = [[run(p, sp) for p, sp in seeded] for _ in range(2)]
    with cf.ThreadPoolExecutor(max_workers=len(seeded) + len(others)) as pool:
        futures = [pool.submit(run, p, sp) for p, sp in others[:3] + seeded + others[3:]]
        batched = [f.result() for f in futures][3:3 + len(seeded)]
    ids = [[o["output_ids"] for o in outs] for outs in (*alone, batched)]
    assert ids[0] == ids[1] == ids[2], f"seeded outputs differ between runs: {ids}"
    assert all(len(o) >= 8 for o in ids[0]), ids[0]
    assert_multi_token([o["meta_info"] for outs in (*alone, batched) for o in outs], "seeded sampled requests")
    other_seed = run(seeded[2][0], {**seeded[2][1], "sampling_seed": 99})["output_ids"]
    assert other_seed != ids[0][2], "another seed gave the same output: the request did not sample"
