"""Tensor parallelism end to end on CPU: our DFLASH worker at `--tp-size 2` against plain decoding at TP 1.

SGLang's CPU engine runs `--tp-size 2` as two scheduler processes whose collectives go over gloo (the plugin turns
off the PyNccl communicator SGLang 0.5.17 would build on any device; one core per rank via
SGLANG_CPU_OMP_THREADS_BIND). Everything TP-specific in the worker runs here for real: the drafter's heads and MLP
split over the ranks with all-reduces, each rank's draft KV pool holding its own K/V heads, the target's
vocabulary-sharded embedding looked up rank by rank and all-reduced, the greedy draft head's all-gather of each
rank's best (score, id), rank 0's step-time table broadcast to rank 1 (adaptive widths on, the default: before the
share, ranks that chose different widths would run different collectives and hang), and rank 0's sampled outcome
broadcast to rank 1.

The server runs as users run it: overlap scheduling on, adaptive widths on (exploration verifies every width a few
times first, so multi-token commits happen whatever the policy then chooses; asserted). Greedy outputs must equal
plain decoding at TP 1 token for token (no near-tie excused); sampled rows of a mixed batch must lie in the
target's processed support. The sharded forward sums partial products in another order than TP 1, so the
float32 outputs could differ at a near-tie; none is excused and none occurs on these prompts.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]
pytest.importorskip("sglang")
pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, SPEC_ARGS, assert_multi_token, assert_valid_sample, check_all, generate  # noqa: E402
from .compare import greedy, port, wait_all_healthy  # noqa: E402
from .models import TRAIN_PROMPT_SEED, random_prompts  # noqa: E402

TP_PORT = 30043
MAX_TOKENS = 40
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
# two ranks on a 2-core machine: one core each (SGLang's CPU engine otherwise wants a NUMA node per rank)
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def tp(dflash_pair, baseline):
    root, target, draft, info = dflash_pair
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32 + SPEC_ARGS
    args += ["--speculative-draft-model-path", str(draft), "--tp-size", "2"]
    spec = launch_server(target, port(TP_PORT), root / "spec_tp2.log", args,
                         {**cpu_server_env(root / "stub"), **TP_ENV})
    try:
        wait_all_healthy(baseline, spec)
        yield {"base": baseline, "spec": spec, "vocab": info["vocab"]}
    finally:
        spec.stop()


def test_tp2_greedy_equals_plain_decoding(tp):
    base, spec, vocab = tp["base"], tp["spec"], tp["vocab"]
    # the drafter's training prompts (multi-token commits) and unseen ones, all at once
    prompts = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)[:10] + random_prompts(6, vocab, seed=5)
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS) for p in prompts]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in prompts]
        spec_out, base_out = [f.result() for f in spec_f], [f.result() for f in base_f]
    check_all(base, prompts, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], MAX_TOKENS,
              max_excused_prompts=0)
    assert_multi_token([s["meta_info"] for s in spec_out], "--tp-size 2")
    log = spec.log_path.read_text(errors="replace")
    for rank in ("TP0", "TP1"):
        assert any(rank in ln and "sglang-dflash worker ready" in ln for ln in log.splitlines()), \
            f"{rank} did not start our worker"
    assert "adaptive over k" in log, "the TP server must run the adaptive widths (the shared decision table)"


def test_tp2_mixed_greedy_and_sampled_batch(tp):
    """Sampled rows draw random numbers in the acceptance; every rank must commit rank 0's outcome. Greedy rows in
    the same batch stay equal to plain decoding, and every sampled token lies in the target's processed support."""
    base, spec, vocab = tp["base"], tp["spec"], tp["vocab"]
    greedy_p = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)[10:16]
    sampled_p = random_prompts(6, vocab, seed=43)

    def sampled(i, p):
        r = generate(spec, {"input_ids": p, "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                                 "sampling_seed": 7 + i, **SAMPLED}})
        assert "output_ids" in r, r
        return r

    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        samp_f = [pool.submit(sampled, i, p) for i, p in enumerate(sampled_p)]
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS) for p in greedy_p]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in greedy_p]
        samp, spec_out, base_out = ([f.result() for f in fs] for fs in (samp_f, spec_f, base_f))
    check_all(base, greedy_p, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], MAX_TOKENS,
              max_excused_prompts=0)
    for p, r in zip(sampled_p, samp):
        assert r["output_ids"] and r["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        assert_valid_sample(base, p, r["output_ids"], vocab, **SAMPLED)
