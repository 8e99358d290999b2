"""serving/admission.py: our DFLASH scheduler keeps no min-free-slots prefill delay unless the operator set one.
(The server-level check, a short request admitted at once beside 22 running ones, is in test_e2e_cpu.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from sglang_dflash.serving import admission  # noqa: E402


class _Algorithm:
    def __init__(self, name):
        self.name = name

    def is_dflash(self):
        return self.name == "DFLASH"


def _scheduler(name="DFLASH"):
    return SimpleNamespace(spec_algorithm=_Algorithm(name), min_free_slots_delayer=object())


@pytest.fixture
def schedule(monkeypatch):
    import sglang.srt.runtime_context as rc

    cfg = SimpleNamespace(min_free_slots_delay=None)
    monkeypatch.setattr(rc, "get_schedule", lambda: cfg)
    return cfg


def test_dflash_default_delay_dropped(schedule):
    s = _scheduler()
    assert admission.admit_as_plain_decoding(s) and s.min_free_slots_delayer is None


def test_operator_delay_kept(schedule):
    schedule.min_free_slots_delay = 3
    s = _scheduler()
    delayer = s.min_free_slots_delayer
    assert not admission.admit_as_plain_decoding(s) and s.min_free_slots_delayer is delayer


@pytest.mark.parametrize("name", ["DSPARK", "NONE"])
def test_other_algorithms_untouched(schedule, name):
    """DSPARK is in SGLang's DFlash family but not served by our worker: its delay stays."""
    s = _scheduler(name)
    delayer = s.min_free_slots_delayer
    assert not admission.admit_as_plain_decoding(s) and s.min_free_slots_delayer is delayer


def test_hook_target_exists():
    """The plugin hooks Scheduler.init_model_worker, where SGLang builds the delayer from resolve_min_free_slots."""
    import inspect

    from sglang.srt.managers import scheduler

    from sglang_dflash.serving import plugin

    src = inspect.getsource(scheduler.Scheduler.init_model_worker)
    assert "min_free_slots_delayer" in src and "resolve_min_free_slots" in src
    assert plugin._SCHEDULER_WORKER == "sglang.srt.managers.scheduler.Scheduler.init_model_worker"
