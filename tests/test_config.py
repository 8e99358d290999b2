import copy
import json

import pytest

from sglang_dflash.config import DFlashConfig, DFlashConfigError, default_target_layer_ids
from sglang_dflash.targets.tiny import tiny_drafter_config, tiny_target

# The shape of a published drafter config (z-lab/Qwen3-8B-DFlash-b16 style): DFlash keys partly top level, partly in
# dflash_config, rope settings in the transformers 4 spelling.
PUBLISHED = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "attention_bias": False,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
TARGET = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36}


def test_parses_published_layout():
    cfg = DFlashConfig.from_dict(PUBLISHED)
    assert cfg.block_size == 16 and cfg.num_target_layers == 36
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.mask_token_id == 151669
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 8
    assert not cfg.gemma_norm and cfg.layer_types == ("full_attention",) * 5
    assert not any(cfg.layer_is_causal(i) for i in range(5))
    cfg.validate_against_target(TARGET)


def test_dflash_keys_fall_back_to_top_level_and_defaults():
    d = copy.deepcopy(PUBLISHED)
    d["mask_token_id"] = d["dflash_config"].pop("mask_token_id")
    del d["dflash_config"]["target_layer_ids"]
    cfg = DFlashConfig.from_dict(d)
    assert cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)  # derived: 5 ids evenly spaced over [1, 33]
    assert default_target_layer_ids(36, 1) == [18]


def test_gemma_style_and_sliding_layers():
    d = copy.deepcopy(PUBLISHED)
    d.update(model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"],
             sliding_window=512)
    cfg = DFlashConfig.from_dict(d)
    assert cfg.gemma_norm
    assert cfg.layer_is_causal(0) and cfg.layer_window(0) == 512
    assert not cfg.layer_is_causal(1) and cfg.layer_window(1) is None
    d["is_causal"] = False
    assert not DFlashConfig.from_dict(d).layer_is_causal(0)


def test_round_trip_keeps_layout(tmp_path):
    cfg = DFlashConfig.from_dict(PUBLISHED)
    cfg.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dflash_config"] == PUBLISHED["dflash_config"]
    assert saved["auto_map"] == PUBLISHED["auto_map"] and saved["rope_theta"] == 1000000
    assert DFlashConfig.from_pretrained(tmp_path) == cfg


def _edit(**changes):
    d = copy.deepcopy(PUBLISHED)
    for k, v in changes.items():
        if k.startswith("dflash_"):
            d["dflash_config"][k[len("dflash_"):]] = v
        elif v is _DELETE:
            del d[k]
        else:
            d[k] = v
    return d


_DELETE = object()

BAD_DRAFTER = [
    (_edit(architectures=["Qwen3ForCausalLM"]), "architectures"),
    (_edit(architectures=["DFlash2DraftModel"]), "architectures"),
    (_edit(dflash_mask_token_id=None), "mask_token_id"),
    (_edit(dflash_mask_token_id=151936), "mask_token_id"),
    (_edit(dflash_mask_token_id=-1), "mask_token_id"),
    (_edit(block_size=1), "block_size"),
    (_edit(dflash_target_layer_ids=[]), "target_layer_ids"),
    (_edit(layer_types=["full_attention"] * 4), "layer_types"),
    (_edit(layer_types=["linear_attention"] * 5), "layer_types"),
    (_edit(layer_types=["sliding_attention"] * 5, sliding_window=None), "sliding_window"),
    (_edit(num_key_value_heads=5), "num_key_value_heads"),
    (_edit(hidden_size=_DELETE), "hidden_size"),
    (_edit(num_target_layers=_DELETE), "num_target_layers"),
]


@pytest.mark.parametrize("d,key", BAD_DRAFTER, ids=[f"{k}-{i}" for i, (_, k) in enumerate(BAD_DRAFTER)])
def test_bad_drafter_keys_raise_with_key_value_and_fix(d, key):
    with pytest.raises(DFlashConfigError) as e:
        DFlashConfig.from_dict(d)
    assert key in e.value.key and "Fix:" in str(e.value)


BAD_TARGET = [
    (dict(TARGET, vocab_size=151665), "vocab_size"),
    (dict(TARGET, hidden_size=2048), "hidden_size"),
    (dict(TARGET, num_hidden_layers=28), "num_target_layers"),
]


@pytest.mark.parametrize("target,key", BAD_TARGET, ids=[k for _, k in BAD_TARGET])
def test_mismatched_target_raises(target, key):
    with pytest.raises(DFlashConfigError) as e:
        DFlashConfig.from_dict(PUBLISHED).validate_against_target(target)
    assert e.value.key == key and "Fix:" in str(e.value)


def test_layer_ids_out_of_target_range():
    d = _edit(dflash_target_layer_ids=[1, 9, 17, 25, 36])
    with pytest.raises(DFlashConfigError, match=r"\[36\] are outside"):
        DFlashConfig.from_dict(d).validate_against_target(TARGET)


def test_validates_against_real_transformers_configs():
    for arch in ("llama", "qwen3", "gemma3"):
        target = tiny_target(arch)
        DFlashConfig.from_dict(tiny_drafter_config(target.config)).validate_against_target(target.config)
        with pytest.raises(DFlashConfigError):
            d = tiny_drafter_config(target.config, target_layer_ids=[0, target.config.num_hidden_layers])
            DFlashConfig.from_dict(d).validate_against_target(target.config)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(DFlashConfigError, match="not found"):
        DFlashConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashConfigError, match="not valid JSON"):
        DFlashConfig.from_pretrained(tmp_path)
