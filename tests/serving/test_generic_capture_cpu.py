"""The generic DFLASH hidden-state capture (serving/capture.py) inside real CPU servers.

- Qwen2 (SGLang 0.5.17's Qwen2ForCausalLM has no DFLASH capture hook, so the generic one serves it): a tiny float32
  target with a drafter trained on its greedy continuations; greedy outputs of concurrent requests must equal the same
  server without speculation (no near-tie excused) and some verify step must commit several tokens.
- Mistral and Phi-3 shapes (SGLang serves both as Llama subclasses, with Llama's native hook): with
  SGLANG_DFLASH_CAPTURE=check the generic hooks run beside the native capture inside SGLang's own forward, and every
  forward compares the two row for row (torch.equal); a difference raises in the scheduler and the requests fail.
  So the generic capture produces exactly the native hidden states, on prefill and verify batches alike.
"""

from __future__ import annotations

import re
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, compare_greedy, greedy, port  # noqa: E402
from .compare import wait_all_healthy  # noqa: E402
from .models import build_family_pair, random_prompts  # noqa: E402

QWEN2_SPEC_PORT, QWEN2_BASE_PORT, CHECK_PORT = 30040, 30041, 30042
MAX_TOKENS = 32


def test_qwen2_generic_capture_is_lossless(dflash_pair):
    root = dflash_pair[0]
    target, draft, info = build_family_pair(root, "qwen2")
    assert info["arch"] == "Qwen2ForCausalLM", info
    env = cpu_server_env(root / "stub")
    base = launch_server(target, port(QWEN2_BASE_PORT), root / "qwen2_base.log", CPU_SERVER_ARGS + FLOAT32, env)
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32  # overlap on: the default
    spec = launch_server(target, port(QWEN2_SPEC_PORT), root / "qwen2_spec.log",
                         args + SPEC_ARGS + ["--speculative-draft-model-path", str(draft)], {**env, **FULL_BLOCK})
    try:
        wait_all_healthy(base, spec)
        prompts = random_prompts(8, info["vocab"], seed=71, lo=8, hi=40)
        metas = compare_greedy(base, spec, prompts, max_tokens=MAX_TOKENS, max_workers=16, max_excused_prompts=0)
        assert_multi_token(metas, "tiny Qwen2 through the generic capture")
        log = spec.log_path.read_text(errors="replace")
        assert "captured by sglang-dflash's generic layer hooks" in log and "Qwen2ForCausalLM" in log, \
            "the Qwen2 target did not go through the generic capture"
    finally:
        spec.stop()
        base.stop()


@pytest.mark.parametrize("arch", ["mistral", "phi3"])
def test_generic_capture_equals_native(dflash_pair, arch):
    root = dflash_pair[0]
    target, draft, info = build_family_pair(root, arch, train_steps=0)
    env = cpu_server_env(root / "stub", {"SGLANG_DFLASH_CAPTURE": "check"})
    spec = launch_server(target, port(CHECK_PORT), root / f"{arch}_check.log",
                         CPU_SERVER_ARGS + FLOAT32 + SPEC_ARGS + ["--speculative-draft-model-path", str(draft)],
                         {**env, **FULL_BLOCK})
    try:
        wait_all_healthy(spec)
        for prompt in random_prompts(4, info["vocab"], seed=73, lo=8, hi=30):
            out = greedy(spec, prompt, 24)
            assert "output_ids" in out and len(out["output_ids"]) == 24, out
        log = spec.log_path.read_text(errors="replace")
        assert "SGLANG_DFLASH_CAPTURE=check" in log and info["arch"] in log, "the check mode did not run"
        assert "differs from the native one" not in log, log[-3000:]
        counts = [int(n) for n in re.findall(r"equal to the native one on (\d+) forwards", log)]
        # 4 prompts x (1 prefill + >= 1 verify per few tokens): at least 8 compared forwards
        assert counts and max(counts) >= 8, f"too few compared forwards: {counts}"
    finally:
        spec.stop()
