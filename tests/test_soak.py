"""benchmarks/soak.py without SGLang: its request mix and answer checks, and whole soaks against the fake server
(benchmarks/fake_server.py), clean and with planted faults (a corrupted token, a pool that leaks) that it must report.
The soak against a real DFLASH server is tests/serving/test_soak_cpu.py."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import soak  # noqa: E402
from sglang_dflash.testing import free_port  # noqa: E402


def _mix(**kw):
    args = dict(prompts=[[7, 8, 9, 10], list(range(5, 40))], vocab=1000, max_new=64, input_limit=200, grammar=False,
                model="m", seed=3)
    args.update(kw)
    return soak.Mix(**args)


def test_mix_is_seeded_and_stays_under_the_limit():
    mix = _mix()
    a = [mix.next(random.Random(1)) for _ in range(3)]
    b = [_mix().next(random.Random(1)) for _ in range(3)]
    assert [s["body"] for s in a] == [s["body"] for s in b]
    rng, kinds = random.Random(2), set()
    for _ in range(2000):
        s = mix.next(rng)
        kinds.add(s["kind"])
        body = s["body"]
        prompt = body.get("input_ids", body.get("prompt", []))
        n = body.get("sampling_params", {}).get("max_new_tokens", body.get("max_tokens"))
        assert 1 <= n <= 64 and len(prompt) + n <= 200, (s["kind"], len(prompt), n)
        if s["kind"] == "long":
            assert len(prompt) >= 200 - 34
    assert kinds == set(soak.WEIGHTS) - {"grammar"}  # no grammar backend: no grammar request
    assert "grammar" in {_mix(grammar=True).next(rng)["kind"] for _ in range(500)}
    # a server without a tokenizer (--skip-tokenizer-init, the random-weight shapes): token-id requests only
    no_tok = {_mix(tokenizer=False).next(rng)["kind"] for _ in range(2000)}
    assert no_tok == set(soak.WEIGHTS) - {"grammar"} - soak.TOKENIZER_KINDS


def test_stop_strings_come_from_earlier_outputs():
    mix = _mix(weights={"stop": 1})
    rng = random.Random(0)
    assert all("stop" not in mix.next(rng)["body"]["sampling_params"] for _ in range(20))  # nothing remembered yet
    mix.remember({"text": "hello world", "output_ids": [11, 12, 13]})
    for _ in range(50):
        sp = mix.next(rng)["body"]["sampling_params"]
        assert sp.get("stop", [""])[0] in "hello world" and sp.get("stop_token_ids", [11])[0] in (11, 12, 13)


def test_answer_checks_name_what_is_wrong():
    def rec(**kw):
        r = {"kind": "greedy", "api": "generate", "fault": None, "error": None, "output_ids": [1, 2], "text": "ab",
             "finish": "length", "meta": {}, "body": {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}}
        r.update(kw)
        return soak.check_answer(r, vocab=100)

    assert rec()["error"] is None
    assert rec(output_ids=[1, 2, 3])["error_kind"] == "too long"
    assert rec(output_ids=[1, 100])["error_kind"] == "bad token"
    assert rec(output_ids=[])["error_kind"] == "empty"
    assert rec(finish="abort")["error_kind"] == "aborted"  # nobody aborted it
    assert rec(finish="abort", fault="abort_decode")["error"] is None
    grammar = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "regex": soak.REGEX}}
    assert rec(body=grammar, finish="stop", text="yes, fine")["error"] is None
    assert rec(body=grammar, finish="stop", text="Yes")["error_kind"] == "grammar"
    logprob = {"input_ids": [5], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    assert rec(body=logprob, meta={"output_token_logprobs": [[-0.1, 1, None]]})["error_kind"] == "logprobs"


@pytest.fixture
def fake():
    procs = []

    def start(*extra):
        port = free_port()
        argv = [sys.executable, "-m", "benchmarks.fake_server", "--port", str(port), "--fake-step-s", "0.002",
                "--fake-input-limit", "300", *extra]
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"http://127.0.0.1:{port}"
        t0 = time.time()
        while time.time() - t0 < 30:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                return url
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(url)

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


def _run(tmp_path, url, base, *extra):
    out = tmp_path / "soak.json"
    rc = soak.main(["--url", url, "--baseline-url", base, "--duration-s", "3", "--concurrency", "6", "--vocab",
                    "1000", "--max-new-tokens", "48", "--stall-s", "1", "--idle-timeout-s", "3", "--out", str(out),
                    *extra])
    return rc, json.loads(out.read_text())


def test_soak_of_a_lossless_server_is_clean(fake, tmp_path):
    """Every kind runs, every greedy answer is compared and equal, every fault is sent and survived, the pool is
    back to idle, and the report says ok."""
    url, base = fake("--speculative-algorithm", "DFLASH", "--fake-tau", "4"), fake()
    rc, rep = _run(tmp_path, url, base, "--weights", json.dumps({k: 1 for k in soak.WEIGHTS}))
    assert rc == 0 and rep["ok"], rep
    assert set(rep["by_kind"]) == set(soak.WEIGHTS) - {"grammar"}
    assert rep["compared"] > 20 and rep["mismatches"] == [] and rep["errors"] == {}
    assert all(f["sent"] > 0 for f in rep["faults"].values()), rep["faults"]
    assert rep["faults"]["abort_decode"]["aborted"] > 0 and rep["stalls"] and not any(s["error"] for s in rep["stalls"])
    assert rep["pool"]["idle_again"] and rep["pool"]["max_used"] > 0 and rep["health"]["final_generate_ok"]
    assert rep["spec"]["multi_token_answers"] > 0
    assert rep["server"]["reserve"] == 32  # 2 x speculative_num_draft_tokens
    assert rep["command"] and rep["date"]


def test_soak_reports_a_corrupted_token_and_a_leak(fake, tmp_path):
    """Planted faults: one token of every fifth request changed (a lossless bug) and a pool that never gets its
    tokens back. The soak must name the mismatches (position, plain top-2 gap, not excused), find the pool not
    idle, and fail."""
    url, base = fake("--speculative-algorithm", "DFLASH", "--fake-corrupt", "5", "--fake-leak"), fake()
    rc, rep = _run(tmp_path, url, base, "--stall-clients", "0", "--duration-s", "1.5", "--concurrency", "3")
    assert rc == 1 and not rep["ok"]
    bad = rep["mismatches"]
    assert bad and all(not m["excused"] and m["position"] == 2 and m["gap"] == pytest.approx(1.0) for m in bad
                       if m["what"] == "tokens"), bad[:3]
    assert rep["failures"] == len(bad) and "request" in bad[0]
    assert not rep["pool"]["idle_again"] and rep["pool"]["end"]["num_used_tokens"] > 0


def test_logprob_diff_lets_near_tied_tokens_trade_ranks_and_nothing_else():
    """GPU soak, 2026-11-28: every logprob answer of a bf16 random-weight target "differed" from plain decoding's with
    the same output ids, because the second place of a top-2 list is a near-tie there (plain decoding swaps it at
    another batch shape too). Ranks are compared by value: a swap within the tolerance is no mismatch, a rank whose
    value moved is, and so is another committed token."""
    base = {"output_token_logprobs": [[-0.01, 7, None], [-0.02, 9, None]],
            "output_top_logprobs": [[[-0.01, 7, None], [-5.000, 3, None]], [[-0.02, 9, None], [-6.0, 4, None]]]}
    swapped = {"output_token_logprobs": [[-0.01, 7, None], [-0.02, 9, None]],
               "output_top_logprobs": [[[-0.01, 7, None], [-5.003, 8, None]], [[-0.02, 9, None], [-6.0, 4, None]]]}
    worst, where = soak._logprob_diff(swapped, base)
    assert worst == pytest.approx(0.003) and where["key"] == "output_top_logprobs" and where["rank"] == 1
    moved = {**swapped, "output_top_logprobs": [[[-0.01, 7, None], [-5.5, 8, None]], [[-0.02, 9, None], [-6.0, 4, None]]]}
    assert soak._logprob_diff(moved, base)[0] == pytest.approx(0.5)
    other = {**base, "output_token_logprobs": [[-0.01, 7, None], [-0.02, 8, None]]}
    assert soak._logprob_diff(other, base)[0] == math.inf
    shorter = {**base, "output_top_logprobs": [[[-0.01, 7, None]], [[-0.02, 9, None], [-6.0, 4, None]]]}
    assert soak._logprob_diff(shorter, base)[0] == math.inf
    assert soak._logprob_diff(base, base) == (0.0, None)
