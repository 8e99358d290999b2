"""Every shape of `sglang_dflash.targets.shapes` through SGLang 0.5.17's own start-up code, with and without DFLASH (CPU).

One subprocess (tests/shape_startup_probe.py) imports SGLang once and, per shape shrunk to a few layers, runs SGLang's
argument parser + ServerArgs post-init (our plugin's DFLASH checks included), ModelConfig, and the KV-cache
configurator's pool sizing and pool construction for the target and, with DFLASH, for the draft (sharing the
target's request table and allocator), as a server start does before its first forward; where SGLang's CPU engine
can run (gcc for the stub libcuda), it also builds the target and draft models with SGLang's loader (dummy weights)
and checks that every attention layer's K/V heads and dims equal its pool buffer's. The tests compare each
layer's K/V buffer with the shape: heads and head dim per layer kind, derived here from the shape's published (HF)
text config independently of shapes.sglang_text_config. The Gemma-4 shapes are also compared with SGLang's loading
of the published multimodal layout, and the HF-only naming is shown to fail where the H100 run failed. Each launch/
preset's command (with --dummy) is built into a full ServerArgs (post-init), beyond tests/test_launch.py's parse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dflash.targets import shapes

pytestmark = pytest.mark.slow
pytest.importorskip("sglang")

PROBE = Path(__file__).with_name("shape_startup_probe.py")
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "launch").glob("*.sh") if p.name != "common.sh")
CASES = [(name, mode) for name in shapes.SHAPES for mode in ("plain", "dflash")]
GEMMA4 = [name for name, s in shapes.SHAPES.items() if s.target["model_type"] == "gemma4_text"]


# SGLang's CPU engine cannot import its Qwen3.5 model module (sgl_kernel's CPU wheel lacks fused_sigmoid_mul_cpu),
# so that one target model is not built on CPU; its config, server args and pools are.
NO_CPU_MODEL = {"qwen3.5-35b-a3b"}


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("shape_startup")
    env = None
    if shutil.which("gcc"):  # SGLang's CPU engine (stub libcuda): the probe then builds the models too
        from sglang_dflash.testing import build_stub_libcuda, cpu_server_env

        env = cpu_server_env(build_stub_libcuda(out / "stub"))
        env["SGLANG_DFLASH_DUMMY_WEIGHTS"] = "chain"  # the benchmarks' dummy weights, through the plugin's hook
    env = dict(env or os.environ)
    env.pop("SGLANG_DFLASH_REPLAY_SSM", None)  # the hybrid replay commit is on by default
    r = subprocess.run([sys.executable, str(PROBE), str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def expected_target_kv(target: dict) -> list:
    """[k_heads, k_dim, v_heads, v_dim] per layer (None: no KV) from the published (HF-named) text config."""
    kinds = target.get("layer_types") or ["full_attention"] * target["num_hidden_layers"]
    out = []
    for kind in kinds:
        if kind == "linear_attention":
            out.append(None)
        elif target["model_type"] == "gemma4_text" and kind == "full_attention":
            heads = target.get("num_global_key_value_heads") or target["num_key_value_heads"]
            out.append([heads, target["global_head_dim"]] * 2)
        else:
            out.append([target["num_key_value_heads"], target["head_dim"]] * 2)
    return out


def _result(probe, key):
    r = probe[key]
    assert r["ok"], f"{key}: {r['error']}\n{r['traceback']}"
    return r


@pytest.mark.parametrize("name,mode", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_shape_starts(probe, name, mode):
    target, drafter = shapes.shrink_pair(name)
    r = _result(probe, f"{name}/{mode}")
    t = r["target"]
    assert t["arch"] == target["architectures"][0] and t["layers"] == target["num_hidden_layers"]
    assert t["kv"] == expected_target_kv(target), f"{name}: per-layer KV buffers differ from the shape"
    if mode == "plain":
        assert r["speculative_algorithm"] is None and "draft" not in r
        return
    assert r["speculative_algorithm"] == "DFLASH"
    d = r["draft"]
    assert d["arch"] == "DFlashDraftModel" and d["layers"] == drafter["num_hidden_layers"]
    assert d["kv"] == [[drafter["num_key_value_heads"], drafter["head_dim"]] * 2] * drafter["num_hidden_layers"]
    if not probe["build_models"]:
        return
    # the models SGLang's loader builds (dummy weights): each layer's attention writes K/V of exactly the pool's shape
    assert d["attn"] == d["kv"], f"{name}: draft attention layers vs draft KV pool"
    if name in NO_CPU_MODEL:
        assert "no SGlang implementation" in t["attn"]["error"], t["attn"]
    else:
        assert t["attn"] == t["kv"], f"{name}: target attention layers vs target KV pool"
    # SGLANG_DFLASH_DUMMY_WEIGHTS=chain: SGLang's dummy weights re-drawn like a model's (targets/random_weights.py),
    # and the target's logits processor (not the drafter's) carries the chain head (targets/chain_head.py)
    for part in [d] if name in NO_CPU_MODEL else [t, d]:
        w = part["weights"]
        assert w["norms"] > 0 and w["norms_set"] == w["norms"], f"{name}: {w}"
        assert w["layers_differ"] is not False, f"{name}: two layers hold the same dummy weights"
        assert w["chain_head"] == (part is t), f"{name}: chain head on the {'target' if part is t else 'drafter'}: {w}"


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_target_is_what_the_published_checkpoint_gives_sglang(probe, name):
    """The written text-only target and the published multimodal layout (SGLang renames its text_config on load)
    end up with the same shapes in SGLang: per-layer-kind heads and head dims, and the same layer split."""
    ours = _result(probe, f"{name}/plain")["target"]
    published = _result(probe, f"{name}/published")
    keys = ("hybrid_swa", "head_dim", "kv_heads", "swa_head_dim", "swa_kv_heads", "swa_layers", "full_layers")
    assert {k: ours[k] for k in keys} == {k: published[k] for k in keys}
    assert ours["swa_head_dim"] != ours["head_dim"]  # the tiny shape keeps sliding and full layers distinct


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_hf_naming_alone_fails_in_sglang(probe, name):
    """Why the target is written in SGLang's naming: the HF-named text config fails in SGLang's hybrid-SWA pool
    exactly as the H100 start did (if SGLang ever renames gemma4_text itself, this fails: drop the renaming)."""
    r = probe[f"{name}/hf-naming"]
    assert not r["ok"] and "swa_num_key_value_heads" in r["error"] and "_build_hybrid_swa_kv_pool" in r["traceback"]


def test_written_gemma4_config_keeps_the_published_names(tmp_path):
    dirs = shapes.write("gemma-4-26b-a4b-it", tmp_path)
    written = json.loads((dirs["target"] / "config.json").read_text())
    published = shapes.get("gemma-4-26b-a4b-it").target
    assert (written["swa_num_key_value_heads"], written["swa_head_dim"]) == (8, 256)
    assert (written["num_key_value_heads"], written["head_dim"]) == (2, 512)
    assert {k: v for k, v in written.items() if k in published and k not in ("head_dim", "num_key_value_heads")} \
        == {k: v for k, v in published.items() if k not in ("head_dim", "num_key_value_heads")}
    assert "SGLang's Gemma-4 naming" in (tmp_path / "README.txt").read_text()
    qwen = shapes.write("qwen3-8b", tmp_path / "q")
    assert json.loads((qwen["target"] / "config.json").read_text()) == shapes.get("qwen3-8b").target


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_builds_server_args(probe, preset):
    """`launch/PRESET.sh --dummy DIR` for none and ours gives a ServerArgs that SGLang's post-init accepts (model-
    specific rules such as Gemma-4's attention backends, our DFLASH checks against the drafter config)."""
    plain = _result(probe, f"preset:{preset}/none")
    ours = _result(probe, f"preset:{preset}/ours")
    assert plain["speculative_algorithm"] is None
    assert ours["speculative_algorithm"] == "DFLASH" and ours["num_draft_tokens"] == 16
    assert ours["draft_attention_backend"] is not None
    # hybrid (Gated DeltaNet) targets: start-up turns SGLang's replay commit on for DFLASH (startup.check_replay_ssm;
    # the presets are GPU commands) instead of a recurrent-state snapshot per draft position
    assert ours["replay_ssm"] == (preset == "qwen3.5-35b-a3b") and not plain["replay_ssm"]
