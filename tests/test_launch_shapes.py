"""The exact-shape config tool (sglang_dflash.targets.shapes): shapes against published parameter counts, drafter configs
against our config parser, a tiny instantiation, and the files it writes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from sglang_dflash.targets import shapes
from sglang_dflash.config import DFlashConfig


def hf_config(d: dict):
    d = dict(d)
    d.pop("architectures", None)
    return tf.AutoConfig.for_model(d.pop("model_type"), **d)


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_full_size_parameter_count_matches_published(name):
    """Instantiated on the meta device (no memory): the text model's size matches the model card within 2%."""
    s = shapes.get(name)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(s.target))
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(s.published_params, rel=0.02), f"{name}: {n / 1e9:.3f}B"
    assert type(model).__name__ == s.target["architectures"][0]


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_drafter_config_parses_and_fits_target(name):
    s = shapes.get(name)
    d = DFlashConfig.from_dict(s.drafter)
    d.validate_against_target(hf_config(s.target))
    assert d.block_size == 16 and d.num_target_layers == s.target["num_hidden_layers"]
    assert max(d.target_layer_ids) < s.target["num_hidden_layers"]
    assert d.hidden_size == s.target["hidden_size"]  # the drafter reads the target's hidden states and embeddings


def test_known_values():
    q = shapes.get("qwen3-8b")
    assert (q.target["hidden_size"], q.target["num_hidden_layers"], q.target["vocab_size"]) == (4096, 36, 151936)
    assert q.drafter["dflash_config"] == {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669}
    g = shapes.get("gemma-4-26b-a4b-it")
    assert g.target["layer_types"].count("full_attention") == 5 and g.target["layer_types"][5] == "full_attention"
    assert g.drafter["dflash_config"]["target_layer_ids"] == [1, 6, 11, 17, 22, 27]
    for s in shapes.SHAPES.values():  # every shape says where it came from
        assert s.sources


@pytest.mark.parametrize("name", ["qwen3-8b", "llama3.1-8b-instruct", "gemma-3-270m", "gemma-4-26b-a4b-it"])
def test_tiny_shrunk_model_runs(name):
    c = shapes.shrink(shapes.get(name).target)
    model = tf.AutoModelForCausalLM.from_config(hf_config(c)).eval()
    with torch.no_grad():
        out = model(torch.randint(0, c["vocab_size"], (1, 7)))
    assert out.logits.shape == (1, 7, c["vocab_size"])
    if "layer_types" in c:  # the tiny model keeps every layer kind of the full one
        assert set(c["layer_types"]) == set(shapes.get(name).target["layer_types"])


def test_write(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    dirs = shapes.write("qwen3-8b", tmp_path / "out", tokenizer_from=tok)
    assert json.loads((dirs["target"] / "config.json").read_text()) == shapes.get("qwen3-8b").target
    assert json.loads((dirs["draft"] / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert (dirs["draft"] / "tokenizer.json").exists()
    assert "--load-format dummy" in (tmp_path / "out" / "README.txt").read_text()
    assert not list((tmp_path / "out").rglob("*.safetensors"))  # configs only: SGLang makes the weights
    with pytest.raises(FileNotFoundError):
        shapes.write("qwen3-8b", tmp_path / "o2", tokenizer_from=tmp_path / "empty-missing")
    assert shapes.main(["write", "smollm2-135m", str(tmp_path / "s")]) == 0
    with pytest.raises(KeyError):
        shapes.get("gpt-5")


def test_write_dflash2(tmp_path):
    """`--dflash2`: the same layer stack as a DFlash2 drafter our config accepts for the shape's target (#36 item 4's
    cost run)."""
    from sglang_dflash.config import DFlashConfig

    assert shapes.main(["write", "qwen3-8b", str(tmp_path / "d2"), "--dflash2"]) == 0
    cfg = DFlashConfig.from_pretrained(tmp_path / "d2" / "draft")
    assert cfg.is_dflash2 and (cfg.conv_kernel_size, cfg.selector_top_k) == (4, 32)
    cfg.validate_against_target(shapes.get("qwen3-8b").target)
    plain = json.loads(json.dumps(shapes.get("qwen3-8b").drafter))
    assert "conv_kernel_size" not in plain["dflash_config"]  # the table itself is untouched
    assert "not the shape's own" in (tmp_path / "d2" / "README.txt").read_text()
