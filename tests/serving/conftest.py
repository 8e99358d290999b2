import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def dflash_pair(tmp_path_factory):
    """(root, target_dir, draft_dir, info): built once per session, or reused from $SGLANG_DFLASH_TEST_CACHE."""
    pytest.importorskip("sglang")
    from .models import build_pair

    root = Path(os.environ.get("SGLANG_DFLASH_TEST_CACHE") or tmp_path_factory.mktemp("dflash_pair"))
    root.mkdir(parents=True, exist_ok=True)
    target, draft, info = build_pair(root)
    return root, target, draft, info


BASE_PORT = 30001


@pytest.fixture(scope="package")
def baseline(dflash_pair):
    """The no-speculation server on the tiny Qwen3 target, shared by every module that compares against it.

    Launched and returned at once (not waited for): each user waits for it together with its own DFLASH server,
    so the two cold starts overlap. Stopped (process group killed by PID) after the last test of tests/serving
    (package scope; this directory must stay a package): its memory is free again for the tests after it (idle, it
    sleeps: CPU_SERVER_ARGS has --sleep-on-idle). Under pytest-xdist every module that uses it runs on one worker
    (tests/conftest.py), so it starts once."""
    pytest.importorskip("openai")
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub libcuda.so.1")
    from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server

    from .compare import FLOAT32, port, with_grammar

    root, target, _, _ = dflash_pair
    # float32 as the checkpoint is (SGLang's dtype "auto" would serve it in float16: see compare.TIE_TOL); xgrammar
    # and custom logit processors on for test_controls_cpu (a request without them is served as before)
    server = launch_server(target, port(BASE_PORT), root / "base.log", with_grammar(CPU_SERVER_ARGS) + FLOAT32,
                           cpu_server_env(root / "stub"))
    try:
        yield server
    finally:
        server.stop()


SMOLLM2_BASE_PORT = 30006
SMOLLM2_PROMPTS, SMOLLM2_MAX_NEW = 8, 64


class SmolLM2Plain:
    """The plain SmolLM2 server of `smollm2_plain` and its greedy answers (float32, SMOLLM2_MAX_NEW tokens) to the
    first SMOLLM2_PROMPTS chat prompts, asked once, every prompt at once, by the first test that wants them."""

    def __init__(self, server, target, prompts):
        self.server, self.target, self.prompts = server, target, prompts
        self._answers = None

    def answers(self, timeout_s: float = 300.0) -> list[dict]:
        import concurrent.futures as cf

        from .compare import generate, wait_all_healthy

        if self._answers is None:
            wait_all_healthy(self.server)
            body = lambda p: {"input_ids": p, "sampling_params": {"max_new_tokens": SMOLLM2_MAX_NEW,  # noqa: E731
                                                                  "temperature": 0}}
            with cf.ThreadPoolExecutor(len(self.prompts)) as pool:
                self._answers = list(pool.map(lambda p: generate(self.server, body(p), timeout_s), self.prompts))
        return self._answers


@pytest.fixture(scope="package")
def smollm2_plain(dflash_pair):
    """SmolLM2-135M-Instruct (real weights, float32) served by plain decoding, shared by the SmolLM2 tests of
    test_real_targets_cpu and test_tree_cpu (one server start and one set of plain answers instead of two) and by
    test_generate_server_cpu's self-prompts run (--server-url). Launched
    and returned at once like `baseline`; skipped where the SmolLM2 GGUF is not installed."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub libcuda.so.1")
    from sglang_dflash.targets import smollm2
    from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server

    from benchmarks.prompts import chat_prompt_ids

    from .compare import FLOAT32, port

    try:
        smollm2.gguf_path(download=False)
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    root = dflash_pair[0]
    target = smollm2.convert()  # cached: ~20 s once
    prompts = chat_prompt_ids(smollm2.load_tokenizer(target), SMOLLM2_PROMPTS)
    server = launch_server(target, port(SMOLLM2_BASE_PORT), root / "smollm2_base.log", CPU_SERVER_ARGS + FLOAT32,
                           cpu_server_env(root / "stub"))
    try:
        yield SmolLM2Plain(server, target, prompts)
    finally:
        server.stop()
