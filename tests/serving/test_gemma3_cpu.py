"""Gemma-3 target end to end on CPU: our hidden-state capture hook (serving/capture.py) inside a real server.

SGLang 0.5.17's Gemma3ForCausalLM has no `set_dflash_layers_to_capture`; the plugin installs ours. The target is a
float32 tiny random Gemma-3 (alternating sliding-window (8) and full layers, tied embeddings, embeddings scaled by
sqrt(hidden)); the drafter is trained on the target's greedy continuations (models.build_gemma3_pair) and carries
`input_embedding_scale` = sqrt(hidden) as tiny_drafter_config sets it for Gemma targets. Greedy outputs of concurrent
requests (prompts longer than the window) must equal the same server without speculation, no near-tie excused
(compare.py; this target's smallest top-2 gap on these prompts is 3.1e-3, 700x the float32 noise), and some verify
step must commit several tokens: multi-token commits through the sliding-window layers run only then (with the old
untrained drafter every step committed exactly 1 token). `--dtype float32` is explicit: SGLang downcasts Gemma-3 to
bfloat16 by default.
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
openai = pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, compare_greedy, port  # noqa: E402
from .compare import wait_all_healthy  # noqa: E402
from .models import build_gemma3_pair, random_prompts  # noqa: E402

SPEC_PORT, BASE_PORT = 30004, 30005
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def gemma(dflash_pair):
    root = dflash_pair[0]
    target, draft, info = build_gemma3_pair(root)
    env = cpu_server_env(root / "stub")
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"] + FLOAT32
    base_args = CPU_SERVER_ARGS + FLOAT32
    base = launch_server(target, port(BASE_PORT), root / "gemma3_base.log", base_args, env)
    spec = launch_server(target, port(SPEC_PORT), root / "gemma3_spec.log",
                         args + SPEC_ARGS + ["--speculative-draft-model-path", str(draft)], {**env, **FULL_BLOCK})
    try:
        wait_all_healthy(base, spec)
        yield {"base": base, "spec": spec, "target": str(target), "info": info}
    finally:
        spec.stop()
        base.stop()


def test_gemma3_greedy_equality(gemma):
    base, spec, model, info = gemma["base"], gemma["spec"], gemma["target"], gemma["info"]
    assert info["model_type"] == "gemma3_text" and info["input_embedding_scale"] == 8.0, info
    prompts = random_prompts(8, info["vocab"], seed=61, lo=12, hi=40)
    metas = compare_greedy(base, spec, prompts, max_tokens=MAX_TOKENS, max_workers=16, max_excused_prompts=0)
    assert_multi_token(metas, "tiny Gemma-3 (sliding-window layers)")
    log = spec.log_path.read_text(errors="replace")
    assert "sglang-dflash worker ready" in log and "Gemma3ForCausalLM" in log, "not our worker on a Gemma-3 target"
