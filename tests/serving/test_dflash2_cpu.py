"""A DFlash2 drafter through our worker in the real CPU server: greedy equal to plain decoding, and the server drafting
with the candidate selector exactly as the reference engine does.

The drafter is the trained tiny drafter of the serving tests turned DFlash2 (`targets.tiny.as_dflash2`: its backbone,
identity convolutions, a random selector whose transitions reorder the candidates now and then), saved in the
published layout. The worker drafts greedy requests with the selector's argmax path (point-mass drafts, verified by
the same exact rules as DFlash) and, in batches with sampled requests, draws those requests' drafts from the
selector's q at their temperature (verified with min(1, p/q): acceptance.verify_sampled_q; its law at the worker's
accept is tests/serving/test_worker_q_drafts_cpu.py). Checked, full block every step (compare.FULL_BLOCK), overlap
on:
- greedy outputs of concurrent requests equal the plain server's token for token (no tie excused), with multi-token
  commits;
- per prompt, the server's verify steps equal the reference engine's with the same DFlash2 drafter (one step of
  slack: SGLang does not count a request's finishing step), and the same drafter without its selector (plain argmax
  drafts) needs clearly different step counts on these prompts, so a server that skipped the selector would fail;
- a mixed batch of concurrent greedy and seeded sampled requests (temperature, top-p, top-k, min-p): the server says
  it drew drafts from q, every sampled request completes with tokens in the target's processed support and some
  multi-token commits, and the greedy requests beside them still equal plain decoding token for token.
Cannot show: the sampled law through the server (the worker's draws come from the process's generator, not the
request's seed; the law is tested at the worker's accept), CUDA graphs (CPU: eager; on the GPU a sampled DFlash2
batch runs its draft head eagerly after the graph replay, tests/serving/test_draft_head_cpu.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]
torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, assert_valid_sample, check_all  # noqa: E402
from .compare import generate, greedy, port, wait_all_healthy  # noqa: E402
from .models import TRAIN_PROMPT_SEED, random_prompts  # noqa: E402

SPEC_PORT = 30044
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def dflash2(dflash_pair, baseline):
    from transformers import AutoModelForCausalLM

    from sglang_dflash.checkpoint import load_drafter
    from sglang_dflash.targets.tiny import as_dflash2
    from sglang_dflash.testing import save_drafter_dir

    root, target, draft, info = dflash_pair
    plain = load_drafter(draft, dtype=torch.float32)
    drafter = as_dflash2(plain, seed=3)
    draft2 = root / "dflash2draft"
    save_drafter_dir(drafter, target, draft2)
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32 + SPEC_ARGS
    spec = launch_server(target, port(SPEC_PORT), root / "spec_dflash2.log",
                         args + ["--speculative-draft-model-path", str(draft2)],
                         {**cpu_server_env(root / "stub"), **FULL_BLOCK})
    try:
        wait_all_healthy(baseline, spec)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        yield {"base": baseline, "spec": spec, "vocab": info["vocab"], "target": model, "drafter": drafter,
               "plain": plain}
    finally:
        spec.stop()


def _reference_steps(target, drafter, prompts) -> list[int]:
    from sglang_dflash.reference import ReferenceEngine
    from sglang_dflash.sampling import SamplingParams

    with torch.inference_mode():
        out = ReferenceEngine(target, drafter).generate(prompts, SamplingParams(max_new_tokens=MAX_TOKENS))
    return [len(r.commit_lens) for r in out]


def test_dflash2_greedy_equals_plain_and_drafts_like_the_reference(dflash2):
    base, spec, vocab = dflash2["base"], dflash2["spec"], dflash2["vocab"]
    prompts = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)[:8]
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS) for p in prompts]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in prompts]
        spec_out, base_out = [f.result() for f in spec_f], [f.result() for f in base_f]
    check_all(base, prompts, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out], MAX_TOKENS,
              max_excused_prompts=0)
    metas = [s["meta_info"] for s in spec_out]
    assert_multi_token(metas, "a DFlash2 drafter")
    served = [m["spec_verify_ct"] for m in metas]
    ref = _reference_steps(dflash2["target"], dflash2["drafter"], prompts)
    without_selector = _reference_steps(dflash2["target"], dflash2["plain"], prompts)
    assert all(0 <= r - s <= 1 for s, r in zip(served, ref)), (served, ref)
    assert sum(abs(a - b) for a, b in zip(ref, without_selector)) > len(prompts), \
        f"the selector changes too few drafts here to tell it from plain argmax drafts: {ref} vs {without_selector}"
    log = spec.log_path.read_text(errors="replace")
    assert "DFlash2DraftModel" in log, "the server did not build the DFlash2 draft model"


SAMPLED = [{"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0}, {"temperature": 0.6, "top_k": 20},
           {"temperature": 1.2, "min_p": 0.05}]


def test_dflash2_mixed_batch_draws_sampled_drafts_from_q(dflash2):
    base, spec, vocab = dflash2["base"], dflash2["spec"], dflash2["vocab"]
    prompts = random_prompts(48, vocab, seed=TRAIN_PROMPT_SEED)[8:8 + 2 * len(SAMPLED)]
    greedy_prompts, sampled_prompts = prompts[:len(SAMPLED)], prompts[len(SAMPLED):]
    with cf.ThreadPoolExecutor(max_workers=3 * len(SAMPLED)) as pool:  # one batch on the DFLASH server
        # 3x the tokens: a sampled request commits several tokens in a step only now and then on this tiny pair,
        # and 40 tokens of four requests went without one in a CI run (the multi-token check below)
        sampled_f = [pool.submit(generate, spec, {"input_ids": p, "sampling_params": {
            "max_new_tokens": 3 * MAX_TOKENS, "sampling_seed": 5 + i, **params}})
            for i, (p, params) in enumerate(zip(sampled_prompts, SAMPLED))]
        spec_f = [pool.submit(greedy, spec, p, MAX_TOKENS) for p in greedy_prompts]
        base_f = [pool.submit(greedy, base, p, MAX_TOKENS) for p in greedy_prompts]
        sampled, spec_out, base_out = ([f.result() for f in fs] for fs in (sampled_f, spec_f, base_f))
    log = spec.log_path.read_text(errors="replace")
    assert "drawn from the selector's q" in log, "no DFlash2 step drew its sampled rows' drafts from q"
    check_all(base, greedy_prompts, [b["output_ids"] for b in base_out], [s["output_ids"] for s in spec_out],
              MAX_TOKENS, max_excused_prompts=0)
    for prompt, params, r in zip(sampled_prompts, SAMPLED, sampled):
        assert r.get("output_ids"), r
        assert_valid_sample(base, prompt, r["output_ids"], vocab, **params)
    assert_multi_token([r["meta_info"] for r in sampled], "sampled requests with q-drawn DFlash2 drafts")
