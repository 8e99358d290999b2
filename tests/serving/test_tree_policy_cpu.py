"""The width policy choosing between trees and chains in the real CPU server (SGLANG_DFLASH_TREE=8 with adaptivity
on, issue #38 item 4): greedy outputs equal plain decoding's, and the policy ran both tree steps and chain steps.

The CPU clock cannot say which shape pays, so the server gets a fixed step-time table (SGLANG_DFLASH_STEP_COSTS)
that prices every shape the same: the choice then follows the acceptance alone (a few tree steps first to learn
the tree's commit, then whichever of the tree and the full chain commits more, the other one probed), the same run
after run. The summary line's histogram (k = "tree" for tree steps) tells what was chosen."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.settings import ADAPTIVE, LOG_EVERY_S, STEP_COSTS, TREE  # noqa: E402
from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, SPEC_ARGS, compare_greedy, log_count, port, wait_all_healthy  # noqa: E402
from .models import random_prompts  # noqa: E402

MAX_TOKENS = 40


def _histogram(log: str) -> dict[str, int]:
    """The last summary line's shape histogram, {"0": n, "3": n, ..., "tree": n}."""
    found = re.findall(r"k histogram \{([^}]*)\}", log)
    assert found, "no speculation summary line in the log"
    return {k: int(n) for k, n in (item.split(":") for item in found[-1].split())}


def test_tree_and_chain_chosen_by_the_policy_greedy_equals_plain(dflash_pair, baseline, tmp_path):
    root, target, draft, info = dflash_pair
    costs = tmp_path / "costs.json"  # every shape costs the same: the acceptance decides
    costs.write_text(json.dumps({k: {"1": 0.01} for k in ("0", "3", "7", "15", "tree")}))
    env = {**cpu_server_env(root / "stub"), TREE: "8", ADAPTIVE: "1", STEP_COSTS: str(costs), LOG_EVERY_S: "0.5"}
    spec = launch_server(target, port(30064), root / "spec_tree_policy.log",
                         CPU_SERVER_ARGS + FLOAT32 + SPEC_ARGS + ["--speculative-draft-model-path", str(draft)], env)
    try:
        wait_all_healthy(baseline, spec)
        prompts = random_prompts(8, info["vocab"], seed=91, lo=8, hi=60)
        for batch in (prompts[:4], prompts[4:]):  # two rounds: the later one runs on learned statistics
            compare_greedy(baseline, spec, batch, max_tokens=MAX_TOKENS, max_workers=8, max_excused_prompts=0)
    finally:
        spec.stop()
    log = spec.log_path.read_text(errors="replace")
    assert log_count(spec, f"tree verify on ({TREE}=8)") >= 1 and "and a tree of 8 nodes" in log
    hist = _histogram(log)
    chain = sum(n for k, n in hist.items() if k != "tree")
    assert hist.get("tree", 0) > 0 and chain > 0, f"the policy did not choose both shapes: {hist}"
