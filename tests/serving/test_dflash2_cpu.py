"""A DFlash2 drafter through our worker in the real CPU server: greedy equal to plain decoding, and the server drafting
with the candidate selector exactly as the reference engine does.

The drafter is the trained tiny drafter of the serving tests turned DFlash2 (`targets.tiny.as_dflash2`: its backbone,
identity convolutions, a random selector whose transitions reorder the candidates now and then), saved in the
published layout. The worker drafts every request with the selector's argmax path (point-mass drafts, verified by
the same exact rules as DFlash). Checked, full block every step (compare.FULL_BLOCK), overlap on:
- greedy outputs of concurrent requests equal the plain server's token for token (no tie excused), with multi-token
  commits;
- per prompt, the server's verify steps equal the reference engine's with the same DFlash2 drafter (one step of
  slack: SGLang does not count a request's finishing step), and the same drafter without its selector (plain argmax
  drafts) needs clearly different step counts on these prompts, so a server that skipped the selector would fail;
- a sampled request completes and its tokens lie in the target's processed support.
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


def test_dflash2_sampled_request_lies_in_the_targets_support(dflash2):
    base, spec, vocab = dflash2["base"], dflash2["spec"], dflash2["vocab"]
    prompt = random_prompts(4, vocab, seed=44)[0]
    params = {"temperature": 0.8, "top_p": 0.9}
    r = generate(spec, {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "sampling_seed": 5,
                                                                  **params}})
    assert r.get("output_ids"), r
    assert_valid_sample(base, prompt, r["output_ids"], vocab, **params)
