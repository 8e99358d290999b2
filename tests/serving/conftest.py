import os
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
