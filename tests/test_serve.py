"""`sglang-dflash serve` builds the right launch_server command, runs it as a child, says when it serves, and a
missing drafter gets our error.

Fast: the printed command (CPU and GPU flavours, block size read from the drafter, `--` pass-through,
`--no-speculation` = the same command less the DFLASH flags, SGLang's own parser accepts them), the `sglang-dflash` subcommands, the drafter-path check, and the child's lifecycle with a stand-in
server (the ready line only once /health answers; Ctrl-C / SIGTERM stop the child's whole process group; exit status
passed on). The real server start of the README's serve command is in tests/test_readme.py.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
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
    assert flag(argv, "--grammar-backend") == "xgrammar"  # structured output on CPU (the plugin's CPU grammar path)


def test_gpu_command_and_passthrough(tmp_path):
    env, argv = dry("--device", "cuda", "--target", str(tmp_path), "--port", "31234", "--", "--log-level", "debug")
    assert env == {}
    assert flag(argv, "--model-path") == str(tmp_path) and flag(argv, "--port") == "31234"
    assert flag(argv, "--attention-backend") == "triton" and flag(argv, "--speculative-draft-attention-backend") == "triton"
    assert "--device" not in argv and "--dtype" not in argv  # GPU: SGLang's defaults (the checkpoint's dtype)
    assert argv[-2:] == ["--log-level", "debug"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_speculation_is_the_same_command_without_dflash(device, tmp_path):
    """--no-speculation (the baseline to compare against): the speculative command less its --speculative-* flags
    and nothing else, same environment; --draft is accepted and unused, so an A/B pair differs by the flag alone."""
    spec_env, spec = dry("--device", device, "--port", "31234", "--", "--log-level", "debug")
    plain_env, plain = dry("--device", device, "--port", "31234", "--no-speculation", "--", "--log-level", "debug")
    assert not [a for a in plain if a.startswith("--speculative")], plain
    i = spec.index("--speculative-algorithm")
    j = max(k for k, a in enumerate(spec) if a.startswith("--speculative")) + 2
    assert plain == spec[:i] + spec[j:], (spec, plain)
    assert plain_env == spec_env
    _, with_draft = dry("--device", device, "--port", "31234", "--no-speculation", "--draft", str(tmp_path / "nope"),
                        "--", "--log-level", "debug")
    assert with_draft == plain


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
        _, argv = dry("--device", device, "--no-speculation")
        ns, unknown = p.parse_known_args(argv)
        assert not unknown and ns.speculative_algorithm is None, (device, unknown)


def test_subcommands():
    run = lambda *a: subprocess.run([sys.executable, "-m", "sglang_dflash", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=120)
    r = run()
    assert r.returncode == 2 and "serve" in r.stdout and "demo" in r.stdout and "convert GGUF_FILE OUT_DIR" in r.stdout
    r = run("bogus")
    assert r.returncode != 0 and "'bogus'" in r.stderr and "serve" in r.stderr
    r = run("demo", "--help")
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout
    r = run("serve", "--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout
    r = run("convert", "--help")
    assert r.returncode == 0 and "GGUF_FILE" in r.stdout and "--tokenizer" in r.stdout
    script = Path(sys.executable).parent / "sglang-dflash"
    if script.exists():  # the console script of an installed package
        r = subprocess.run([str(script), "serve", "--dry-run", "--device", "cpu"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "sglang.launch_server" in r.stdout, r.stderr


# ------------------------------------------------------------------------------------ the child's lifecycle
# A stand-in for launch_server: prints, answers /health after HEALTH_AFTER_S, starts a grandchild (SGLang starts a
# scheduler and a detokenizer) and exits with EXIT_CODE if that is set.
FAKE_SERVER = r"""
import http.server, os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("fake server starting, grandchild", grandchild.pid, flush=True)
if os.environ.get("EXIT_CODE"):
    sys.exit(int(os.environ["EXIT_CODE"]))
time.sleep(float(os.environ["HEALTH_AFTER_S"]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a):
        pass
print("fake server listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Health).serve_forever()
"""
RUN = ("import sys; from sglang_dflash.serve import ServeCommand, run\n"
       "sys.exit(run(ServeCommand({}, [sys.executable, '-c', sys.argv[1]]), '127.0.0.1', int(sys.argv[2]), 0.2))")


def start_serve(port: int, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN, FAKE_SERVER, str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PORT=str(port), HEALTH_AFTER_S="1.5", **env))


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float = 60) -> list[str]:
    lines, t0 = [], time.time()
    while time.time() - t0 < timeout_s:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not printed; got {lines}")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().split()[2] == "Z"  # a zombie waiting for its parent to reap it


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ready_line_after_health_and_signals_stop_the_group(sig):
    from sglang_dflash.testing.server import free_port

    port = free_port()
    proc = start_serve(port)
    try:
        lines = read_until(proc, "sglang-dflash: serving")
        assert lines[-1] == serve.ready_line("127.0.0.1", port) == \
            f"sglang-dflash: serving the OpenAI API at http://127.0.0.1:{port}/v1"
        before = lines[:-1]
        assert any("fake server listening" in ln for ln in before), "printed before /health could answer"
        assert not any("ready" in ln.lower() for ln in before), before
        grandchild = int(next(ln for ln in before if "grandchild" in ln).split()[-1])
        proc.send_signal(sig)  # a terminal's Ctrl-C reaches serve only: the server runs in its own process group
        assert proc.wait(timeout=60) == 128 + sig
        t0 = time.time()
        while not gone(grandchild) and time.time() - t0 < 10:
            time.sleep(0.1)
        assert gone(grandchild), "the server's children outlived serve"
        rest = proc.stdout.read()
        assert rest.count("sglang-dflash: serving") == 0  # said once
        # the launcher alone got the stop (SIGINT): its KeyboardInterrupt traceback is not shown, the stop is clean
        assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    finally:
        proc.kill()
        proc.wait()


def test_server_exit_status_is_passed_on():
    from sglang_dflash.testing.server import free_port

    proc = start_serve(free_port(), EXIT_CODE="3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "serving" not in out, out


def test_a_taken_port_is_refused(capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        code = serve.run(serve.ServeCommand({}, [sys.executable, "-c", "pass"]), "127.0.0.1", s.getsockname()[1])
    assert code == 1 and "already in use" in capsys.readouterr().err


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


# ------------------------------------------------------------------------ start-up refusals as one line
LAUNCHER_REFUSAL = """\
[2026-11-27 13:11:44] Cuda graph is disabled because of using torch native attention backend
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/sglang/srt/plugins/hook_registry.py", line 390, in wrapper
    return hook(original_fn, *args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/sglang_dflash/config.py", line 296, in validate_against_target
    raise DFlashConfigError("vocab_size", self.vocab_size, f"the target's vocab_size is {vocab}",
sglang_dflash.config.DFlashConfigError: drafter config: vocab_size=999: the target's vocab_size is 49152. Fix: use a drafter trained for this target
"""
# SGLang's scheduler logs its exception (here a plain ValueError raised in our code, naming the fix), then the
# launcher, told by SIGQUIT, kills the tree
SCHEDULER_REFUSAL = """\
[2026-11-27 13:12:23] Load weight end. elapsed=0.06 s, type=DFlashDraftModel
[2026-11-27 13:12:23] Scheduler hit an exception: Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 4931, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "/work/sglang_dflash/adaptive.py", line 55, in parse_widths
    raise ValueError(f"{name}={text!r}: {bad} outside 0..{top} (a step verifies at most block_size - 1 = {top} "
ValueError: SGLANG_DFLASH_WIDTHS='0,3,99': [99] outside 0..15; fix: use values in 0..15

[2026-11-27 13:12:23] Received sigquit from a child process. It usually means the child failed.
"""
OTHER_ERROR = """\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 10, in run
    x = 1 / 0
ZeroDivisionError: division by zero

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 12, in run
    raise RuntimeError("no fix here")
RuntimeError: no fix here
[2026-11-27 13:12:24] next line
"""
INTERRUPTED = """\
Process Process-1:
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/zmq/sugar/poll.py", line 106, in poll
    return zmq_poll(self.sockets, timeout=timeout)
KeyboardInterrupt
[2026-11-27 13:10:42] INFO:     Shutting down
"""


def _filtered(text: str, stopping: bool = False, idle_at_end: bool = False) -> tuple[str, serve.ServerOutput]:
    shown = []
    out = serve.ServerOutput(shown.append, serve.refusal_names(), stopping=lambda: stopping)
    for line in text.splitlines(keepends=True):
        out.feed(line)
    if idle_at_end:
        out.idle()
    else:
        out.finish()
    return "".join(shown), out


def test_refusal_names_are_the_classes():
    from sglang_dflash.config import DFlashConfigError
    from sglang_dflash.serving.capture import CaptureUnsupportedError
    from sglang_dflash.settings import SettingsError

    names = serve.refusal_names()
    assert {DFlashConfigError.__name__, DFlashStartupError.__name__, CaptureUnsupportedError.__name__,
            SettingsError.__name__, "UnsupportedSGLangVersion"} <= names


def test_a_refusal_traceback_is_dropped_and_its_message_kept():
    shown, out = _filtered(LAUNCHER_REFUSAL)
    assert shown == LAUNCHER_REFUSAL.splitlines(keepends=True)[0]  # the log line before it, nothing else
    assert out.refusal == "drafter config: vocab_size=999: the target's vocab_size is 49152. Fix: use a drafter " \
                          "trained for this target"
    shown, out = _filtered(SCHEDULER_REFUSAL)
    assert "Traceback" not in shown and "File " not in shown and "Scheduler hit an exception" not in shown
    assert "Load weight end" in shown and shown.rstrip().endswith("It usually means the child failed.")
    assert out.refusal.startswith("SGLANG_DFLASH_WIDTHS='0,3,99'") and "fix:" in out.refusal
    # the exception line last with nothing after it: complete once the stream goes quiet
    shown, out = _filtered(LAUNCHER_REFUSAL, idle_at_end=True)
    assert out.refusal and "Traceback" not in shown and out.held is None


def test_other_tracebacks_are_printed_whole():
    shown, out = _filtered(OTHER_ERROR)
    assert shown == OTHER_ERROR and out.refusal is None  # chained, not ours (no sglang_dflash frame, no fix)
    shown, out = _filtered(INTERRUPTED)
    assert shown == INTERRUPTED
    shown, out = _filtered(INTERRUPTED, stopping=True)  # after serve forwarded a Ctrl-C: the stop is clean
    assert shown == "Process Process-1:\n[2026-11-27 13:10:42] INFO:     Shutting down\n"
    # another process's log line inside a traceback is printed at once, not held with it
    lines = LAUNCHER_REFUSAL.splitlines(keepends=True)
    mixed = "".join(lines[:3] + ["[2026-11-27 13:11:45] another process's line\n"] + lines[3:])
    shown, out = _filtered(mixed)
    assert "another process's line" in shown and "Traceback" not in shown and out.refusal


@pytest.mark.server
def test_a_refused_start_ends_with_one_error_line(tmp_path):
    """The real thing, on CPU: a target whose vocabulary is not the drafter's is refused in SGLang's server-argument
    step; serve prints no traceback, ends with `sglang-dflash: error: ... Fix: ...` and exits non-zero (~20 s)."""
    pytest.importorskip("sglang")
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the stub libcuda")
    from sglang_dflash.testing.checkpoints import save_tiny_target
    from sglang_dflash.testing.server import free_port

    save_tiny_target(tmp_path / "target", vocab_size=512)  # the shipped drafter's vocabulary is 49152
    r = subprocess.run([sys.executable, "-m", "sglang_dflash", "serve", "--device", "cpu", "--target",
                        str(tmp_path / "target"), "--port", str(free_port())], capture_output=True, text=True,
                       timeout=400, cwd=Path(serve.__file__).parents[1])
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0, r.stderr[-3000:]
    assert last.startswith("sglang-dflash: error: drafter config: vocab_size=49152") and "Fix:" in last, \
        r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
