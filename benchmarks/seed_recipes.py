"""The seed recipes as published: every launch preset started on a GPU with its exact flags, and one table of it.

    python -m benchmarks.seed_recipes run --out /tmp/seed-smoke      # on the GPU (benchmarks/gpu_seed_smoke.sh)
    python -m benchmarks.seed_recipes table DIR                       # anywhere: DIR/table.md + DIR/table.json

`run` takes the recipes (RECIPES: each launch preset, plus the seed's published backends where they differ from the
preset's) in order and, for each method of a recipe, starts the preset's own command with `--dummy` through
`benchmarks.driver --preset` (exact-shape random weights: cost and equality, never acceptance), waits for /health
(bounded), records the seconds to healthy, runs a short greedy load at c = 1, 8, 32 and compares every greedy output
with the preset's `none` run. One method is one phase; a phase already in OUT/KEY is skipped, and a phase starts only
while the deadline leaves PHASE_S for it, so calls of under 9 minutes run back to back and resume where the last one
stopped. A recipe with all its methods done gets its record OUT/KEY.json; one already recorded (in OUT or in
`--done`, the committed results) is skipped. A recipe that needs more GPU memory than the device has is recorded as
`needs <kind>` and runs on the first call that has one; one whose draft attention is fa4 waits until the CUTLASS DSL
is staged (`benchmarks/gpu_stage.sh fa4`).

`table` turns the records into one table: device, status, seconds to healthy (none / ours / builtin), greedy equal
N / N against the preset's none, step cost (plain decode steps per speculative step, benchmarks/report.py) at
c = 1 / 8 / 32 for ours and the builtin, and the draft attention backend each server ran. A recipe without a record
is listed as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import bench, driver, report

CONCURRENCY = (1, 8, 32)
PHASE_S = 300.0  # a phase starts only with this much time left: a start (70-185 s, more with ours' width graphs) + load
WAIT_S = 420.0  # the bound on /health
PENDING = "needs "  # a status that is no result yet: the recipe runs again where it can


@dataclass(frozen=True)
class Recipe:
    preset: str  # launch/<preset>.sh
    variant: str = ""  # "" = the preset as committed
    env: dict = field(default_factory=dict)  # the preset's variables for the variant (ATTN_BACKEND, ...)
    methods: tuple[str, ...] = ("none", "ours", "builtin")
    gpu_gib: int = 0  # GPU memory the start needs beyond an 80 GB H100 (0: fits one)
    device: str = "nvidia-h100-x1"  # the smallest lent kind it fits
    note: str = ""

    @property
    def key(self) -> str:
        return self.preset + (f"@{self.variant}" if self.variant else "")


RECIPES = (
    Recipe("qwen3-8b"),
    Recipe("llama3.1-8b-instruct"),
    Recipe("gpt-oss-20b"),
    Recipe("gemma-4-26b-a4b-it", note="draft attention fa4, the seed's"),
    Recipe("gemma-4-31b-it", gpu_gib=100, device="nvidia-h200",
           note="draft attention fa4, the seed's; 58.5 GB of bf16 weights: the speculative methods' 0.75 x 80 GB "
                "leaves no KV cache, and their graphs need ~20 GB beyond plain decoding's"),
    Recipe("qwen3.5-35b-a3b", "published", {"ATTN_BACKEND": "trtllm_mha", "DRAFT_ATTN_BACKEND": "fa4"},
           ("ours", "builtin"), note="the seed's own backends (trtllm_mha target, fa4 draft): a start-up refusal "
                                     "before any model loads is the expected result off Blackwell"),
    Recipe("qwen3.5-35b-a3b", gpu_gib=100, device="nvidia-h200",
           note="about 70 GB of bf16 weights: more than the preset's 0.8 x 80 GB"),
    Recipe("smollm2-135m"),
    Recipe("gemma-3-270m"),
)


def bench_args(recipe: Recipe) -> list[str]:
    from sglang_dflash.targets import shapes

    vocab = shapes.get(recipe.preset).target["vocab_size"]
    return ["--datasets", "random", "--temperatures", "0", "--concurrency", ",".join(map(str, CONCURRENCY)),
            "--max-new-tokens", "128", "--ignore-eos", "--random-input-len", "128", "--random-vocab",
            str(vocab - 1000), "--rounds", "1", "--min-convs", "4", "--warmup", "4", "--no-progress"]


def driver_argv(recipe: Recipe, method: str, out: Path, *, port: int, python: str, wait_s: float) -> list[str]:
    """One phase: the driver on the preset's own command for one method."""
    argv = ["--preset", recipe.preset, "--dummy", "--methods", method, "--out", str(out), "--port", str(port),
            "--python", python, "--wait-s", f"{wait_s:.0f}", "--stop-wait-s", "30",
            "--title", f"{recipe.key}: the preset's command, exact-shape random weights"]
    for k, v in recipe.env.items():
        argv += ["--preset-env", f"{k}={v}"]
    return argv + ["--"] + bench_args(recipe)


def draft_backend(recipe: Recipe, python: str = "python3") -> str | None:
    """The draft attention backend the preset's ours command asks for."""
    argv = driver.preset_command(driver.preset_script(recipe.preset), "ours", port=0, host="127.0.0.1",
                                 python=python, env=recipe.env)[0]
    flag = "--speculative-draft-attention-backend"
    return argv[argv.index(flag) + 1] if flag in argv else None


def fa4_staged() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "quack"))


def gpu_mib() -> int:
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30)
    return int(q.stdout.split()[0])


def recorded(key: str, *dirs: Path) -> bool:
    for d in dirs:
        f = d / f"{key}.json"
        if f.is_file() and not json.loads(f.read_text())["status"].startswith(PENDING):
            return True
    return False


def run_phase(argv: list[str], timeout_s: float) -> int:
    """The driver in its own process; past timeout_s it gets SIGTERM, on which it stops its server (by group)."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.driver", *argv], cwd=driver.ROOT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


class JobRunning(RuntimeError):
    pass


@contextlib.contextmanager
def one_job(out: Path):
    """OUT/.job.pid while a job runs there: a second job started on the same folder (and so on the same GPU and
    port) would kill the first one's server and overwrite its phase, as happened on 2026-11-28 (the gemma-4-31b-it
    row of results/seed-recipes/README.md). Refused instead; a pid file whose process is gone is taken over."""
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".job.pid"
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pid = None
    except PermissionError:  # alive, another user's
        pass
    if pid is not None and pid != os.getpid():
        raise JobRunning(f"a seed smoke job (pid {pid}) is running in {out}: wait for it (its log says DONE) or stop "
                         f"it; a second job there would kill its server")
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def run(args) -> int:
    try:
        with one_job(Path(args.out)):
            return _run(args)
    except JobRunning as e:
        print(f"[seed] {e}", file=sys.stderr, flush=True)
        return 2


def _run(args) -> int:
    deadline = time.time() + args.deadline_s
    out, done = Path(args.out), [Path(d) for d in args.done or []]
    names = args.recipes.split(",") if args.recipes else None
    mib = args.gpu_mib or gpu_mib()
    for r in RECIPES:
        rerun = r.key in args.rerun.split(",")
        if (names and r.key not in names and r.preset not in names) or recorded(r.key, out, *([] if rerun else done)):
            continue
        if r.gpu_gib and mib < r.gpu_gib * 1024:
            write_record(r, out, status=f"{PENDING}{r.device}: {r.note} (this GPU has {mib} MiB)")
            continue
        if draft_backend(r, args.python) == "fa4" and not fa4_staged():
            print(f"[seed] {r.key}: waits for fa4 (benchmarks/gpu_stage.sh fa4)", flush=True)
            continue
        run_dir = out / r.key
        for m in r.methods:
            if (run_dir / f"{m}.json").exists():
                continue
            left = deadline - time.time()
            if left < PHASE_S:
                print(f"[seed] {left:.0f} s left, less than a phase: {r.key} {m} and later ones wait for the next "
                      "call", flush=True)
                return 0
            print(f"[seed] {r.key}: {m} ({left:.0f} s left)", flush=True)
            run_phase(driver_argv(r, m, run_dir, port=args.port, python=args.python,
                                  wait_s=min(WAIT_S, left - 120)), left - 15)
        if all((run_dir / f"{m}.json").exists() for m in r.methods):
            write_record(r, out)
    return 0


# ------------------------------------------------------------------------------------------------ records
_EXC = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?([A-Za-z_][\w.]*(?:Error|Exception)):\s*(.+)$")


def start_failure(reason: str, log: str) -> tuple[str, str]:
    """(status, reason) of a server that never became healthy, from the driver's reason and the server log."""
    if "not healthy after" in reason:
        return "timed out", reason.splitlines()[0]
    if "exited with" not in reason:
        return "not run", reason.splitlines()[0][:300]
    errors = [m for m in map(_EXC.match, (log or reason).splitlines()) if m]
    what = f"{errors[-1].group(1).rsplit('.', 1)[-1]}: {errors[-1].group(2)}"[:300] if errors else "no error line"
    if "Load weight begin" in log:
        return "failed after loading", what
    return "refused at start-up", what


def server_log(run_dir: Path, method: str) -> str:
    """The method's server log (the driver's, gzipped or not), or ''."""
    for f in (run_dir / f"{method}.server.log", run_dir / f"{method}.server.log.gz"):
        if f.exists():
            return (gzip.open(f, "rt", errors="replace") if f.suffix == ".gz" else f.open(errors="replace")).read()
    return ""


def method_record(run_dir: Path, method: str, summary: dict) -> dict:
    d = json.loads((run_dir / f"{method}.json").read_text())
    cmd = d.get("server_command") or (d.get("driver") or {}).get("server_command")
    if d.get("skipped"):
        if d["skipped"].startswith("the preset refuses it"):
            return {"status": "preset refuses", "reason": d["skipped"].split(": ", 1)[1][:300]}
        status, why = start_failure(d["skipped"], server_log(run_dir, method))
        return {"status": status, "reason": why, "start_s": d.get("start_s"), "command": cmd}
    levels = {r["concurrency"]: r["methods"].get(method, {}) for r in summary["rows"] if r["temperature"] == 0}
    cross = (summary["crosscheck"].get(method) or {}).get("random")
    server = d.get("server") or {}
    return {"status": "served" if not any(l.get("errors") for l in levels.values()) else "served with errors",
            "healthy_s": (d.get("driver") or {}).get("healthy_s"),
            "attention_backend": server.get("attention_backend"),
            "draft_backend": server.get("speculative_draft_attention_backend"),
            "greedy_equal": [cross["exact"], cross["compared"]] if cross else None,
            "tok_s": {str(c): l.get("output_tok_s") for c, l in sorted(levels.items())},
            "step_cost": {str(c): l.get("step_cost_ratio") for c, l in sorted(levels.items())
                          if l.get("step_cost_ratio") is not None},
            "command": cmd, "env": d.get("env")}


def write_record(recipe: Recipe, out: Path, status: str | None = None) -> dict:
    rec = {"recipe": recipe.key, "preset": recipe.preset, "variant": recipe.variant, "preset_env": recipe.env,
           "device_needed": recipe.device, "note": recipe.note, "methods": {}}
    run_dir = out / recipe.key
    if status is None:
        summary = report.build_summary(run_dir)
        rec["methods"] = {m: method_record(run_dir, m, summary) for m in recipe.methods}
        served = [m for m, r in rec["methods"].items() if r["status"] == "served"]
        status = "served" if len(served) == len(recipe.methods) else "partly served" if served else \
            "refused at start-up" if all(r["status"] == "refused at start-up" for r in rec["methods"].values()) \
            else "failed"
        env = next((r["env"] for r in rec["methods"].values() if r.get("env")), None) or bench.environment()
        rec.update(device=env.get("device"), date_utc=env.get("date_utc"), sglang=env.get("sglang"),
                   torch=env.get("torch"), bench=bench_args(recipe))
    rec["status"] = status
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{recipe.key}.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"[seed] {recipe.key}: {status}", flush=True)
    return rec


# ------------------------------------------------------------------------------------------------ the table
def _cell(values, fmt: str = ".2f") -> str:
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def device_and_date(env: dict) -> str:
    """'H100, 2026-11-25' from a results file's env (nvidia-smi's line per GPU: '2x H200' for two), or '-'."""
    if not env.get("device"):
        return "-"
    gpus = [line.split(",")[0].removeprefix("NVIDIA ").split()[0] for line in env["device"].splitlines()]
    return (f"{len(gpus)}x {gpus[0]}" if len(gpus) > 1 else gpus[0]) + f", {(env.get('date_utc') or '')[:10]}"


def table_rows(records: dict[str, dict]) -> list[dict]:
    rows = []
    for r in RECIPES:
        rec = records.get(r.key) or {"recipe": r.key, "status": "not run on a GPU yet", "methods": {}}
        ms = rec["methods"]
        get = lambda m, k: (ms.get(m) or {}).get(k)  # noqa: E731
        greedy = [f"{m} {e[0]}/{e[1]}" for m in ("ours", "builtin") if (e := get(m, "greedy_equal"))]
        rows.append({
            "recipe": r.key, "device": device_and_date(rec), "status": rec["status"],
            "healthy_s": _cell((get(m, "healthy_s") for m in ("none", "ours", "builtin")), ".0f"),
            "greedy_equal": ", ".join(greedy) or "-",
            "ours_step_cost": _cell((get("ours", "step_cost") or {}).get(str(c)) for c in CONCURRENCY),
            "builtin_step_cost": _cell((get("builtin", "step_cost") or {}).get(str(c)) for c in CONCURRENCY),
            "draft_backend": _cell((get(m, "draft_backend") for m in ("ours", "builtin")), ""),
            "not_served": {m: f"{x['status']}: {x.get('reason', '')}" for m, x in ms.items()
                           if x["status"] not in ("served", "served with errors")},
        })
    return rows


def markdown(rows: list[dict]) -> str:
    c = " / ".join(map(str, CONCURRENCY))
    lines = ["| recipe | device, date | status | s to healthy none / ours / builtin | greedy equal to none | "
             f"ours step cost c = {c} | builtin step cost c = {c} | draft attention ours / builtin |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['recipe']} | {r['device']} | {r['status']} | {r['healthy_s']} | {r['greedy_equal']} | "
              f"{r['ours_step_cost']} | {r['builtin_step_cost']} | {r['draft_backend']} |" for r in rows]
    notes = [f"- `{r['recipe']}` {m}: {why}" for r in rows for m, why in r["not_served"].items()]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def load_records(results: Path) -> dict[str, dict]:
    keys = {r.key for r in RECIPES}
    return {f.stem: json.loads(f.read_text()) for f in sorted(results.glob("*.json")) if f.stem in keys}


def table(args) -> int:
    results = Path(args.results)
    rows = table_rows(load_records(results))
    (results / "table.md").write_text(markdown(rows))
    (results / "table.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(markdown(rows), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.seed_recipes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the smoke job's phases on a GPU, as many as the deadline allows")
    r.add_argument("--out", required=True, help="run folders OUT/KEY and records OUT/KEY.json")
    r.add_argument("--done", action="append", help="a folder of records already made (skipped)")
    r.add_argument("--rerun", default="", help="comma list of recipe keys run again although --done has their record "
                                               "(their preset or a default changed since)")
    r.add_argument("--recipes", default=None, help="comma list of recipe keys or presets (default: all, in order)")
    r.add_argument("--deadline-s", type=float, default=540.0, help="no phase starts past this (from now)")
    r.add_argument("--port", type=int, default=30000)
    r.add_argument("--python", default=os.environ.get("PYTHON", "python3"), help="interpreter of the servers")
    r.add_argument("--gpu-mib", type=int, default=None, help="the GPU's memory (default: nvidia-smi)")
    t = sub.add_parser("table", help="table.md and table.json from the records in RESULTS")
    t.add_argument("results")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
