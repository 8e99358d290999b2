"""Launch presets: shell syntax, dry-run commands, the method contract, and SGLang's own argument parser."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dflash.serving.plugin import WORKER_ENV

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = sorted(p for p in LAUNCH.glob("*.sh") if p.name != "common.sh")


def dry(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "--dry-run", *args], capture_output=True, text=True, timeout=30)


def test_presets_exist():
    names = {p.stem for p in SCRIPTS}
    assert {"gemma-4-26b-a4b-it", "gemma-4-31b-it", "qwen3-8b", "qwen3.5-35b-a3b", "llama3.1-8b-instruct",
            "smollm2-135m", "gemma-3-270m", "gpt-oss-20b"} <= names


@pytest.mark.parametrize("script", SCRIPTS + [LAUNCH / "common.sh"], ids=lambda p: p.name)
def test_bash_syntax(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_dry_run_methods(script):
    r = dry(script, "--method", "none")
    assert r.returncode == 0, r.stderr
    toks = shlex.split(r.stdout)
    assert toks[0] == "env" and "sglang.launch_server" in toks and "--speculative-algorithm" not in toks
    r = dry(script, "--method", "ours", "--port", "31000", "--", "--log-level", "debug")
    assert r.returncode == 0, r.stderr
    toks = shlex.split(r.stdout)
    assert toks[1:3] == ["-u", WORKER_ENV]
    assert toks[toks.index("--speculative-algorithm") + 1] == "DFLASH"
    assert "--speculative-num-draft-tokens" not in toks  # the server takes the block size from the drafter
    assert toks[toks.index("--port") + 1] == "31000" and toks[-2:] == ["--log-level", "debug"]
    r = dry(script, "--method", "builtin")
    if script.stem == "gemma-3-270m":  # SGLang's Gemma3 model has no DFLASH capture hook
        assert r.returncode == 2 and "cannot serve" in r.stderr
    else:
        assert r.returncode == 0 and shlex.split(r.stdout)[1] == f"{WORKER_ENV}=builtin"


def test_switch_default_is_the_plugins():
    """common.sh is shell and cannot import the plugin's WORKER_ENV: its default must spell the same name."""
    text = (LAUNCH / "common.sh").read_text()
    assert text.count("${DFLASH_WORKER_ENV:-") == text.count(f"${{DFLASH_WORKER_ENV:-{WORKER_ENV}=builtin}}") >= 1


def test_switch_name_is_a_parameter():
    r = subprocess.run(["bash", str(LAUNCH / "qwen3-8b.sh"), "--dry-run", "--method", "builtin"], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "DFLASH_WORKER_ENV": "MY_SWITCH=sglang"})
    assert shlex.split(r.stdout)[1] == "MY_SWITCH=sglang"


def test_gemma4_26b_recipe():
    toks = shlex.split(dry(LAUNCH / "gemma-4-26b-a4b-it.sh", "--method", "ours").stdout)
    get = lambda f: toks[toks.index(f) + 1]  # noqa: E731
    assert get("--attention-backend") == "triton" and get("--speculative-draft-attention-backend") == "fa4"
    assert get("--chunked-prefill-size") == "32768"
    # prefill graphs stop at 8192 tokens: at the chunk size they left both DFLASH workers out of memory at start-up
    # on an H200 (benchmarks/results/seed-recipes)
    assert get("--cuda-graph-max-bs-prefill") == "8192"


@pytest.mark.parametrize("preset,plain,spec", [("gemma-4-26b-a4b-it", 0.85, 0.80), ("gemma-4-31b-it", 0.85, 0.75)])
def test_gemma4_speculative_methods_leave_room_for_their_graphs(preset, plain, spec):
    """The DFLASH methods' verify, draft and width graphs come out of what --mem-fraction-static leaves: at the
    recipe's 0.85 on an H200 ours had 0.57 GB left on the 26B and ran out on the 31B (results/seed-recipes). SGLang
    takes the last value of a repeated flag, so the speculative methods' own fraction must come last."""
    def fraction(method):
        toks = shlex.split(dry(LAUNCH / f"{preset}.sh", "--method", method).stdout)
        return float([toks[i + 1] for i, t in enumerate(toks) if t == "--mem-fraction-static"][-1])

    assert fraction("none") == plain and fraction("ours") == fraction("builtin") == spec


def test_dummy_mode_and_bad_options():
    toks = shlex.split(dry(LAUNCH / "qwen3-8b.sh", "--dummy", "/tmp/q8").stdout)
    assert toks[toks.index("--model-path") + 1] == "/tmp/q8/target"
    assert toks[toks.index("--speculative-draft-model-path") + 1] == "/tmp/q8/draft"
    assert "--skip-tokenizer-init" in toks and toks[toks.index("--speculative-draft-load-format") + 1] == "dummy"
    assert dry(LAUNCH / "qwen3-8b.sh", "--method", "eagle").returncode == 2
    assert dry(LAUNCH / "qwen3-8b.sh", "--bogus").returncode == 2


def test_flags_parse_with_sglang():
    """Every command of every preset parses with sglang 0.5.17's own CLI (skipped without sglang)."""
    pytest.importorskip("sglang")
    r = subprocess.run([sys.executable, str(LAUNCH / "validate.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok ") == len(SCRIPTS)


def test_defaults_are_paths_the_package_creates():
    """No preset points at a directory nothing creates: local defaults are the shipped drafter or the cache
    directories that smollm2.convert() / gemma3.convert() write (run by the preset itself on first use)."""
    for script in SCRIPTS:
        toks = shlex.split(dry(script).stdout)
        get = lambda f: toks[toks.index(f) + 1]  # noqa: E731
        for path in (get("--model-path"), get("--speculative-draft-model-path")):
            assert not path.startswith("checkpoints/"), (script.name, path)
    home_cache = Path.home() / ".cache" / "sglang_dflash"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    toks = shlex.split(subprocess.run(["bash", str(LAUNCH / "smollm2-135m.sh"), "--dry-run"], capture_output=True,
                                      text=True, env=env).stdout)
    assert toks[toks.index("--model-path") + 1] == str(home_cache / "SmolLM2-135M-Instruct")
    draft = Path(toks[toks.index("--speculative-draft-model-path") + 1])
    assert (draft / "config.json").is_file() and draft.name == "SmolLM2-135M-Instruct-DFlash-b16"
    toks = shlex.split(subprocess.run(["bash", str(LAUNCH / "gemma-3-270m.sh"), "--dry-run"], capture_output=True,
                                      text=True, env=env).stdout)
    assert toks[toks.index("--model-path") + 1] == str(home_cache / "gemma-3-270m")
    draft = Path(toks[toks.index("--speculative-draft-model-path") + 1])
    assert (draft / "config.json").is_file() and draft.name == "gemma-3-270m-DFlash-b16"


def test_cpu_flag_hands_over_to_serve():
    """--cpu: the preset's target and drafter go to `sglang-dflash serve --device cpu`, which prints the CPU command."""
    pytest.importorskip("torch")
    env = dict(__import__("os").environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(LAUNCH / "smollm2-135m.sh"), "--dry-run", "--cpu", "--port", "30005", "--",
                        "--log-level", "debug"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    toks = shlex.split(r.stdout.strip().splitlines()[-1])
    get = lambda f: toks[toks.index(f) + 1]  # noqa: E731
    assert "SGLANG_USE_CPU_ENGINE=1" in toks and get("--device") == "cpu" and get("--port") == "30005"
    assert get("--attention-backend") == "torch_native" and get("--speculative-draft-attention-backend") == "torch_native"
    assert get("--speculative-num-draft-tokens") == "16" and toks[-2:] == ["--log-level", "debug"]
    assert "--cuda-graph-max-bs-decode" not in toks  # the preset's GPU flags are not carried over
    r = subprocess.run(["bash", str(LAUNCH / "smollm2-135m.sh"), "--dry-run", "--cpu", "--method", "builtin"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--method ours" in r.stderr and "--method none" in r.stderr


def test_cpu_flag_method_none_is_plain_decoding():
    """--cpu --method none: `serve --no-speculation`, the same CPU command as --method ours less the DFLASH flags
    (and with --dummy, less the drafter's dummy load format)."""
    pytest.importorskip("torch")
    env = dict(__import__("os").environ, PYTHON=sys.executable)

    def cmd(*args):
        r = subprocess.run(["bash", str(LAUNCH / "smollm2-135m.sh"), "--dry-run", "--cpu", "--port", "30005", *args],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return shlex.split(r.stdout.strip().splitlines()[-1]), r.stderr

    plain, err = cmd("--method", "none", "--", "--log-level", "debug")
    ours, _ = cmd("--method", "ours", "--", "--log-level", "debug")
    assert "--no-speculation" in err and not [t for t in plain if t.startswith("--speculative")], plain
    assert plain == [t for i, t in enumerate(ours) if not _spec_token(ours, i)], (ours, plain)
    assert plain[-2:] == ["--log-level", "debug"] and "SGLANG_USE_CPU_ENGINE=1" in plain
    dummy, _ = cmd("--method", "none", "--dummy", "/nonexistent-dummy-dir")
    assert "--load-format" in dummy and not [t for t in dummy if t.startswith("--speculative")], dummy


def _spec_token(toks, i):
    """Whether toks[i] is a --speculative-* flag or its value."""
    return toks[i].startswith("--speculative") or (i > 0 and toks[i - 1].startswith("--speculative"))


def test_pd_pair_commands():
    """launch/pd/serve.sh: the preset's own command as a prefill and a decode server on GPUs 0 and 1 (ours with
    SGLANG_DFLASH_PD=1, the switch our start-up asks for), the router in front on the preset's port; the builtin is
    refused (SGLang 0.5.17's DFLASH has no prefill-decode relay)."""
    pd = LAUNCH / "pd" / "serve.sh"
    assert subprocess.run(["bash", "-n", str(pd)]).returncode == 0
    r = subprocess.run(["bash", str(pd), "qwen3-8b", "--dry-run", "--", "--log-level", "debug"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    prefill, decode, router = (shlex.split(line) for line in r.stdout.strip().splitlines())
    for toks, mode, port, gpu in ((prefill, "prefill", "30001", "0"), (decode, "decode", "30002", "1")):
        assert toks[0] == "SGLANG_DFLASH_PD=1" and "sglang.launch_server" in toks and "--speculative-algorithm" in toks
        assert toks[toks.index("--disaggregation-mode") + 1] == mode and toks[toks.index("--port") + 1] == port
        assert toks[toks.index("--base-gpu-id") + 1] == gpu and "--log-level" in toks
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "8998"
    assert router[router.index("--prefill") + 1:router.index("--prefill") + 3] == ["http://127.0.0.1:30001", "8998"]
    assert "sglang_router.launch_router" in router and router[router.index("--port") + 1] == "30000"
    plain = subprocess.run(["bash", str(pd), "qwen3-8b", "--method", "none", "--dry-run"], capture_output=True,
                           text=True, timeout=30).stdout.splitlines()
    assert not any("SGLANG_DFLASH_PD" in line or "--speculative-algorithm" in line for line in plain[:2])
    refused = subprocess.run(["bash", str(pd), "qwen3-8b", "--method", "builtin", "--dry-run"], capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode == 2 and "#36140" in refused.stderr
