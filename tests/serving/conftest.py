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
    (package scope; this directory must stay a package): an idle SGLang server busy-polls about one CPU core, so a
    session-scoped one would slow every test collected after tests/serving."""
    pytest.importorskip("openai")
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stub libcuda.so.1")
    from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server

    from .compare import FLOAT32, port

    root, target, _, _ = dflash_pair
    # float32 as the checkpoint is (SGLang's dtype "auto" would serve it in float16: see compare.TIE_TOL)
    server = launch_server(target, port(BASE_PORT), root / "base.log", CPU_SERVER_ARGS + FLOAT32,
                           cpu_server_env(root / "stub"))
    try:
        yield server
    finally:
        server.stop()
