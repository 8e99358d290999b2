"""Side-by-side run on one GPU: start, benchmark and stop the servers of each method in turn, then report.

    python -m benchmarks.driver --target T --draft D --out benchmarks/results/RUN [--dummy] -- [bench args]

Methods (``--methods``, in this order by default, so that the greedy cross-check has its baseline first):

- ``none``: the target alone (no speculation);
- ``builtin``: SGLang's own DFLASH worker, selected through our plugin's switch: the server runs with
  ``{--worker-env}`` (default ``SGLANG_DFLASH_WORKER=builtin``); without our plugin installed SGLang runs its builtin
  anyway;
- ``ours``: our DFLASH worker (the plugin's default: the switch variable is removed from the environment). It is
  run only when the plugin is importable and registered as an ``sglang.srt.plugins`` entry point, and its numbers
  are kept only when the server log shows that our worker was used (``--ours-log-marker``); otherwise the method is
  recorded as skipped with the reason, so builtin numbers can never appear under our name.
- ``ours-fixed``: ours with adaptive speculation off (every step verifies the full block, as the builtin does);
- ``ours-k<N>``: ours with the verify width pinned to N drafts per step (``ours-k0``: plain decode steps through
  our worker), to measure each width the adaptive policy chooses from;
- ``ours-tree<N>``: ours-fixed verifying a best-first draft tree of N nodes instead of the chain
  (``SGLANG_DFLASH_TREE=N``; issue #38);
- ``ours-adaptive-tree<N>``: ours (adaptive) with the tree of N nodes as one more shape: the policy chooses per step
  among k = 0, the chain widths and the tree (issue #38 item 4);
- ``<ours method>-oracle`` (``ours-oracle``, ``ours-fixed-oracle``, ``ours-k<N>-oracle``, ...): that method with
  oracle drafts (issue #45, benchmarks only, needs ``--dummy``; ``SGLANG_DFLASH_ORACLE_DRAFTS``,
  sglang_dflash/serving/oracle_drafts.py): the drafter's real pass, then its drafts replaced by plain decoding's
  recorded greedy continuation cut at the misses of ``--oracle-profile`` (default tau:6.5), so the step costs are
  real and the acceptance is the stated one. The recording is ``--oracle-drafts``, or recorded from this run's
  ``none`` outputs (``OUT/none.outputs.jsonl.gz`` -> ``OUT/oracle-recording.json``; run ``none`` first). The
  builtin has no oracle form (the plugin refuses it: no clean hook into its draft); its row of such a run is its
  random-weight step cost, a projection;
- ``<ours method>-inplace`` (``ours-inplace``, ``ours-k0-inplace``, ...): that method with
  ``SGLANG_DFLASH_K0_STATE_IN_PLACE=1`` (a hybrid target's k = 0 steps update the recurrent state in place,
  serving/recurrent_state.py; the default since 2026-11-28, the suffix pins it);
- ``<ours method>-short`` (``ours-short``, ``ours-k3-short-oracle``, ...): that method with
  ``SGLANG_DFLASH_SHORT_DRAFT=1`` (a step of k < B - 1 drafts runs the drafter on k + 1 positions; experimental);
- ``<method>-rerun``: the same server as ``<method>``, run again under its own name. ``--bracket`` appends the
  first method's rerun after all the others, so the report's ``<first>-rerun/<first>`` column is the run's own drift:
  on a host-bound target, plain decoding alone moved by up to 1.7x between runs in one loan, and the first server on
  a fresh machine ran 20-30% slow throughout (benchmarks/results/smollm2-run8-h100). A ratio between methods smaller
  than that drift is not a result.

Every server gets identical arguments (``--common-args``, plus the speculative ones for builtin/ours), or, with
``--preset NAME``, the launch preset's own command for the method (``launch/NAME.sh --dry-run --method M``, with
``--dummy`` its ``--dummy DIR``: exactly what a user of the preset runs), is started
in its own session (setsid) with its PID recorded, polled on ``/health`` for at most ``--wait-s`` seconds while
checking that the PID is alive, and stopped by signalling its process group (TERM, then KILL after
``--stop-wait-s``). Logs: ``OUT/<method>.server.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from sglang_dflash import settings
from sglang_dflash.testing import WORKER_ENV, Server, server_argv as launch_argv

from . import bench, greedy_judge, report
from .report import RERUN  # a method's name with this suffix runs the same server again (--bracket)

DEFAULT_COMMON = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none "
                  "--mem-fraction-static 0.8 --cuda-graph-max-bs-decode 128 --max-running-requests 128 --trust-remote-code")
# no --speculative-num-draft-tokens: both DFLASH workers take the block size from the drafter's config.json
DEFAULT_SPEC = "--speculative-algorithm DFLASH --speculative-draft-attention-backend triton"
PLUGIN_CHECK = (
    "import importlib.metadata as m, sys\n"
    "eps = [e for e in m.entry_points(group='sglang.srt.plugins') if e.value.startswith('sglang_dflash')]\n"
    "assert eps, 'no sglang.srt.plugins entry point from sglang_dflash is installed'\n"
    "mod = eps[0].value.split(':')[0]\n"
    "__import__(mod)\n"
    "print(eps[0].name, eps[0].value)\n")


ORACLE = "-oracle"  # a method name's suffix: oracle drafts (issue #45)
IN_PLACE = "-inplace"  # a method name's suffix: hybrid targets' k = 0 steps update the recurrent state in place
SHORT = "-short"  # short drafts: SGLANG_DFLASH_SHORT_DRAFT=1 (a step of k < B - 1 drafts k + 1 positions)
ORACLE_RECORDING = "<oracle recording>"  # stands for the run's recording in method_variant's environment


def method_variant(method: str) -> tuple[str, dict]:
    """(base method, extra environment) of a method name: ``ours-fixed`` / ``ours-k<N>`` are ours with controls,
    ``ours-tree<N>`` is ours-fixed verifying a draft tree of N nodes (``SGLANG_DFLASH_TREE``),
    ``ours-adaptive-tree<N>`` the adaptive policy with that tree as one more shape, ``<method>-rerun`` is
    ``<method>`` again."""
    if method.endswith(RERUN):
        return method_variant(method[:-len(RERUN)])
    if method.endswith(IN_PLACE):
        base, extra = method_variant(method[:-len(IN_PLACE)])
        if base != "ours":
            raise SystemExit(f"{method}: {IN_PLACE} is a switch of our worker (ours, ours-fixed, ours-k<N>{IN_PLACE})")
        return base, {**extra, settings.K0_STATE_IN_PLACE: "1"}
    if method.endswith(SHORT):
        base, extra = method_variant(method[:-len(SHORT)])
        if base != "ours":
            raise SystemExit(f"{method}: {SHORT} is a switch of our worker (ours, ours-k<N>{SHORT}, ...)")
        return base, {**extra, settings.SHORT_DRAFT: "1"}
    if method.endswith(ORACLE):  # the recording's path is resolved per run (server_env)
        base, extra = method_variant(method[:-len(ORACLE)])
        if base != "ours":
            raise SystemExit(f"{method}: oracle drafts exist for our worker's methods only (ours, ours-fixed, "
                             f"ours-k<N>{ORACLE}); the builtin's row of an oracle run is its step-cost projection")
        return base, {**extra, settings.ORACLE_DRAFTS: ORACLE_RECORDING}
    if method == "ours-fixed":
        return "ours", {settings.ADAPTIVE: "0"}
    m = re.fullmatch(r"ours-k(\d+)", method)
    if m:
        return "ours", {settings.K: m.group(1)}
    m = re.fullmatch(r"ours-tree(\d+)", method)  # the full block drafted every step, a tree of N nodes verified
    if m:
        return "ours", {settings.ADAPTIVE: "0", settings.TREE: m.group(1)}
    m = re.fullmatch(r"ours-adaptive-tree(\d+)", method)  # the policy prices the tree against k = 0 and the chains
    if m:
        return "ours", {settings.TREE: m.group(1)}
    if method in ("none", "builtin", "ours"):
        return method, {}
    raise SystemExit(f"unknown method {method!r}: expected none, builtin, ours, ours-fixed, ours-k<N>, ours-tree<N> or "
                     f"ours-adaptive-tree<N>, optionally followed by {IN_PLACE}, {SHORT}, {ORACLE} or {RERUN}")


ROOT = Path(__file__).resolve().parents[1]


class NoRecording(RuntimeError):
    """An -oracle method with no recording to run on (no --oracle-drafts, and this run's none left no outputs)."""


class PresetRefused(RuntimeError):
    """The launch preset will not build a command for this method (e.g. its BUILTIN_OK=0); the message is its own."""


def preset_script(name: str) -> Path:
    """launch/NAME.sh of this checkout (or NAME itself when it is a path to a script)."""
    path = Path(name) if name.endswith(".sh") else ROOT / "launch" / f"{name}.sh"
    if not path.is_file():
        raise SystemExit(f"--preset {name}: no launch script {path}")
    return path


def preset_command(script: Path, method: str, *, port: int, host: str, python: str, dummy: str | None = None,
                   env: dict | None = None) -> tuple[list[str], dict[str, str | None]]:
    """The preset's own server command for ``method`` (none / builtin / ours), read from its ``--dry-run`` line
    ``env [VAR=V | -u VAR]... PYTHON -m sglang.launch_server ARGS``: (argv, environment changes, None = unset)."""
    cmd = ["bash", str(script), "--dry-run", "--method", method, "--port", str(port), "--host", host]
    cmd += ["--dummy", dummy] if dummy else []
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {}),
                                                                              "PYTHON": python})
    if r.returncode != 0:
        raise PresetRefused(r.stderr.strip() or f"{script.name} --method {method}: exit {r.returncode}")
    toks = shlex.split(r.stdout)
    if toks[:1] != ["env"]:
        raise ValueError(f"{script.name} --dry-run printed no `env ...` command: {r.stdout!r}")
    changes, i = {}, 1
    while i < len(toks) and (toks[i] == "-u" or "=" in toks[i]):
        if toks[i] == "-u":
            changes[toks[i + 1]] = None
            i += 2
        else:
            var, _, val = toks[i].partition("=")
            changes[var] = val
            i += 1
    return toks[i:], changes


def _preset(args, method: str) -> tuple[list[str], dict[str, str | None]]:
    script = preset_script(args.preset)
    dummy = None
    if args.dummy:  # the preset writes its shape only when it runs the server itself, not on --dry-run
        dummy = args.shape_dir or f"/tmp/shape-{script.stem}"
        if not (Path(dummy) / "target" / "config.json").exists():
            subprocess.run([args.python, "-m", "sglang_dflash.targets.shapes", "write", script.stem, dummy],
                           check=True, timeout=300)
    env = dict(kv.partition("=")[::2] for kv in args.preset_env or [])
    return preset_command(script, method, port=args.port, host=args.host, python=args.python, dummy=dummy, env=env)


def server_argv(args, method: str) -> list[str]:
    method = method_variant(method)[0]
    if args.preset:
        return _preset(args, method)[0]
    argv = launch_argv(args.target, args.port, args.host, shlex.split(args.common_args), args.python)
    if args.dummy:
        argv += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if method != "none":
        if not args.draft:
            raise SystemExit(f"method {method} needs --draft")
        argv += ["--speculative-draft-model-path", args.draft] + shlex.split(args.spec_args)
        if args.dummy:
            argv += ["--speculative-draft-load-format", "dummy"]
    return argv


def server_env(args, method: str) -> dict:
    method, extra = method_variant(method)
    env = dict(os.environ)
    for var in (settings.ORACLE_DRAFTS, settings.ORACLE_PROFILE):  # never inherited: only -oracle methods get them
        env.pop(var, None)
    env.update(extra)
    if extra.get(settings.ORACLE_DRAFTS) == ORACLE_RECORDING:
        env[settings.ORACLE_DRAFTS] = str(oracle_recording(args))
        env[settings.ORACLE_PROFILE] = args.oracle_profile
        env.setdefault(settings.LOG_EVERY_S, "5")  # the realised-tau report of a short benchmark level
    env["PYTHONUNBUFFERED"] = "1"
    if args.dummy and args.dummy_weights != "sglang":  # every method serves the same re-drawn target
        env[settings.DUMMY_WEIGHTS] = args.dummy_weights
    var, _, val = args.worker_env.partition("=")
    if method == "builtin":
        env[var] = val
    elif method == "ours":
        env.pop(var, None)
        for kv in args.ours_env or []:
            k, _, v = kv.partition("=")
            env[k] = v
    if args.preset:
        for k, v in _preset(args, method)[1].items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
    return env


def oracle_recording(args) -> Path:
    """--oracle-drafts, or OUT/oracle-recording.json recorded from this run's plain outputs (once)."""
    if args.oracle_drafts:
        return Path(args.oracle_drafts)
    out = Path(args.out)
    path, plain = out / "oracle-recording.json", out / "none.outputs.jsonl.gz"
    if not path.exists():
        if not plain.exists():
            raise NoRecording(f"no oracle recording: pass --oracle-drafts FILE, or run `none` first in this run "
                              f"({plain} is missing)")
        from sglang_dflash.serving.oracle_drafts import record

        print(f"[driver] oracle recording {path} from {plain}: {record(plain, path)}", flush=True)
    return path


def ours_available(python: str) -> tuple[bool, str]:
    try:
        r = subprocess.run([python, "-c", PLUGIN_CHECK], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "plugin check timed out"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"our plugin is not available in this environment ({last})"
    return True, r.stdout.strip()


def write_skip(out: Path, method: str, reason: str, extra: dict | None = None) -> None:
    d = {"method": method, "skipped": reason}
    d.update(extra or {})
    (out / f"{method}.json").write_text(json.dumps(d, indent=1) + "\n")
    print(f"[driver] {method}: SKIPPED - {reason}", flush=True)


def run_method(args, method: str, bench_argv: list[str], out: Path, driver_info: dict,
               judge_against: list[str] | None = None) -> None:
    """Start, benchmark and stop one method's server; with `judge_against` (the bracket's rerun of the baseline),
    judge those methods' greedy outputs against this plain server before it stops (greedy_judge.py)."""
    base = method_variant(method)[0]
    if base == "ours":
        ok, why = ours_available(args.python)
        if not ok:
            write_skip(out, method, why)
            return
        print(f"[driver] ours: plugin found ({why})", flush=True)
    try:
        argv = server_argv(args, method)
        env = server_env(args, method)
    except PresetRefused as e:
        write_skip(out, method, f"the preset refuses it: {e}")
        return
    except NoRecording as e:
        write_skip(out, method, str(e))
        return
    var = args.worker_env.partition("=")[0]
    shown_env = f"{var}={env[var]} " if var in env else (f"(unset {var}) " if base == "ours" else "")
    shown = list(method_variant(method)[1]) + ([settings.ORACLE_PROFILE] if settings.ORACLE_PROFILE in env else [])
    shown_env += "".join(f"{k}={env[k]} " for k in shown)
    cmd = shown_env + " ".join(map(shlex.quote, argv))
    driver_info["server_commands"][method] = cmd
    srv = Server(argv, out / f"{method}.server.log", args.port, args.host, env)
    print(f"[driver] {method}: starting: {cmd}", flush=True)
    t0 = time.time()
    try:
        srv.start()
        print(f"[driver] {method}: server pid {srv.pid}", flush=True)
        try:
            healthy_s = round(srv.wait_healthy(args.wait_s, poll_s=2.0), 1)
            print(f"[driver] {method}: healthy after {healthy_s:.0f} s", flush=True)
        except (RuntimeError, TimeoutError) as e:  # the message ends with the server's log tail
            print(f"[driver] {method}: {str(e).splitlines()[0]}", flush=True)
            write_skip(out, method, str(e), {"server_command": cmd, "start_s": round(time.time() - t0, 1)})
            return
        if base == "ours" and not re.search(args.ours_log_marker, srv.log_path.read_text(errors="replace")):
            write_skip(out, method, f"server came up but its log has no line matching --ours-log-marker "
                       f"{args.ours_log_marker!r}, so it may be SGLang's builtin worker; not reported as ours",
                       {"server_command": cmd})
            return
        bargs = bench.parser().parse_args(bench_argv + ["--url", srv.url, "--method", method, "--out", str(out)])
        result = bench.run(bargs)
        result["driver"] = dict(driver_info, server_command=cmd, server_pid=srv.pid, healthy_s=healthy_s,
                                server_ready_s=round(time.time() - t0, 1))  # (start to the end of the bench)
        (out / f"{method}.json").write_text(json.dumps(result, indent=1) + "\n")
        if judge_against is not None:  # the baseline's rerun, still up: every differing greedy output judged
            greedy_judge.judge_run(out, srv.url, judge_against, baseline=method[:-len(RERUN)],
                                   budget_s=args.judge_s)
    finally:
        srv.stop(args.stop_wait_s)
        print(f"[driver] {method}: server stopped after {time.time() - t0:.0f} s", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.driver", description=__doc__.split("\n\n")[0],
                                epilog="arguments after -- go to benchmarks.bench (not --url/--method/--out)")
    p.add_argument("--target", default=None, help="target model directory (required unless --preset)")
    p.add_argument("--draft", default=None, help="DFlash drafter directory (builtin and ours)")
    p.add_argument("--methods", default="none,builtin,ours")
    p.add_argument("--out", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the servers")
    p.add_argument("--common-args", default=DEFAULT_COMMON, help="launch_server arguments for every method")
    p.add_argument("--spec-args", default=DEFAULT_SPEC, help="extra launch_server arguments for builtin and ours")
    p.add_argument("--dummy", action="store_true",
                   help="random weights: --load-format dummy (+ draft), --skip-tokenizer-init; tau is then a cost "
                        "measurement only")
    p.add_argument("--preset", default=None,
                   help="launch/NAME.sh: each server runs the preset's own command for its method (its --dry-run "
                        "line; --target, --draft, --common-args and --spec-args are then unused)")
    p.add_argument("--preset-env", action="append", help="VAR=VALUE for the preset (e.g. ATTN_BACKEND=...)")
    p.add_argument("--shape-dir", default=None,
                   help="with --preset --dummy: the preset's --dummy DIR (default /tmp/shape-NAME; written if absent)")
    p.add_argument("--worker-env", default=f"{WORKER_ENV}=builtin",
                   help="VAR=VALUE that makes our plugin select SGLang's builtin worker; VAR is unset for ours")
    p.add_argument("--ours-env", action="append", help="extra VAR=VALUE for the ours server (repeatable)")
    p.add_argument("--ours-log-marker", default=r"sglang_dflash",
                   help="regex that must appear in the ours server's log to prove our worker ran")
    p.add_argument("--wait-s", type=float, default=600.0, help="bound on waiting for /health")
    p.add_argument("--stop-wait-s", type=float, default=30.0)
    p.add_argument("--bracket", action="store_true",
                   help=f"run the first method again after the others (as <first>{RERUN}): the run's own drift")
    p.add_argument("--judge-s", type=float, default=300.0,
                   help="with --bracket and a plain first method: seconds for judging the differing greedy outputs "
                        "against the rerun's live server (near-tie or lossless failure: greedy_judge.py); 0 = off")
    p.add_argument("--dummy-weights", choices=settings.DUMMY_INITS, default="chain",
                   help="with --dummy: SGLANG_DFLASH_DUMMY_WEIGHTS for every server: chain (the default: weights "
                        "scaled like a model's plus a decisive head, outputs no bf16 rounding flips, so greedy "
                        "equality is exact; what oracle drafts need), model (those weights alone: context-dependent "
                        "outputs that tie in bf16 every ~20 tokens) or sglang (SGLang's own: loops of one token)")
    p.add_argument("--sglang-dummy-weights", dest="dummy_weights", action="store_const", const="sglang",
                   help="the same as --dummy-weights sglang")
    p.add_argument("--oracle-drafts", default=None,
                   help="recording for the -oracle methods (default: OUT/oracle-recording.json, recorded from this "
                        "run's none outputs; sglang_dflash.serving.oracle_drafts record)")
    p.add_argument("--oracle-profile", default="tau:6.5,seed:0",
                   help="SGLANG_DFLASH_ORACLE_PROFILE of the -oracle methods (geometric:P or tau:T, seed:S)")
    p.add_argument("--title", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_argv = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_argv = argv[:i], argv[i + 1:]
    args = parser().parse_args(argv)
    if not (args.target or args.preset):
        raise SystemExit("--target or --preset is required")
    for bad in ("--url", "--method", "--out"):
        if bad in bench_argv:
            raise SystemExit(f"{bad} after -- is set by the driver; remove it")
    if args.dummy and "--random-weights" not in bench_argv:
        bench_argv.append("--random-weights")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    driver_info = {"command": "python -m benchmarks.driver " + " ".join(map(shlex.quote, argv + (["--"] + bench_argv
                                                                                            if bench_argv else []))),
                   "server_commands": {}}

    def on_signal(signum, frame):  # turn SIGTERM into an exception so the finally blocks stop the server
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        method_variant(m)  # an unknown name stops the run before any server starts
    if any(m.endswith(ORACLE) or m.endswith(ORACLE + RERUN) for m in methods) and not args.dummy:
        raise SystemExit("-oracle methods run on random weights only: add --dummy (the servers refuse them otherwise)")
    if args.bracket and methods and not methods[0].endswith(RERUN):
        methods.append(methods[0] + RERUN)
    for m in methods:
        rerun_of_plain = args.bracket and m == methods[0] + RERUN and method_variant(m)[0] == "none"
        judged = [x for x in methods if x != methods[0]] if rerun_of_plain and args.judge_s > 0 else None
        run_method(args, m, bench_argv, out, driver_info, judge_against=judged)
    (out / "driver.json").write_text(json.dumps(driver_info, indent=1) + "\n")
    name = args.preset or Path(args.target).name
    report.main([str(out), "--title", args.title or f"{name}: " + ", ".join(methods)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
