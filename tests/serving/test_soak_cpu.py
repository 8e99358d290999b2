"""A soak on CPU (issue #37): a DFLASH server under a mixed load with faults, forced to retract by a small KV pool,
must lose nothing; then SIGTERM under load must end it cleanly.

One DFLASH server (overlap on, SGLang's default; `--max-total-tokens 320 --schedule-conservativeness 0.3` as in
test_scheduling_cpu.py, so 16 clients keep the pool full and the scheduler retracts; the verify width switched at
every step by SGLANG_DFLASH_K_SCHEDULE, full block included, as in test_adaptive_cpu.py) and the shared plain
baseline. `benchmarks/soak.py` runs SOAK_S seconds at concurrency 16 (greedy, seeded sampled, stop strings,
max_tokens 1..96, prompts near the limit, shared prefixes, penalties, OpenAI completions and chat, streams dropped
mid-way, aborts during prefill and during decode, a client that never reads its stream), polling /health and the KV
pool. Asserted: every greedy answer (hundreds) equals the baseline's (float32, no near-tie excused), no request
failed, every fault was sent and survived, /health never failed and a real generate answers at the end, the pool is
back to its idle size (no request running or waiting, no token held; SGLang's own idle check would also have
stopped the scheduler on a leak), the scheduler retracted and verify steps committed several tokens.

Not in this mix: logprob requests. A non-streamed request with return_logprob that is retracted before its first
prefill result is processed loses its first output logprob (N - 1 logprobs for N tokens; found by the soak): SGLang
0.5.17's output streamer (scheduler_components/output_streamer.py, `accept`) emits such a request with no output yet
(0 % force_stream_interval == 0) and moves its logprob offset to max(0, 1) = 1, so logprob 0 is never sent. Plain
decoding has the same bug but rarely retracts that early; a DFLASH request reserves 2 B slots per step, so here it
happens within seconds. benchmarks/soak.py checks logprobs wherever it runs; test_controls_cpu.py checks their
values without retraction. Grammar requests need a grammar backend on the baseline too (it runs none).

Then, in the same module: 16 streams in flight, SIGTERM to the launcher. SGLang 0.5.17 drains (every request in
flight runs to its end, "Gracefully exiting..." every 5 s), asks the schedulers to exit, then SIGKILLs its own
process tree, itself included (exit status -9, by its own hand: the test sends no KILL). Asserted: it exits by itself,
every stream got its whole answer, every process of its tree is gone and its port is free.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")
pytest.importorskip("openai")
if shutil.which("gcc") is None:
    pytest.skip("gcc is needed to build the stub libcuda.so.1", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ lives beside the package

from benchmarks import soak  # noqa: E402
from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, launch_server  # noqa: E402
from sglang_dflash.testing.server import port_in_use, process_tree  # noqa: E402

from .compare import FLOAT32, SPEC_ARGS, log_count, port, wait_all_healthy  # noqa: E402
from .models import TRAIN_PROMPT_SEED, random_prompts  # noqa: E402

PORT = 30011
KV_TOKENS = 320
SOAK_S = 75
CONCURRENCY = 16
MAX_NEW = 96
K_SCHEDULE = "15,15,0,7,15,3"  # every step switches width; the full block recurs
RETRACT_LOG = "Retract requests"
STREAM_TOKENS = 64  # per stream of the SIGTERM burst: SGLang drains them all before it exits
EXIT_S = 180


@pytest.fixture(scope="module")
def servers(dflash_pair, baseline):
    root, target, draft, info = dflash_pair
    args = [a for a in CPU_SERVER_ARGS if a != "--disable-overlap-schedule"]
    args[args.index("--max-total-tokens") + 1] = str(KV_TOKENS)
    args += ["--schedule-conservativeness", "0.3", *FLOAT32, *SPEC_ARGS, "--speculative-draft-model-path", str(draft)]
    env = {**cpu_server_env(root / "stub"), "SGLANG_DFLASH_K_SCHEDULE": K_SCHEDULE}
    spec = launch_server(target, port(PORT), root / "spec_soak.log", args, env)
    try:
        wait_all_healthy(baseline, spec)
        yield {"base": baseline, "spec": spec, "vocab": info["vocab"], "root": root}
    finally:
        spec.stop()


def test_soak_loses_nothing(servers, tmp_path):
    spec, base = servers["spec"], servers["base"]
    # the prompts the drafter was trained on: its drafts are accepted there, so multi-token commits run under load
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(random_prompts(48, servers["vocab"], seed=TRAIN_PROMPT_SEED)))
    retracted_before = log_count(spec, RETRACT_LOG)
    out = tmp_path / "soak.json"
    rc = soak.main(["--url", spec.url, "--baseline-url", base.url, "--duration-s", str(SOAK_S), "--concurrency",
                    str(CONCURRENCY), "--vocab", str(servers["vocab"]), "--max-new-tokens", str(MAX_NEW),
                    "--prompts", str(prompts), "--stall-s", "15", "--server-pid", str(spec.pid),
                    "--weights", json.dumps({"logprob": 0}), "--out", str(out)])
    rep = json.loads(out.read_text())
    shutil.copy(out, servers["root"] / "soak_cpu.json")  # for a look after a failure
    where = f"(report {servers['root'] / 'soak_cpu.json'}, server log {spec.log_path})"
    assert rep["mismatches"] == [], f"greedy answers differ from plain decoding {where}: {rep['mismatches'][:3]}"
    assert rep["errors"] == {} and rep["compare_errors"] == [], f"{rep['error_examples'][:3]} {where}"
    assert rep["compared"] >= 100, f"only {rep['compared']} greedy answers compared {where}"
    for fault, n in rep["faults"].items():
        assert n["sent"] > 0, f"no {fault} was sent {where}"
    assert rep["faults"]["abort_decode"]["aborted"] > 0, rep["faults"]
    assert rep["stalls"] and not any(s["error"] for s in rep["stalls"]), rep["stalls"]
    assert rep["health"]["failures"] == [] and rep["health"]["final_generate_ok"], f"{rep['health']} {where}"
    pool = rep["pool"]
    assert pool["idle_again"] and pool["end"]["num_used_tokens"] == 0, f"KV pool not back to idle: {pool['end']}"
    assert pool["max_used"] > KV_TOKENS // 2, f"the load never filled the pool (max {pool['max_used']} tokens used)"
    assert rep["spec"]["multi_token_answers"] > 0, rep["spec"]
    assert log_count(spec, RETRACT_LOG) > retracted_before, f"the scheduler never retracted {where}"
    assert rep["retracted_answers"] > 0
    assert "memory leak" not in spec.log_path.read_text(errors="replace")
    assert rc == 0 and rep["ok"] and spec.alive()


def _stream(url: str, prompt: list[int], n: int) -> str:
    """A streamed greedy request read to its end: 'done', or the error that ended it."""
    body = json.dumps({"input_ids": prompt, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}}).encode()
    req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for _ in r:
                pass
        return "done"
    except Exception as e:  # the server going away mid-stream: any error is an answer, a hang is not
        return f"{type(e).__name__}"


def test_sigterm_under_load_exits_clean(servers):
    """Runs after the soak (same server): SIGTERM to the launcher while 16 streams run."""
    spec = servers["spec"]
    assert spec.alive()
    prompts = random_prompts(CONCURRENCY, servers["vocab"], seed=5, lo=10, hi=40)
    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(_stream, spec.url, p, STREAM_TOKENS) for p in prompts]
        t0 = time.time()
        while time.time() - t0 < 60 and not (soak.pool(spec.url) or {}).get("num_running_reqs"):
            time.sleep(0.5)
        assert (soak.pool(spec.url) or {}).get("num_running_reqs"), "the burst never started running"
        tree = process_tree(spec.pid)
        assert len(tree) >= 3, f"expected the launcher, scheduler and detokenizer, found {tree}"
        os.kill(spec.pid, signal.SIGTERM)
        try:
            code = spec.proc.wait(timeout=EXIT_S)
        except Exception:
            spec.stop()  # the KILL path, so nothing outlives the test
            pytest.fail(f"the server did not exit within {EXIT_S} s of SIGTERM under load; log tail:\n"
                        f"{spec.log_tail()}")
        answers = [f.result(timeout=60) for f in futures]
    time.sleep(1.0)
    alive = [p for p in tree if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
    assert alive == [], f"processes of the server outlived it: {alive} (exit code {code})"
    assert not port_in_use(spec.host, spec.port), f"port {spec.port} still in use after the server exited"
    log = spec.log_path.read_text(errors="replace")
    assert "Gracefully exiting" in log, f"no graceful drain after SIGTERM; log tail:\n{spec.log_tail()}"
    assert code == 0 or (code == -signal.SIGKILL and "kill_process_tree called" in log), (
        f"exit code {code}, not SGLang's own exit; log tail:\n{spec.log_tail()}")
    assert answers == ["done"] * CONCURRENCY, f"streams cut by the shutdown: {answers}"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"  # gone while reading
