"""The switches: every SGLANG_DFLASH_* variable is parsed in sglang_dflash/settings.py, listed in docs/SETTINGS.md, and
a bad value is refused with the variable, the value and the fix."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sglang_dflash import settings
from sglang_dflash.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[1]
# variables the test harness reads (tests/README.md lists them); they configure tests, not the package
TEST_ONLY = {"SGLANG_DFLASH_TEST_CACHE", "SGLANG_DFLASH_TEST_PORT_OFFSET", "SGLANG_DFLASH_TEST_GEMMA3"}


def test_defaults():
    s = Settings.from_env({})
    assert (s.worker, s.capture, s.verify_attention, s.verify_metadata) == ("ours", "auto", "ours", "ours")
    assert s.graph_head and s.adaptive and not s.allow_untested_sglang
    assert s.k is None and s.widths is None and s.k_schedule is None and s.step_trace is None
    assert s.log_every_s == 30.0 and s.cache == Path.home() / ".cache" / "sglang_dflash"
    assert [f.name for f in dataclasses.fields(Settings)] == [sw.field for sw in settings.SWITCHES]
    assert s.tree == 0 and s.replay_ssm and s.k0_state_in_place and not s.short_draft
    assert len(settings.SWITCHES) == 22


def test_values_are_parsed():
    s = Settings.from_env({settings.WORKER: " Builtin ", settings.ADAPTIVE: "off", settings.K: "3",
                           settings.K_SCHEDULE: "15,0,3", settings.LOG_EVERY_S: "2.5", settings.GRAPH_HEAD: "0",
                           settings.ALLOW_UNTESTED_SGLANG: "yes", settings.CACHE: "/tmp/c", settings.CAPTURE: ""})
    assert (s.worker, s.adaptive, s.k, s.k_schedule, s.log_every_s) == ("builtin", False, 3, (15, 0, 3), 2.5)
    assert not s.graph_head and s.allow_untested_sglang and s.cache == Path("/tmp/c") and s.capture == "auto"


@pytest.mark.parametrize("name,value", [
    (settings.WORKER, "mine"), (settings.CAPTURE, "bogus"), (settings.VERIFY_ATTENTION, "fast"),
    (settings.ADAPTIVE, "maybe"), (settings.GRAPH_HEAD, "2"), (settings.K, "three"), (settings.K, "1,2"),
    (settings.K_SCHEDULE, "15,x"), (settings.LOG_EVERY_S, "0"), (settings.LOG_EVERY_S, "soon"),
    (settings.TREE, "1"), (settings.TREE, "-4"), (settings.TREE, "wide"),
])
def test_bad_values_name_the_variable_and_the_fix(name, value):
    with pytest.raises(SettingsError) as e:
        Settings.from_env({name: value})
    assert f"{name}=" in str(e.value) and "Fix" in str(e.value)
    assert isinstance(e.value, ValueError)  # callers that caught ValueError still do


def test_tree_size_is_checked_against_the_block():
    assert settings.tree_size(16, {}) == 0 and settings.tree_size(16, {settings.TREE: "0"}) == 0
    assert settings.tree_size(16, {settings.TREE: "2"}) == 2 and settings.tree_size(16, {settings.TREE: "16"}) == 16
    assert Settings.from_env({settings.TREE: " 8 "}).tree == 8
    with pytest.raises(SettingsError, match=r"SGLANG_DFLASH_TREE=17: .*block size 16.*Fix: SGLANG_DFLASH_TREE=16"):
        settings.tree_size(16, {settings.TREE: "17"})
    with pytest.raises(SettingsError, match=r"SGLANG_DFLASH_TREE='1'.*Fix"):
        settings.tree_size(16, {settings.TREE: "1"})


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.delenv(settings.WORKER, raising=False)
    assert settings.current().worker == "ours" and settings.get(settings.WORKER) == "ours"
    monkeypatch.setenv(settings.WORKER, "builtin")
    assert settings.current().worker == "builtin" and settings.get(settings.WORKER) == "builtin"
    monkeypatch.setenv(settings.WORKER, "nope")
    with pytest.raises(SettingsError, match="SGLANG_DFLASH_WORKER='nope'"):
        settings.get(settings.WORKER)


def test_width_controls_read_the_settings():
    from sglang_dflash.serving.width_control import WidthControls

    c = WidthControls.from_env(16, {settings.K: "5", settings.STEP_TRACE: "/tmp/t-{pid}"})
    assert c.pinned == 5 and c.ks == [5, 15] and c.trace_path == "/tmp/t-{pid}"
    assert WidthControls.from_env(16, {settings.ADAPTIVE: "0"}).ks == [15]
    with pytest.raises(ValueError, match=r"SGLANG_DFLASH_K=16: the drafter's block is 16"):
        WidthControls.from_env(16, {settings.K: "16"})
    with pytest.raises(ValueError, match="SGLANG_DFLASH_WIDTHS"):
        WidthControls.from_env(16, {settings.WIDTHS: "0,3"})


def test_docs_table_is_the_settings_table():
    doc = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert settings.markdown_table() in doc, \
        "docs/SETTINGS.md is out of date: paste the output of `python -m sglang_dflash.settings` into it"


def test_the_code_reads_no_other_switch():
    """Every SGLANG_DFLASH_* name outside tests is a switch of settings.py, and only settings.py reads the
    environment for one."""
    files = [p for d in ("sglang_dflash", "kernels", "benchmarks", "launch", ".ci") for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", "") and "results" not in p.parts]
    names, readers = set(), []
    for p in files:
        text = p.read_text(errors="replace")
        names |= set(re.findall(r"SGLANG_DFLASH_[A-Z0-9_]*[A-Z0-9]", text))
        if p.suffix == ".py" and p.name != "settings.py" and re.search(r"(environ|getenv)\b[^\n]*SGLANG_DFLASH_", text):
            readers.append(str(p.relative_to(ROOT)))
    assert names - TEST_ONLY - set(settings.NAMES) == set(), "add these to sglang_dflash/settings.py SWITCHES"
    assert not readers, f"read the switch through sglang_dflash.settings instead: {readers}"
