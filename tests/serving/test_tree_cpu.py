"""Tree verify in the real CPU server (SGLANG_DFLASH_TREE, serving/tree_step.py): lossless, and worth it.

- Tiny Qwen3 pair (the shared no-speculation baseline): greedy outputs with a tree of 8 nodes (overlap scheduling,
  chunked prefill, a small KV pool that retracts, k forced through plain and drafted steps) and of 16 nodes (no
  overlap, the full block every step) equal plain decoding's, with sampled requests (temperature, top-k, top-p,
  min-p) in the same batches: those batches take tree steps too (the sampled tree rule, exact for the greedy rows
  in them, which keep their outputs; the log says a tree step took sampled rows), and every sampled token lies in
  the target's processed support.
- SmolLM2-135M-Instruct with the drafter we ship: greedy outputs with a tree of 16 equal plain decoding's, and the
  server's accept length (completion tokens per verify step) with the tree is at least the chain's, both measured
  on the same server (the reference engine measured 2.59 -> 3.25 on held-out prompts, benchmarks/tree_tau.py).
The other DFLASH servers here run the full block (compare.FULL_BLOCK), so every greedy step is a tree step.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

from sglang_dflash.settings import K_SCHEDULE, TREE  # noqa: E402
from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402

from .compare import (FLOAT32, FULL_BLOCK, SPEC_ARGS, assert_multi_token, assert_valid_sample, check_all,  # noqa: E402
                      compare_greedy, generate, log_count, port, wait_all_healthy)
from .models import random_prompts  # noqa: E402

PORTS = {8: 30060, 16: 30061}
SCHEDULE = "1,1,0,3,1,15,0,0,1,7"
MAX_TOKENS = 40
# the sampled requests of the mixed batches: each control the sampled tree rule maps (sampling.processed_probs)
SAMPLED = [{"temperature": 0.9}, {"temperature": 0.8, "top_k": 5}, {"temperature": 1.1, "top_p": 0.8, "min_p": 0.05}]


@pytest.fixture(scope="module")
def tree_servers(dflash_pair, baseline):
    root, target, draft, info = dflash_pair
    env = cpu_server_env(root / "stub")
    overlap = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"]
    overlap[overlap.index("--max-total-tokens") + 1] = "400"  # a small pool: requests retract and come back
    spec = [*FLOAT32, *SPEC_ARGS, "--speculative-draft-model-path", str(draft)]
    servers = {
        # k forced through a cycle (test hook): tree steps at every k > 0 (the hook's drafted steps take the tree;
        # the policy records them under the tree's own key), plain steps between them
        8: launch_server(target, port(PORTS[8]), root / "spec_tree8.log",
                         overlap + ["--chunked-prefill-size", "16", *spec], {**env, K_SCHEDULE: SCHEDULE, TREE: "8"}),
        16: launch_server(target, port(PORTS[16]), root / "spec_tree16.log", CPU_SERVER_ARGS + spec,
                          {**env, **FULL_BLOCK, TREE: "16"}),
    }
    try:
        wait_all_healthy(baseline, *servers.values())
        yield {"base": baseline, **servers, "vocab": info["vocab"]}
    finally:
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("size", [8, 16])
def test_tree_greedy_equals_plain_decoding(tree_servers, size):
    base, spec, vocab = tree_servers["base"], tree_servers[size], tree_servers["vocab"]
    prompts = random_prompts(10, vocab, seed=81, lo=8, hi=60)
    sampled_prompt = random_prompts(1, vocab, seed=82, lo=10, hi=11)[0]
    with cf.ThreadPoolExecutor(len(SAMPLED)) as pool:  # sampled requests share batches with the greedy ones
        sampled = [pool.submit(generate, spec, {"input_ids": sampled_prompt, "sampling_params": {
            "max_new_tokens": 24, "sampling_seed": i + 1, **params}}) for i, params in enumerate(SAMPLED)]
        metas = compare_greedy(base, spec, prompts, max_tokens=MAX_TOKENS, max_workers=20, max_excused_prompts=0)
        for f, params in zip(sampled, SAMPLED):
            assert_valid_sample(base, sampled_prompt, f.result()["output_ids"], vocab, **params)
    assert log_count(spec, f"tree verify on ({TREE}={size})") >= 1, "the tree switch was not in force"
    assert log_count(spec, f"first tree verify step ({size} nodes") >= 1, "no tree step ran"
    assert log_count(spec, f"first sampled tree step ({size} nodes") == 1, "no tree step took sampled rows"
    assert_multi_token(metas, f"greedy requests with a tree of {size}")
    # no CUDA graphs on the CPU: the start-up line says so, and every counted tree step ran eagerly
    from benchmarks.tree_graph_check import startup_line, tree_counts

    log = spec.log_path.read_text(errors="replace")
    assert startup_line(log) == f"tree steps ({size} nodes): verify eager (no target verify graphs); tree build eager"
    counts = tree_counts(log)
    assert counts and counts["verify_graphed"] == counts["built_in_graph"] == 0
    assert counts["verify_eager"] == counts["built_eagerly"] == counts["steps"] >= 1


@pytest.mark.slow
def test_smollm2_tree_equality_and_accept_length(dflash_pair, smollm2_plain):
    """SmolLM2 + the shipped drafter: a plain server and one tree-16 server. The tree server answers every prompt
    twice, first as chain steps (each request carries a zero logit_bias, a control that keeps its batch on the chain
    step and changes no logit), then as tree steps: greedy outputs of both equal plain decoding's, and the accept
    length (completion tokens per verify step) of the tree is at least the chain's on the same server."""
    from .test_real_targets_cpu import ASSET, SMOLLM2_MAX_EXCUSED, SMOLLM2_TIE_TOL, accept_length

    root = dflash_pair[0]
    target, prompts = smollm2_plain.target, smollm2_plain.prompts  # the shared plain server's: 64 new tokens
    env = cpu_server_env(root / "stub")
    base_args = CPU_SERVER_ARGS + FLOAT32
    spec_args = [a for a in base_args if a != "--disable-overlap-schedule"] + SPEC_ARGS + [
        "--speculative-draft-model-path", str(ASSET)]

    def body(p, **extra):
        return {"input_ids": p, "sampling_params": {"max_new_tokens": 64, "temperature": 0, **extra}}

    def run_all(server, **extra):  # every prompt at once
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: generate(server, body(p, **extra), 300.0), prompts))

    base = smollm2_plain.server
    spec = launch_server(target, port(30063), root / "smollm2_tree.log", spec_args, {**env, **FULL_BLOCK, TREE: "16"})
    try:
        wait_all_healthy(base, spec)
        answers = {"chain": run_all(spec, logit_bias={"0": 0.0}), "tree": run_all(spec)}
        base_out = smollm2_plain.answers()
        for name in ("chain", "tree"):
            check_all(base, prompts, [b["output_ids"] for b in base_out],
                      [s["output_ids"] for s in answers[name]], 64, SMOLLM2_MAX_EXCUSED, tie_tol=SMOLLM2_TIE_TOL)
    finally:
        spec.stop()
    assert log_count(spec, "first tree verify step (16 nodes") == 1, "no tree step ran"
    chain, tree = accept_length(answers["chain"]), accept_length(answers["tree"])
    print(f"SmolLM2-135M-Instruct + shipped drafter, greedy, CPU server: accept length chain {chain:.3f}, "
          f"tree of 16 {tree:.3f}")
    assert_multi_token([a["meta_info"] for a in answers["tree"]], "SmolLM2 with a tree of 16")
    assert tree >= chain, f"tree accept length {tree:.3f} < chain {chain:.3f}"
