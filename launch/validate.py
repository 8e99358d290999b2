#!/usr/bin/env python3
"""Check every launch script's command against SGLang's own argument parser (no GPU needed).

    python launch/validate.py                 # all scripts x methods x {real, --dummy}
    python launch/validate.py launch/qwen3-8b.sh

For each script it runs `--dry-run` for each method, then parses the printed launch_server arguments with
`sglang.srt.server_args.ServerArgs.add_cli_args` (sglang 0.5.17): unknown flags, bad choices and missing values fail.
It also checks the method contract: `none` has no speculative flags, `builtin` sets the worker switch, `ours` unsets
it, and both speculative methods run DFLASH with a drafter. This validates the flags, not the runtime: the runtime
check is the seed smoke job (benchmarks/gpu_seed_smoke.sh), and what ran on a GPU is the README's Models table.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from sglang_dflash.serving.plugin import WORKER_ENV as SWITCH

HERE = Path(__file__).resolve().parent


def sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def dry_run(script: Path, method: str, dummy: bool) -> tuple[int, str, str]:
    cmd = ["bash", str(script), "--dry-run", "--method", method] + (["--dummy", "/tmp/launch-validate"] if dummy else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout.strip(), r.stderr.strip()


def split_command(line: str) -> tuple[list[str], list[str]]:
    """'env [VAR=V | -u VAR] python3 -m sglang.launch_server ARGS' -> (env part, ARGS)."""
    toks = shlex.split(line)
    assert toks[0] == "env", line
    i = toks.index("-m")
    assert toks[i + 1] == "sglang.launch_server", line
    return toks[1:i - 1], toks[i + 2:]


def check(script: Path, parser: argparse.ArgumentParser) -> list[str]:
    errors = []
    for dummy in (False, True):
        for method in ("none", "builtin", "ours"):
            where = f"{script.name} --method {method}{' --dummy' if dummy else ''}"
            rc, out, err = dry_run(script, method, dummy)
            if rc != 0:
                if method == "builtin" and "cannot serve this target" in err:
                    continue  # a documented refusal (e.g. Gemma-3: no capture hook in SGLang's model)
                errors.append(f"{where}: exit {rc}: {err}")
                continue
            env, args = split_command(out)
            try:
                ns, unknown = parser.parse_known_args(args)
            except (argparse.ArgumentError, SystemExit) as e:
                errors.append(f"{where}: SGLang rejects the arguments: {e}")
                continue
            if unknown:
                errors.append(f"{where}: flags SGLang does not know: {unknown}")
            spec = ns.speculative_algorithm
            if method == "none" and (spec or ns.speculative_draft_model_path):
                errors.append(f"{where}: speculative flags in a no-speculation server")
            if method != "none":
                if spec != "DFLASH" or not ns.speculative_draft_model_path:
                    errors.append(f"{where}: needs --speculative-algorithm DFLASH and a drafter")
                if method == "builtin" and f"{SWITCH}=builtin" not in env:
                    errors.append(f"{where}: builtin must set {SWITCH}=builtin, got env {env}")
                if method == "ours" and env[:2] != ["-u", SWITCH]:
                    errors.append(f"{where}: ours must unset {SWITCH}, got env {env}")
            if dummy and (ns.load_format != "dummy" or not ns.skip_tokenizer_init):
                errors.append(f"{where}: --dummy must serve --load-format dummy --skip-tokenizer-init")
            if dummy and "SGLANG_DFLASH_DUMMY_WEIGHTS=chain" not in env:
                errors.append(f"{where}: --dummy must re-draw the dummy weights like a model's, with the chain head "
                              f"(SGLANG_DFLASH_DUMMY_WEIGHTS=chain), got env {env}")
    return errors


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("scripts", nargs="*", type=Path)
    args = a.parse_args(argv)
    scripts = args.scripts or sorted(p for p in HERE.glob("*.sh") if p.name != "common.sh")
    parser = sglang_parser()
    bad = 0
    for s in scripts:
        errs = check(s, parser)
        print(f"{'ok ' if not errs else 'BAD'} {s.name}")
        for e in errs:
            print(f"    {e}")
        bad += bool(errs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
