"""Oracle drafts end to end on CPU servers (issue #45 item 2; sglang_dflash/serving/oracle_drafts.py).

The tiny Qwen3 target with model-like dummy weights and the decisive chain head (--load-format dummy,
SGLANG_DFLASH_DUMMY_WEIGHTS=chain: each greedy step emits CHAIN[current token], targets/chain_head.py), a dummy
drafter (its real drafts are never right). A plain server's greedy outputs become the recording
(bench.py's outputs format -> `record`); a DFLASH server with adaptivity off (the full block every step) and
SGLANG_DFLASH_ORACLE_DRAFTS then serves the same prompts. Checked: outputs equal plain decoding's (the verify still
decides), and every request took exactly the verify steps the profile's events predict (position_hash: each step
commits its drafts up to the first miss, + 1), i.e. the realised tau is the profile's, request by request; the
server logs the oracle at start-up and reports no divergence from the recording.

The same check can fail (issue #44 item 1): a third server runs our worker with a planted commit bug (a step that
rejects a draft commits that draft in place of the target's token; injected by a sitecustomize module, no hook in
the package) and its outputs must fail the equality check that the correct worker passes.
"""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

import torch  # noqa: E402

from sglang_dflash import settings  # noqa: E402
from sglang_dflash.kernels.oracle_drafts import position_hash  # noqa: E402
from sglang_dflash.serving.oracle_drafts import key_seed, prompt_key, record  # noqa: E402
from sglang_dflash.targets.chain_head import chain_walk  # noqa: E402
from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import FLOAT32, SPEC_ARGS, check_all, greedy, log_count, port, wait_all_healthy  # noqa: E402
from .models import random_prompts  # noqa: E402

PLAIN_PORT, ORACLE_PORT, PLANTED_PORT = 30070, 30071, 30072
N, B, P, SEED = 40, 16, 0.7, 5
PROFILE = f"geometric:{P},seed:{SEED}"
EXTRA = {"ignore_eos": True}
DUMMY = ["--load-format", "dummy"]


def expected_steps(prompt, n_tokens) -> int:
    """Verify steps the profile predicts for one request of n_tokens outputs: from the bonus at t, the step
    commits the drafts at t+1.. up to the first miss (the recording covers every position < n_tokens), + 1."""
    key = torch.tensor(key_seed(prompt_key(prompt)))
    keep = position_hash(SEED, key, torch.arange(n_tokens + B)) < int(round(P * 2 ** 32))
    t, steps = 0, 0
    while t + 1 < n_tokens:
        a = 0
        while a < B - 1 and keep[t + 1 + a] and t + 1 + a < n_tokens:
            a += 1
        t, steps = t + a + 1, steps + 1
    return steps


# Loaded by every Python process of the planted server (PYTHONPATH): wraps the greedy accept's torch path (the CPU
# worker's) as soon as it is imported, before the worker module takes its name.
PLANTED_BUG = """
import importlib.util, sys

NAME = "sglang_dflash.kernels.greedy_accept"


def _plant(module):
    import torch

    right = module.greedy_accept_torch

    def planted(target_ids, drafts, prefix):
        commit_lens, tokens = module.verify_greedy_ids(drafts, target_ids)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        miss = commit_lens - 1 < drafts.shape[1]  # a draft was rejected: commit it instead of the target's token
        at = (commit_lens - 1).clamp(max=max(drafts.shape[1] - 1, 0))
        if drafts.shape[1]:
            tokens[rows[miss], at[miss]] = drafts[rows[miss], at[miss]]
        return (commit_lens, tokens) + module.commit_outputs(commit_lens, tokens, prefix)

    planted.right = right
    module.greedy_accept_torch = planted


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _plant(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
"""


@pytest.fixture(scope="module")
def run(dflash_pair, tmp_path_factory):
    root, target, draft, info = dflash_pair
    work = tmp_path_factory.mktemp("oracle")
    env = {**cpu_server_env(root / "stub"), settings.DUMMY_WEIGHTS: "chain"}
    prompts = random_prompts(6, info["vocab"], seed=91, lo=6, hi=30)
    plain = launch_server(target, port(PLAIN_PORT), work / "plain.log", CPU_SERVER_ARGS + FLOAT32 + DUMMY, env)
    oracle = planted = None
    try:
        wait_all_healthy(plain)
        outs = [greedy(plain, p, N, EXTRA)["output_ids"] for p in prompts]
        with gzip.open(work / "none.outputs.jsonl.gz", "wt") as f:  # benchmarks/bench.py's format
            f.writelines(json.dumps({"dataset": "random", "uid": i, "prompt": p, "ids": o}) + "\n"
                         for i, (p, o) in enumerate(zip(prompts, outs)))
        record(work / "none.outputs.jsonl.gz", work / "rec.json")
        oracle_env = {**env, settings.ORACLE_DRAFTS: str(work / "rec.json"), settings.ORACLE_PROFILE: PROFILE,
                      settings.ADAPTIVE: "0", settings.LOG_EVERY_S: "0.05"}
        spec_args = CPU_SERVER_ARGS + FLOAT32 + DUMMY + SPEC_ARGS + [
            "--speculative-draft-model-path", str(draft), "--speculative-draft-load-format", "dummy"]
        plant = work / "plant"
        plant.mkdir()
        (plant / "sitecustomize.py").write_text(PLANTED_BUG)
        planted_env = {**oracle_env, "PYTHONPATH": f"{plant}:{env.get('PYTHONPATH', '')}".rstrip(":")}
        oracle = launch_server(target, port(ORACLE_PORT), work / "oracle.log", spec_args, oracle_env)
        planted = launch_server(target, port(PLANTED_PORT), work / "planted.log", spec_args, planted_env)
        wait_all_healthy(oracle, planted)
        answers = [greedy(oracle, p, N, EXTRA) for p in prompts]
        planted_ids = [greedy(planted, p, N, EXTRA)["output_ids"] for p in prompts]
        planted.stop()
        yield {"plain": plain, "oracle": oracle, "prompts": prompts, "plain_ids": outs, "answers": answers,
               "vocab": info["vocab"], "planted_ids": planted_ids}
    finally:
        for server in (planted, oracle):
            if server is not None:
                server.stop()
        plain.stop()


def test_plain_outputs_are_the_chain(run):
    """The chain head decides every greedy step of the plain server: CHAIN walked from the prompt's last token."""
    for prompt, ids in zip(run["prompts"], run["plain_ids"]):
        assert ids == chain_walk(prompt[-1], N, run["vocab"])


def test_outputs_are_plain_decodings(run):
    """On the chain target there is no near-tie to excuse: every output equals plain decoding's."""
    assert [a["output_ids"] for a in run["answers"]] == run["plain_ids"]


def test_the_check_fails_on_a_planted_commit_bug(run):
    """The equality check the correct worker passes fails on a worker that commits a rejected draft: on the chain
    target no near-tie can excuse the difference (the judge replays it on the plain server and finds a gap of the
    chain head's margin)."""
    assert run["planted_ids"] != run["plain_ids"], "the planted bug changed no output: the check cannot fail here"
    with pytest.raises(pytest.fail.Exception, match="not lossless"):
        check_all(run["plain"], run["prompts"], run["plain_ids"], run["planted_ids"], N, max_excused_prompts=0,
                  extra=EXTRA)


def test_steps_are_the_profiles(run):
    """spec_verify_ct = the request's verify steps (these requests finish on their length, whose last step SGLang
    counts too) = the steps the profile's events predict, exactly, for every request that followed the recording."""
    got = [a["meta_info"]["spec_verify_ct"] for a in run["answers"]]
    want = [expected_steps(p, N) for p in run["prompts"]]
    assert got == want, f"verify steps per request {got}, the profile's events predict {want}"
    tau = len(got) * (N - 1) / (sum(want) + len(want))
    assert 1 + P < tau < 1 / (1 - P) + 0.5  # the geometric law's full-block tau (~3.3 at p = 0.7)


def test_start_up_line_and_report(run):
    oracle = run["oracle"]
    assert log_count(oracle, "ORACLE DRAFTS ON") == 1
    assert log_count(oracle, "geometric p=0.7000, seed 5: full-block tau") == 1
    text = oracle.log_path.read_text(errors="replace")
    reports = [line for line in text.splitlines() if "sglang-dflash oracle drafts:" in line]
    assert reports, "no oracle report line in the server log"
    assert '"with a recording": ' in reports[-1] or "'with a recording': 6" in reports[-1]
    assert "left the recording: 0" in reports[-1]
