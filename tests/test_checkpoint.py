import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dflash.checkpoint import load_drafter, save_drafter
from sglang_dflash.config import DFlashConfig, DFlashConfigError
from sglang_dflash.targets.tiny import tiny_dflash2_drafter, tiny_drafter, tiny_drafter_config, tiny_target

PER_LAYER = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "self_attn.k_norm.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight",
]


def published_names(n_layers):
    return sorted(["fc.weight", "hidden_norm.weight", "norm.weight"]
                  + [f"layers.{i}.{n}" for i in range(n_layers) for n in PER_LAYER])


@pytest.fixture
def target():
    return tiny_target("qwen3")


def test_parameter_names_are_the_published_ones(target):
    drafter = tiny_drafter(target.config, num_layers=2)
    assert sorted(drafter.state_dict()) == published_names(2)
    h, k = target.config.hidden_size, len(drafter.config.target_layer_ids)
    assert drafter.fc.weight.shape == (h, k * h)  # fc: [H, K*H], no bias


def test_published_layout_loads_bit_exactly(tmp_path, target):
    """Write a checkpoint the way a published drafter is laid out (config.json + model.safetensors, written here
    without our save function), load it, and get the very same tensors back."""
    cfg = tiny_drafter_config(target.config, num_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(3)
    ref = tiny_drafter(target.config, num_layers=2).state_dict()
    tensors = {n: torch.randn(t.shape, generator=g).to(torch.bfloat16) for n, t in ref.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    drafter = load_drafter(tmp_path, target_config=target.config)
    assert next(drafter.parameters()).dtype == torch.bfloat16
    for n, t in drafter.state_dict().items():
        assert torch.equal(t, tensors[n]), n


def test_save_load_round_trip_sharded_and_prefixed(tmp_path, target):
    drafter = tiny_drafter(target.config, num_layers=2)
    save_drafter(drafter, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = list((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = load_drafter(tmp_path / "sharded")
    for n, t in drafter.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[n]), n
    # some exporters prefix every name with "model."
    save_drafter(drafter, tmp_path / "prefixed")
    state = load_file(str(tmp_path / "prefixed" / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in state.items()}, str(tmp_path / "prefixed" / "model.safetensors"))
    assert torch.equal(load_drafter(tmp_path / "prefixed").fc.weight, drafter.fc.weight)


def test_bad_checkpoints_name_the_problem(tmp_path, target):
    drafter = tiny_drafter(target.config)
    save_drafter(drafter, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    # a missing tensor
    save_file({k: v for k, v in state.items() if k != "norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="norm.weight"):
        load_drafter(tmp_path)
    # a tensor of the wrong shape
    state["fc.weight"] = state["fc.weight"][:, :-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="fc.weight"):
        load_drafter(tmp_path)
    # no weights at all
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DFlashConfigError, match="no \\*.safetensors"):
        load_drafter(tmp_path)
    # a drafter for another target
    other = tiny_target("qwen3", vocab_size=300)
    DFlashConfig.from_pretrained(tmp_path)  # the config alone is fine
    with pytest.raises(DFlashConfigError, match="vocab_size"):
        load_drafter(tmp_path, target_config=other.config)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, target, bad):
    """A drafter whose weights hold NaN or inf never loads (served, it would silently draft garbage): the error
    names the tensor, the count, the file and the fix. The same check (`check_finite`) runs in SGLang's draft model
    loader (tests/test_drafter_parity.py)."""
    drafter = tiny_drafter(target.config)
    save_drafter(drafter, tmp_path, dtype=torch.bfloat16)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["layers.0.mlp.up_proj.weight"].view(-1)[[3, 7]] = bad
    save_file(state, str(tmp_path / "model.safetensors"))
    kind = "2 NaN and 0 inf" if bad != bad else "0 NaN and 2 inf"
    with pytest.raises(DFlashConfigError, match=f"layers.0.mlp.up_proj.weight.*{kind}.*model.safetensors.*Fix: "
                                                "the checkpoint is corrupt"):
        load_drafter(tmp_path)


def test_cut_or_padded_safetensors_files_are_refused_naming_the_file(tmp_path, target):
    """A safetensors file that is not as long as its header says (a cut download at any point, or bytes appended)
    is refused by `check_safetensors_file` (headers only: start-up's check) and by the loader, naming the file and
    the fix, never with safetensors' own message; a shard the index names but the directory lacks, too."""
    from sglang_dflash.checkpoint import check_safetensors_file

    drafter = tiny_drafter(target.config)
    save_drafter(drafter, tmp_path / "whole")
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    check_safetensors_file(tmp_path / "whole" / "model.safetensors")
    cuts = {"header length": 5, "header": header_end - 10, "first tensor": header_end + 3,
            "last byte": len(whole) - 1, "empty": 0}
    for what, n in cuts.items():
        (tmp_path / what).mkdir()
        (tmp_path / what / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
        f = tmp_path / what / "model.safetensors"
        f.write_bytes(whole[:n])
        with pytest.raises(DFlashConfigError, match=f"{f}.*truncated.*Fix: download the drafter again"):
            check_safetensors_file(f)
        with pytest.raises(DFlashConfigError, match=f"{f}.*truncated"):
            load_drafter(tmp_path / what)
    f.write_bytes(whole + b"\0" * 16)
    with pytest.raises(DFlashConfigError, match="16 bytes past its last tensor.*Fix"):
        load_drafter(tmp_path / what)
    save_drafter(drafter, tmp_path / "sharded", max_shard_bytes=40_000)
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(DFlashConfigError, match="model-00002-of-.*is missing.*Fix: download the drafter again"):
        load_drafter(tmp_path / "sharded")


# ---------------------------------------------------------------------------------------------------------- DFlash2
def test_dflash2_round_trip_in_the_published_layout(tmp_path, target):
    """Saved with the published names (bare codebooks, as z-lab publishes and SGLang loads them), loaded bit for bit,
    and the same drafts from the loaded drafter."""
    drafter = tiny_dflash2_drafter(target.config, block_size=8)
    save_drafter(drafter, tmp_path, max_shard_bytes=100_000)
    names = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= names
    assert set(published_names(1)) < names
    loaded = load_drafter(tmp_path, target_config=target.config)
    assert loaded.config.is_dflash2
    for n, t in drafter.state_dict().items():
        assert torch.equal(t, loaded.state_dict()[n]), n


def test_dflash2_codebooks_under_the_packages_names(tmp_path, target):
    """The `dflash` package saves its nn.Embedding codebooks as `...codebook.weight`: loaded as the same tensors;
    both spellings of one codebook in a checkpoint are refused, naming it."""
    drafter = tiny_dflash2_drafter(target.config, block_size=8)
    save_drafter(drafter, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    renamed = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.candidate_selector.successor_codebook, drafter.candidate_selector.successor_codebook)
    renamed["candidate_selector.successor_codebook"] = state["candidate_selector.successor_codebook"].clone()
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="both 'candidate_selector.successor_codebook'"):
        load_drafter(tmp_path)


def test_dflash2_bad_checkpoints_name_the_tensor_and_the_key(tmp_path, target):
    drafter = tiny_dflash2_drafter(target.config, block_size=8)
    save_drafter(drafter, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    # a missing codebook
    save_file({k: v for k, v in state.items() if "predecessor" not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="candidate_selector.predecessor_codebook.*convolution and selector"):
        load_drafter(tmp_path)
    # codebooks of another rank than selector_rank
    codebook = "candidate_selector.predecessor_codebook"
    bad = dict(state, **{codebook: state[codebook][:, :4].contiguous()})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="predecessor_codebook.*selector_rank"):
        load_drafter(tmp_path)
    # a convolution of other taps than conv_kernel_size
    bad = dict(state, **{"layers.0.mlp_conv.base_kernel": state["layers.0.mlp_conv.base_kernel"][:, :2].contiguous()})
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match="mlp_conv.base_kernel.*conv_kernel_size"):
        load_drafter(tmp_path)
    # DFlash2 tensors under a DFlash config: the fix says which architecture
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del cfg["dflash_config"][key]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashConfigError, match="is a DFlash2 drafter"):
        load_drafter(tmp_path)
