"""`sglang-dflash serve` builds the right launch_server command, and a missing drafter gets our error.

Fast: the printed command (CPU and GPU flavours, block size read from the drafter, `--` pass-through, SGLang's own
parser accepts it), the `sglang-dflash` subcommands, and the drafter-path check. The real server start of the
README's serve command is in tests/test_readme.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from sglang_dflash import serve
from sglang_dflash.demo import drafter_path
from sglang_dflash.serving.startup import DFlashStartupError, check_draft_model_path


def dry(*args: str) -> tuple[dict, list[str]]:
    """Run `serve --dry-run ARGS` in-process; returns (env assignments, launch_server argv)."""
    out = io.StringIO()
    with redirect_stdout(out):
        serve.main(["--dry-run", *args])
    toks = shlex.split(out.getvalue().strip().splitlines()[-1])
    env = {}
    if toks[0] == "env":
        toks = toks[1:]
        while "=" in toks[0]:
            k, v = toks.pop(0).split("=", 1)
            env[k] = v
    assert toks[1:3] == ["-m", "sglang.launch_server"], toks
    return env, toks[3:]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_cpu_command(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env, argv = dry("--device", "cpu")
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "stub-libcuda" in env["LD_LIBRARY_PATH"]
    assert env["HF_HUB_OFFLINE"] == "1" and int(env["OMP_NUM_THREADS"]) >= 1
    assert flag(argv, "--port") == "30000" and flag(argv, "--device") == "cpu"
    assert flag(argv, "--dtype") == "float32" and flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--speculative-draft-attention-backend") == "torch_native"
    assert int(flag(argv, "--max-total-tokens")) <= 16384  # bounded: SGLang's default reserves ~15 GB on CPU
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert Path(flag(argv, "--speculative-draft-model-path")) == drafter_path()
    assert flag(argv, "--speculative-num-draft-tokens") == "16"


def test_gpu_command_and_passthrough(tmp_path):
    env, argv = dry("--device", "cuda", "--target", str(tmp_path), "--port", "31234", "--", "--log-level", "debug")
    assert env == {}
    assert flag(argv, "--model-path") == str(tmp_path) and flag(argv, "--port") == "31234"
    assert flag(argv, "--attention-backend") == "triton" and flag(argv, "--speculative-draft-attention-backend") == "triton"
    assert "--device" not in argv and "--dtype" not in argv  # GPU: SGLang's defaults (the checkpoint's dtype)
    assert argv[-2:] == ["--log-level", "debug"]


def test_block_size_comes_from_the_drafter(tmp_path):
    cfg = json.loads((drafter_path() / "config.json").read_text())
    cfg["block_size"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, argv = dry("--device", "cpu", "--draft", str(tmp_path), "--target", str(tmp_path))
    assert flag(argv, "--speculative-num-draft-tokens") == "8"


def test_missing_draft_is_named(tmp_path, capsys):
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the stub libcuda before the drafter is read")
    with pytest.raises(SystemExit) as e:  # stops before anything is started
        serve.main(["--device", "cpu", "--target", str(tmp_path), "--draft", str(tmp_path / "nope")])
    assert str(tmp_path / "nope") in str(e.value) and "Fix" in str(e.value)
    # --dry-run only prints: a preset's --dummy DIR is written later, so the block size is left to the worker
    env, argv = dry("--device", "cpu", "--target", str(tmp_path), "--draft", str(tmp_path / "nope"))
    assert "--speculative-num-draft-tokens" not in argv and "does not exist yet" in capsys.readouterr().err


def test_commands_parse_with_sglang():
    """The CPU and GPU commands use only flags and values SGLang 0.5.17's own CLI accepts."""
    pytest.importorskip("sglang")
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    for device in ("cpu", "cuda"):
        _, argv = dry("--device", device)
        ns, unknown = p.parse_known_args(argv)
        assert not unknown, (device, unknown)
        assert ns.speculative_algorithm == "DFLASH" and ns.speculative_num_draft_tokens == 16


def test_subcommands():
    run = lambda *a: subprocess.run([sys.executable, "-m", "sglang_dflash", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=120)
    r = run()
    assert r.returncode == 2 and "serve" in r.stdout and "demo" in r.stdout
    r = run("bogus")
    assert r.returncode != 0 and "'bogus'" in r.stderr and "serve" in r.stderr
    r = run("demo", "--help")
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout
    r = run("serve", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout
    script = Path(sys.executable).parent / "sglang-dflash"
    if script.exists():  # the console script of an installed package
        r = subprocess.run([str(script), "serve", "--dry-run", "--device", "cpu"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "sglang.launch_server" in r.stdout, r.stderr


# ------------------------------------------------------------------------------------ the drafter-path check
def test_draft_path_check(tmp_path, monkeypatch):
    check_draft_model_path(str(drafter_path()))  # a directory: fine
    missing = tmp_path / "no" / "such-drafter"
    with pytest.raises(DFlashStartupError, match="no such directory") as e:
        check_draft_model_path(str(missing))
    assert str(missing) in str(e.value) and "Fix" in str(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DFlashStartupError, match="is a file"):
        check_draft_model_path(str(tmp_path / "file"))
    # owner/name could be a Hub id: accepted online (the hub resolves it), refused offline unless cached
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    check_draft_model_path("someone/some-drafter")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(DFlashStartupError, match="HF_HUB_OFFLINE") as e:
        check_draft_model_path("someone/some-drafter")
    assert "'someone/some-drafter'" in str(e.value)


PROBE = r"""
import sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
try:
    prepare_server_args(sys.argv[1:])
    print("RESULT OK")
except BaseException as e:
    print("RESULT", type(e).__name__, e)
"""


@pytest.mark.server
def test_missing_draft_path_gets_our_error_in_sglang(tmp_path):
    """Through SGLang's own argument handling (as `python -m sglang.launch_server` runs it, plugins loaded): a
    missing drafter directory is reported by us, naming it, before huggingface_hub's "Repo id must be in the form"
    (which is what an absolute path with several slashes otherwise gets)."""
    pytest.importorskip("sglang")
    from sglang_dflash.targets import smollm2

    target = smollm2.default_dir()
    if not (target / "config.json").is_file():
        target = drafter_path()  # any model directory: the check runs before the target is read
    missing = tmp_path / "checkpoints" / "my-drafter"
    argv = ["--model-path", str(target), "--device", "cpu", "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(missing)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=240, env=env)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, r.stderr[-3000:]
    assert "Repo id must be" not in line[0], \
        f"SGLang read the missing drafter before our check ran: sglang_dflash/serving/plugin.py must register " \
        f"startup.check_draft_path_before_alias AROUND speculative_hook._resolve_speculative_algorithm_alias. {line[0]}"
    assert "DFlashStartupError" in line[0] and str(missing) in line[0] and "Fix" in line[0], line[0]
