"""The seed smoke job without a GPU: each phase's server command is the preset's own (its --dry-run), the phases
resume and wait as the job says, records and the table come out of fixture driver folders, and the README's Models
table shows them (benchmarks/seed_recipes.py, benchmarks/readme_models.py)."""

from __future__ import annotations

import gzip
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks import driver, readme_models, seed_recipes
from benchmarks.seed_recipes import RECIPES, Recipe
from sglang_dflash.serving.plugin import WORKER_ENV

ROOT = Path(__file__).resolve().parents[1]
BY_KEY = {r.key: r for r in RECIPES}


def phase_args(recipe: Recipe, method: str, tmp_path: Path):
    """The driver's arguments for one phase, its shape directory under tmp_path (present: nothing is written)."""
    argv = seed_recipes.driver_argv(recipe, method, tmp_path / "run", port=30950, python="/py", wait_s=400)
    i = argv.index("--")
    args = driver.parser().parse_args(argv[:i] + ["--shape-dir", str(tmp_path / "shape")])
    (tmp_path / "shape" / "target").mkdir(parents=True, exist_ok=True)
    (tmp_path / "shape" / "target" / "config.json").write_text("{}")
    return args, argv[i + 1:]


def dry_run(recipe: Recipe, method: str, shape: Path) -> str:
    cmd = ["bash", str(ROOT / "launch" / f"{recipe.preset}.sh"), "--dry-run", "--method", method, "--port", "30950",
           "--host", "127.0.0.1", "--dummy", str(shape)]
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "/py", **recipe.env}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout


@pytest.mark.parametrize("key", ["gemma-4-26b-a4b-it", "qwen3.5-35b-a3b@published"])
def test_every_phase_runs_the_presets_own_command(key, tmp_path):
    recipe = BY_KEY[key]
    for method in ("none", "ours", "builtin"):
        args, bench = phase_args(recipe, method, tmp_path)
        argv, env = driver.server_argv(args, method), driver.server_env(args, method)
        printed = shlex.split(dry_run(recipe, method, tmp_path / "shape"))
        assert printed[printed.index("/py"):] == argv  # exactly the preset's line
        if method == "builtin":
            assert env[WORKER_ENV] == "builtin"
        elif method == "ours":
            assert WORKER_ENV not in env
    flag = argv.index("--speculative-draft-attention-backend")
    assert argv[flag + 1] == "fa4" and seed_recipes.draft_backend(recipe) == "fa4"
    if recipe.variant:
        assert argv[argv.index("--attention-backend") + 1] == "trtllm_mha"
    assert argv[argv.index("--load-format") + 1] == "dummy" and "--skip-tokenizer-init" in argv
    assert bench[bench.index("--concurrency") + 1] == "1,8,32" and "--ignore-eos" in bench
    vocab = {"gemma-4-26b-a4b-it": 262144, "qwen3.5-35b-a3b": 248320}[recipe.preset]
    assert int(bench[bench.index("--random-vocab") + 1]) == vocab - 1000  # random prompt ids stay in the vocabulary


def test_a_method_the_preset_refuses_is_recorded_without_a_start(tmp_path):
    out, shape = tmp_path / "run", tmp_path / "shape"
    (shape / "target").mkdir(parents=True)
    (shape / "target" / "config.json").write_text("{}")
    driver.main(["--preset", "gemma-3-270m", "--dummy", "--shape-dir", str(shape), "--methods", "builtin", "--out",
                 str(out), "--python", "/nonexistent/python"])  # a server start would fail on this interpreter
    rec = seed_recipes.method_record(out, "builtin", {"rows": [], "crosscheck": {}})
    assert rec["status"] == "preset refuses" and "cannot serve this target" in rec["reason"]


# ---------------------------------------------------------------------------------------- fixture driver runs
TOK_S = {"none": 1000.0, "ours": 950.0, "builtin": 600.0}


def fake_phase(out: Path, method: str, *, refuse: str | None = None, healthy_s: float = 90.0) -> None:
    """What one driver phase leaves in its folder: METHOD.json (+ greedy outputs), or the skip of a failed start."""
    out.mkdir(parents=True, exist_ok=True)
    if refuse:
        (out / f"{method}.json").write_text(json.dumps({"method": method, "skipped": refuse}))
        return
    env = {"device": "NVIDIA H100 80GB HBM3, 81559 MiB, 580", "date_utc": "2026-12-01T10:00:00+00:00",
           "sglang": "0.5.17", "torch": "2.11.0"}
    levels = [{"dataset": "random", "temperature": 0.0, "concurrency": c, "output_tok_s": TOK_S[method] * c,
               "tau": 1.0 if method != "none" else None, "errors": 0, "requests": c, "output_tokens": 128 * c}
              for c in (1, 8, 32)]
    server = {"attention_backend": "triton",
              "speculative_draft_attention_backend": None if method == "none" else "fa4"}
    (out / f"{method}.json").write_text(json.dumps({"method": method, "levels": levels, "env": env, "server": server,
                                                    "random_weights": True, "driver": {"healthy_s": healthy_s}}))
    with gzip.open(out / f"{method}.outputs.jsonl.gz", "wt") as f:
        for c in (1, 8, 32):
            for uid in range(c):
                ids = [uid, c] if method != "builtin" or uid else [uid, -1]  # the builtin differs once per level
                f.write(json.dumps({"dataset": "random", "uid": uid, "turn": 0, "concurrency": c, "ids": ids}) + "\n")


REFUSAL = ("server exited with 1 before /health; log tail:\n[2026-12-01] x\n"
           "sglang_dflash.serving.startup.DFlashStartupError: --attention-backend trtllm_mha: no. Fix: triton")


def test_record_and_table_from_fixture_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(seed_recipes.bench, "environment", lambda: {"device": "NVIDIA H100 80GB HBM3, 81559 MiB",
                                                                    "date_utc": "2026-12-01T11:00:00+00:00"})
    out = tmp_path / "out"
    for m in ("none", "ours", "builtin"):
        fake_phase(out / "gemma-4-26b-a4b-it", m)
    for m in ("ours", "builtin"):
        fake_phase(out / "qwen3.5-35b-a3b@published", m, refuse=REFUSAL)
    rec = seed_recipes.write_record(BY_KEY["gemma-4-26b-a4b-it"], out)
    assert rec["status"] == "served" and rec["device"].startswith("NVIDIA H100")
    ours, builtin = rec["methods"]["ours"], rec["methods"]["builtin"]
    assert ours["greedy_equal"] == [41, 41] and builtin["greedy_equal"] == [38, 41]
    assert ours["step_cost"] == {"1": pytest.approx(1000 / 950, abs=1e-3), "8": pytest.approx(1.053, abs=1e-3),
                                 "32": pytest.approx(1.053, abs=1e-3)}
    assert ours["healthy_s"] == 90.0 and ours["draft_backend"] == "fa4"
    refused = seed_recipes.write_record(BY_KEY["qwen3.5-35b-a3b@published"], out)
    assert refused["status"] == "refused at start-up" and refused["device"].startswith("NVIDIA H100")  # no server
    assert refused["methods"]["ours"]["reason"] == "DFlashStartupError: --attention-backend trtllm_mha: no. Fix: triton"

    seed_recipes.main(["table", str(out)])
    rows = {r["recipe"]: r for r in json.loads((out / "table.json").read_text())}
    assert [r.key for r in RECIPES] == list(rows)
    g = rows["gemma-4-26b-a4b-it"]
    assert (g["device"], g["healthy_s"], g["greedy_equal"]) == ("H100, 2026-12-01", "90 / 90 / 90",
                                                                "ours 41/41, builtin 38/41")
    assert g["ours_step_cost"] == "1.05 / 1.05 / 1.05" and g["builtin_step_cost"] == "1.67 / 1.67 / 1.67"
    assert g["draft_backend"] == "fa4 / fa4" and rows["llama3.1-8b-instruct"]["status"] == "not run on a GPU yet"
    md = (out / "table.md").read_text()
    assert "| gemma-4-26b-a4b-it | H100, 2026-12-01 | served |" in md
    assert "- `qwen3.5-35b-a3b@published` ours: refused at start-up: DFlashStartupError" in md


def test_start_failures_are_told_apart():
    assert seed_recipes.start_failure("server not healthy after 420 s; log tail:\n...", "")[0] == "timed out"
    log = "Load weight begin. avail mem=70 GB\nValueError: Model X implements neither a nor b\n"
    assert seed_recipes.start_failure("server exited with 1 before /health", log) == \
        ("failed after loading", "ValueError: Model X implements neither a nor b")
    assert seed_recipes.start_failure(REFUSAL, "")[0] == "refused at start-up"


def test_run_resumes_defers_and_stops_at_the_deadline(tmp_path, monkeypatch):
    """Phases already done are skipped; fa4 recipes wait for the CUTLASS DSL; a recipe too big for the GPU is
    recorded as pending; no phase starts with less than PHASE_S left; recorded recipes are skipped."""
    out, started = tmp_path / "out", []

    def phase(argv, timeout_s):
        run_dir, method = Path(argv[argv.index("--out") + 1]), argv[argv.index("--methods") + 1]
        started.append((run_dir.name, method))
        fake_phase(run_dir, method)
        return 0

    monkeypatch.setattr(seed_recipes, "run_phase", phase)
    monkeypatch.setattr(seed_recipes, "fa4_staged", lambda: False)
    fake_phase(out / "qwen3-8b", "none")  # done by an earlier call
    run = ["run", "--out", str(out), "--gpu-mib", "81559", "--recipes",
           "qwen3-8b,qwen3.5-35b-a3b,gemma-4-26b-a4b-it,gemma-4-31b-it"]
    seed_recipes.main(run)
    assert started == [("qwen3-8b", "ours"), ("qwen3-8b", "builtin")]  # gemma-4-26b: fa4 not staged
    assert json.loads((out / "qwen3-8b.json").read_text())["status"] == "served"
    for key in ("qwen3.5-35b-a3b", "gemma-4-31b-it"):  # more than an 80 GB H100 holds
        assert json.loads((out / f"{key}.json").read_text())["status"].startswith("needs nvidia-h200")
    assert not (out / "qwen3.5-35b-a3b@published.json").exists()  # its draft is fa4 too
    monkeypatch.setattr(seed_recipes, "fa4_staged", lambda: True)
    seed_recipes.main(run + ["--deadline-s", str(seed_recipes.PHASE_S - 1)])
    assert len(started) == 2  # no time for a phase
    seed_recipes.main(run)
    assert started[2:] == [("gemma-4-26b-a4b-it", m) for m in ("none", "ours", "builtin")] + \
        [("qwen3.5-35b-a3b@published", m) for m in ("ours", "builtin")]


def test_rerun_ignores_a_done_record(tmp_path, monkeypatch):
    """A recipe whose preset or default changed runs again although the committed results hold its record."""
    done, out, started = tmp_path / "done", tmp_path / "out", []
    for m in ("none", "ours", "builtin"):
        fake_phase(done / "qwen3-8b", m)
    seed_recipes.write_record(BY_KEY["qwen3-8b"], done)
    monkeypatch.setattr(seed_recipes, "run_phase", lambda argv, timeout_s: started.append(argv) or 0)
    run = ["run", "--out", str(out), "--done", str(done), "--gpu-mib", "81559", "--recipes", "qwen3-8b"]
    seed_recipes.main(run)
    assert not started
    seed_recipes.main(run + ["--rerun", "qwen3-8b"])
    assert len(started) == 3


def test_a_second_job_on_the_same_folder_is_refused(tmp_path, monkeypatch):
    """A running job's folder is locked by its pid; a stale pid file (the process is gone) is taken over."""
    import subprocess

    started = []
    monkeypatch.setattr(seed_recipes, "run_phase", lambda argv, timeout_s: started.append(argv) or 0)
    run = ["run", "--out", str(tmp_path), "--gpu-mib", "81559", "--recipes", "qwen3-8b"]
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / ".job.pid").write_text(str(sleeper.pid))
        assert seed_recipes.main(run) == 2 and not started
    finally:
        sleeper.kill()
        sleeper.wait()
    assert seed_recipes.main(run) == 0 and len(started) == 3  # the dead pid's lock is taken over, then released
    assert not (tmp_path / ".job.pid").exists()


def test_readme_models_table_shows_a_record(tmp_path, monkeypatch):
    out = tmp_path / "seed"
    for m in ("none", "ours", "builtin"):
        fake_phase(out / "gemma-4-26b-a4b-it", m)
    seed_recipes.write_record(BY_KEY["gemma-4-26b-a4b-it"], out)
    monkeypatch.setattr(readme_models, "SEED", out)
    row = next(r for r in readme_models.table().splitlines() if r.startswith("| `gemma-4-26b-a4b-it`"))
    assert ("`gemma-4-26b-a4b-it` H100, 2026-12-01: served (none in 90 s; ours served in 90 s, 41/41 equal, draft "
            "fa4; builtin served in 90 s, 38/41 equal, draft fa4)") in row
    assert "fastpath-gemma-4-26b-a4b-h100" in row
    assert "| `gemma-4-31b-it` | google/gemma-4-31B-it | not run on a GPU yet | not run on a GPU yet |" in \
        readme_models.table()
