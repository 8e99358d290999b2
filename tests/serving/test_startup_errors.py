"""Startup errors: a bad DFLASH setup must stop the server with a non-zero exit and a message naming the value.

The checks run in SGLang's server-argument step of the launcher process. One subprocess imports SGLang once, loads
the plugins exactly as `python -m sglang.launch_server` does, and runs `prepare_server_args` for every bad case
(cheap on 2 cores; the GPU's compute capability is faked as an H100's, so the attention-architecture check runs
too); one real `launch_server` confirms the exit status end to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server
pytest.importorskip("sglang")

PROBE = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from sglang_dflash.serving import startup
startup.gpu_capability = lambda server_args: (9, 0)  # as if on an H100: the attention-architecture check applies
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        args = prepare_server_args(argv)  # 0.5.17 resolves the arguments here (post-init) ...
        getattr(args, "resolve_once", lambda: None)()  # ... 0.5.23 only when the launcher asks
        results[name] = "OK"
    except BaseException as e:  # argparse exits with SystemExit
        results[name] = f"{type(e).__name__}: {e}"
print("RESULTS" + json.dumps(results))
"""


def _variant(src: Path, dst: Path, **changes) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "layer_ids":
            cfg["dflash_config"]["target_layer_ids"] = value
        elif key == "drop_mask":
            cfg["dflash_config"].pop("mask_token_id")
            cfg["dflash_config"].pop("mask_token", None)
            cfg.pop("mask_token_id", None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _truncated(src: Path, dst: Path) -> Path:
    """A copy of the drafter whose model.safetensors lost its last 1,000 bytes (a cut download)."""
    dst = _variant(src, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return dst


@pytest.fixture(scope="module")
def pair(dflash_pair):
    return dflash_pair[:3]


def _argv(target, draft, *extra):
    return ["--model-path", str(target), "--device", "cpu", "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(draft), *extra]


EXPECT = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layer_ids": "target_layer_ids",
    "block": "does not match the drafter's block_size 16",
    "backend": "'foo' is not supported",
    "mask": "mask_token_id",
    "pp": "--pp-size 2",
    "dp_attention": "--enable-dp-attention",
    "pd": "--disaggregation-mode decode",
    "tp_heads": "cannot be split over --tp-size 3",
    "context": "exceeds the drafter's 1024",
    "truncated": "model.safetensors'",  # the file named (then "is truncated ... Fix: download the drafter again")
    "arch": "--attention-backend trtllm_mha: SGLang",  # ours, before SGLang's own check of it (no fix named)
}


def test_bad_setups_are_refused_with_the_value_named(pair, tmp_path):
    root, target, draft = pair
    cases = {
        "good": _argv(target, draft, "--speculative-num-draft-tokens", "16"),
        "vocab": _argv(target, _variant(draft, tmp_path / "vocab", vocab_size=999)),
        "hidden": _argv(target, _variant(draft, tmp_path / "hidden", hidden_size=128)),
        "layer_ids": _argv(target, _variant(draft, tmp_path / "ids", layer_ids=[1, 9])),
        "block": _argv(target, draft, "--speculative-num-draft-tokens", "8"),
        "backend": _argv(target, draft, "--speculative-draft-attention-backend", "foo"),
        "mask": _argv(target, _variant(draft, tmp_path / "mask", drop_mask=True)),
        "pp": _argv(target, draft, "--pp-size", "2"),
        "dp_attention": _argv(target, draft, "--enable-dp-attention", "--tp-size", "2", "--dp-size", "2"),
        "pd": _argv(target, draft, "--disaggregation-mode", "decode"),  # issue #49: refused until served
        "tp_heads": _argv(target, draft, "--tp-size", "3"),  # the drafter has 4 heads
        "context": _argv(target, _variant(draft, tmp_path / "context", max_position_embeddings=1024)),
        "tp2": _argv(target, draft, "--tp-size", "2"),
        "truncated": _argv(target, _truncated(draft, tmp_path / "truncated")),
        "arch": _argv(target, draft, "--attention-backend", "trtllm_mha"),  # the seeds' Qwen3.5 target backend
    }
    env = dict(os.environ, SGLANG_ENABLE_SPEC_V2="1", SGLANG_ENABLE_DFLASH_SPEC_V2="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=240, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert line, f"probe failed:\n{proc.stderr[-3000:]}"
    results = json.loads(line[0][len("RESULTS"):])
    assert results["good"] == "OK", results["good"]
    assert results["tp2"] == "OK", results["tp2"]
    assert "is truncated" in results["truncated"] and "download the drafter again" in results["truncated"]
    for name, needle in EXPECT.items():
        assert results[name] != "OK", f"{name}: accepted, should be refused"
        assert needle in results[name], f"{name}: message does not name the value: {results[name]}"
        assert "Fix" in results[name], f"{name}: message gives no fix: {results[name]}"
    for flag in ("SGLANG_ENABLE_SPEC_V2", "SGLANG_ENABLE_DFLASH_SPEC_V2"):
        notes = [ln for ln in proc.stderr.splitlines() if flag in ln and "accepted and ignored" in ln]
        assert notes, f"no note for {flag}"


def test_launch_server_exits_nonzero(pair):
    from sglang_dflash.testing import CPU_SERVER_ARGS, cpu_server_env, server_argv

    root, target, draft = pair
    argv = server_argv(target, 30009, args=[*CPU_SERVER_ARGS, "--speculative-algorithm", "DFLASH",
                                            "--speculative-draft-model-path", str(draft),
                                            "--speculative-num-draft-tokens", "8"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=cpu_server_env(root / "stub"),
                          start_new_session=True)
    assert proc.returncode != 0
    assert "does not match the drafter's block_size 16" in proc.stdout + proc.stderr


def test_env_switch_selects_builtin_worker(pair):
    """SGLANG_DFLASH_WORKER=builtin leaves SGLang's own DFLASH in place: on CPU it then refuses, as upstream does."""
    from sglang_dflash.testing import worker_env

    root, target, draft = pair
    cases = {"good": _argv(target, draft, "--speculative-num-draft-tokens", "16")}
    env = worker_env(os.environ, builtin=True)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True,
                          timeout=240, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")]
    assert line, f"probe failed:\n{proc.stderr[-3000:]}"
    result = json.loads(line[0][len("RESULTS"):])["good"]
    # upstream's refusal, worded per release (0.5.17: "only supports CUDA and NPU"; 0.5.23: "not supported by ...")
    assert re.search(r"only supports CUDA and NPU|is not supported by \w+ on device 'cpu'", result), result
    assert "builtin DFLASH worker is left in place" in proc.stderr
