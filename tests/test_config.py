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
    (_edit(architectures=["DFlash2DraftModel"]), "conv_kernel_size"),  # a DFlash2 name needs the DFlash2 keys
    (_edit(dflash_selector_rank=64), "selector_rank"),  # and a DFlash name none of them
    (_edit(dflash_output_multiplier=0.0), "output_multiplier"),
    (_edit(dflash_final_logit_softcapping=-30.0), "final_logit_softcapping"),
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


# ---------------------------------------------------------------------------------------------------------- DFlash2
# A DFlash2 config as z-lab publishes it (Qwen3.5-4B-DFlash2 style): the DFlash layout plus the convolution and
# selector keys in dflash_config.
PUBLISHED_DFLASH2 = copy.deepcopy(PUBLISHED)
PUBLISHED_DFLASH2["architectures"] = ["DFlash2DraftModel"]
PUBLISHED_DFLASH2["dflash_config"].update(conv_kernel_size=4, conv_group_size=128, selector_rank=64,
                                           selector_top_k=32, output_multiplier=1.0, final_logit_softcapping=30.0)


def _edit2(**changes):
    d = copy.deepcopy(PUBLISHED_DFLASH2)
    for k, v in changes.items():
        if v is _DELETE:
            d["dflash_config"].pop(k[len("dflash_"):])
        elif k.startswith("dflash_"):
            d["dflash_config"][k[len("dflash_"):]] = v
        else:
            d[k] = v
    return d


def test_parses_dflash2_keys():
    cfg = DFlashConfig.from_dict(PUBLISHED_DFLASH2)
    assert cfg.is_dflash2 and cfg.architecture == "DFlash2DraftModel"
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (4, 128, 64, 32)
    assert cfg.final_logit_softcapping == 30.0 and cfg.output_multiplier == 1.0
    assert DFlashConfig.from_dict(_edit2(architectures=["DFlash2BeamDraftModel"])).is_dflash2  # the alias
    assert not DFlashConfig.from_dict(PUBLISHED).is_dflash2
    # 0 / null softcap means none, as both exporters read it
    assert DFlashConfig.from_dict(_edit2(dflash_final_logit_softcapping=0)).final_logit_softcapping is None


def test_dflash2_round_trip_writes_the_published_layout(tmp_path):
    cfg = DFlashConfig.from_dict(PUBLISHED_DFLASH2)
    cfg.save(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert saved["dflash_config"] == PUBLISHED_DFLASH2["dflash_config"]
    assert DFlashConfig.from_pretrained(tmp_path) == cfg
    # the one writer puts the keys where SGLang reads them (dflash_config only)
    target = tiny_target("qwen3")
    d = tiny_drafter_config(target.config, architecture="DFlash2DraftModel", conv_kernel_size=3, conv_group_size=16,
                            selector_rank=8, selector_top_k=4, output_multiplier=0.5)
    assert {k: d["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                               "selector_top_k", "output_multiplier")} == dict(
        conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4, output_multiplier=0.5)
    assert DFlashConfig.from_dict(d).is_dflash2


def test_dflash_configs_write_no_dflash2_keys():
    """DFlash (v1) configs are written exactly as before: no DFlash2 key, no neutral multiplier or cap."""
    d = tiny_drafter_config(tiny_target("qwen3").config)
    assert set(d["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    assert d["architectures"] == ["DFlashDraftModel"]


BAD_DFLASH2 = [
    (_edit2(dflash_conv_kernel_size=_DELETE), "conv_kernel_size", "needs it"),
    (_edit2(dflash_conv_group_size=0), "conv_group_size", "needs it"),
    (_edit2(dflash_conv_group_size=100), "conv_group_size", "does not divide hidden_size=4096"),
    (_edit2(dflash_selector_rank=None), "selector_rank", "needs it"),
    (_edit2(dflash_selector_top_k=-1), "selector_top_k", "needs it"),
    (_edit2(dflash_selector_top_k=200_000), "selector_top_k", "exceeds vocab_size"),
    (_edit2(dflash_selector_rank=6.5), "selector_rank", "not an integer"),
    (_edit2(dflash_conv_kernel_size="4"), "conv_kernel_size", "not an integer"),
    (_edit2(dflash_output_multiplier=-1.0), "output_multiplier", "positive"),
]


@pytest.mark.parametrize("d,key,problem", BAD_DFLASH2, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(BAD_DFLASH2)])
def test_bad_dflash2_keys_name_key_problem_and_fix(d, key, problem):
    with pytest.raises(DFlashConfigError) as e:
        DFlashConfig.from_dict(d)
    assert e.value.key == f"dflash_config.{key}" and problem in str(e.value) and "Fix:" in str(e.value), str(e.value)
