"""The supported-SGLang check (compat.py) and the plugin's refusal on a release we were not tested on (no server)."""

from __future__ import annotations

import pytest

from sglang_dflash.serving import compat


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23", "0.5.23.post1", "0.5.17rc0"])
def test_tested_releases_are_accepted(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    assert compat.refusal(version) is None
    compat.check_supported(version)


@pytest.mark.parametrize("version", ["0.5.16", "0.5.20", "0.5.24", "0.6.0", "1.0.0", "nightly", ""])
def test_other_releases_are_refused_with_the_range_and_the_fix(version, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    reason = compat.refusal(version)
    assert reason is not None
    assert "0.5.17 and 0.5.23" in reason  # the supported set
    assert "pip install 'sglang==0.5.17'" in reason and "'sglang==0.5.23'" in reason  # the fix
    assert compat.ALLOW_UNTESTED_ENV in reason
    with pytest.raises(compat.UnsupportedSGLangVersion, match="not supported by sglang-dflash"):
        compat.check_supported(version)


def test_untested_release_allowed_by_env(monkeypatch):
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    assert compat.refusal("0.5.24") is None


def test_release_of():
    assert compat.release_of("0.5.23.post2") == (0, 5, 23)
    assert compat.release_of("v0.5.17") == (0, 5, 17)
    assert compat.release_of("abc") is None and compat.release_of(None) is None


def test_installed_release_is_a_tested_one():
    # the venvs CI builds (pyproject extras serve / serve-latest) must install a tested release
    pytest.importorskip("sglang")
    assert compat.SGLANG_RELEASE in compat.TESTED_RELEASES, compat.SGLANG_VERSION


class _Registry:
    def __init__(self):
        self.hooks = {}

    def register(self, target, hook, hook_type=None):
        self.hooks[target] = hook


class _Algo:
    def __init__(self, dflash):
        self.dflash = dflash

    def is_dflash(self):
        return self.dflash


def test_plugin_refuses_dflash_on_an_untested_release(monkeypatch):
    """register() on an unsupported release installs only the refusal: a DFLASH start raises with the message,
    every other server is left alone (and no other hook of ours is applied)."""
    pytest.importorskip("sglang")
    from sglang.srt.plugins import hook_registry

    from sglang_dflash.serving import plugin

    registry = _Registry()
    monkeypatch.setattr(hook_registry, "HookRegistry", registry)
    monkeypatch.setattr(compat, "SGLANG_VERSION", "0.5.99")
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.delenv(plugin.WORKER_ENV, raising=False)
    plugin.register()

    assert sorted(registry.hooks) == sorted([f"{plugin._HOOK_ARGS}._handle_dflash", f"{plugin._SPEC}.create_worker"])
    with pytest.raises(compat.UnsupportedSGLangVersion, match=r"sglang 0\.5\.99 is not supported.*0\.5\.17 and 0\.5\.23"):
        registry.hooks[f"{plugin._HOOK_ARGS}._handle_dflash"](lambda args: None, object())
    create = registry.hooks[f"{plugin._SPEC}.create_worker"]
    with pytest.raises(compat.UnsupportedSGLangVersion):
        create(lambda self, args: "builtin", _Algo(True), None)
    assert create(lambda self, args: "eagle worker", _Algo(False), None) == "eagle worker"


def test_plugin_registers_its_hooks_on_a_tested_release(monkeypatch):
    pytest.importorskip("sglang")
    from sglang.srt.plugins import hook_registry

    from sglang_dflash.serving import plugin

    registry = _Registry()
    monkeypatch.setattr(hook_registry, "HookRegistry", registry)
    monkeypatch.setattr(compat, "SGLANG_VERSION", "0.5.23")
    monkeypatch.delenv(plugin.WORKER_ENV, raising=False)
    plugin.register()
    assert registry.hooks[f"{plugin._SPEC}.create_worker"] is plugin._create_worker
    assert f"{plugin._HOOK_ARGS}._resolve_dflash_draft_attention_backend" in registry.hooks


def test_every_hook_target_exists_in_the_installed_sglang(monkeypatch):
    """A hook whose dotted target moved is only logged by SGLang (and silently not applied): check them here."""
    pytest.importorskip("sglang")
    import pkgutil

    from sglang.srt.plugins import hook_registry

    from sglang_dflash.serving import plugin

    registry = _Registry()
    monkeypatch.setattr(hook_registry, "HookRegistry", registry)
    monkeypatch.delenv(plugin.WORKER_ENV, raising=False)
    plugin.register()
    missing = []
    for target in registry.hooks:
        owner, attr = target.rsplit(".", 1)
        try:
            if not hasattr(pkgutil.resolve_name(owner), attr):
                missing.append(target)
        except (ImportError, AttributeError):
            missing.append(target)
    assert not missing, missing


REFUSAL_PROBE = r"""
import sys
from sglang_dflash.serving import compat
compat.SGLANG_VERSION = "0.5.99"  # as if an untested SGLang were installed
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(sys.argv[1:])  # 0.5.17 resolves here ...
getattr(args, "resolve_once", lambda: None)()  # ... 0.5.23 here
print("STARTED")
"""


@pytest.mark.slow
def test_untested_release_stops_a_dflash_start_for_real(dflash_pair):
    """Through SGLang's own plugin loading and argument resolution (what launch_server runs first): a DFLASH start
    on an untested release fails with the supported releases and the fix."""
    import os
    import subprocess
    import sys

    from sglang_dflash.serving.plugin import WORKER_ENV

    root, target, draft, _ = dflash_pair
    argv = ["--model-path", str(target), "--device", "cpu", "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(draft)]
    env = {k: v for k, v in os.environ.items() if k not in (compat.ALLOW_UNTESTED_ENV, WORKER_ENV)}
    proc = subprocess.run([sys.executable, "-c", REFUSAL_PROBE, *argv], capture_output=True, text=True,
                          timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "STARTED" not in proc.stdout, out[-3000:]
    assert "UnsupportedSGLangVersion" in out and "0.5.17 and 0.5.23" in out and "pip install" in out, out[-3000:]
