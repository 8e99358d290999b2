"""DFlash2 in the two runtimes: the plain-torch `DFlashDrafter` of a DFlash2 config and the SGLang model
`serving.draft_model2.DFlash2DraftModel`, loaded with the same weights (the codebooks under the `dflash` package's
names on the SGLang side), on CPU in float32, without a server: the context K/V, the block forward (convolutions
around SGLang's attention and MLP) and the selector's drafts agree. Same harness as test_drafter_parity.py (its
attention stand-in and KV pool), in a fresh subprocess with the CPU server's environment."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from test_drafter_parity import TOL, inputs, run_in_cpu_engine, served_and_plain
from sglang_dflash.checkpoint import TENSOR_ALIASES
from sglang_dflash.targets.tiny import tiny_dflash2_drafter, tiny_target

IN_CPU_ENGINE = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
in_cpu_engine = pytest.mark.skipif(not IN_CPU_ENGINE, reason="runs inside test_dflash2_parity_in_sglang_cpu_engine")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
BLOCK = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    from sglang_dflash.serving.draft_model2 import DFlash2DraftModel

    target = tiny_target("qwen3")
    drafter = tiny_dflash2_drafter(target.config, block_size=BLOCK)
    tmp = tmp_path_factory.mktemp("target")
    target.save_pretrained(tmp)
    args = ServerArgs(model_path=str(tmp), device="cpu", dtype="float32", load_format="dummy",
                      skip_tokenizer_init=True)
    aliases = {name: alias for alias, name in TENSOR_ALIASES.items()}
    with get_context().preserve_config(), get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1,
                                                                   attn_tp_rank=0):
        get_context().set_server_args(args)
        model = DFlash2DraftModel(dict(drafter.config.raw)).float()
        model.load_weights((aliases.get(k, k), v) for k, v in drafter.state_dict().items())
    return target, drafter, model.eval()


@pytest.mark.skipif(IN_CPU_ENGINE, reason="this is the subprocess")
def test_dflash2_parity_in_sglang_cpu_engine(tmp_path):
    out = run_in_cpu_engine(__file__, tmp_path)
    assert "2 passed, 1 skipped" in out, out[-2000:]


@in_cpu_engine
@torch.no_grad()
def test_weights_land_under_their_published_names(pair):
    _, drafter, model = pair
    served = dict(model.named_parameters())
    for name, t in drafter.state_dict().items():
        if "_conv." in name or "candidate_selector." in name:
            assert torch.equal(served[name], t), name


@in_cpu_engine
@torch.no_grad()
def test_block_forward_and_drafts_equal_the_plain_drafter(pair, monkeypatch):
    monkeypatch.setattr("sglang.srt.layers.linear.get_tp_group", lambda: SimpleNamespace(world_size=1))
    target, drafter, model = pair
    served, plain = served_and_plain(model, target, drafter)  # [B, H] each, the convolutions inside
    assert torch.allclose(served, plain, **TOL), (served - plain).abs().max()
    lm_head = target.get_output_embeddings().weight
    anchor = inputs(target, drafter)[1][:1]
    served_block = model.propose(served[1:], anchor)
    plain_block = drafter.propose(plain[None, 1:], lm_head, anchor)
    assert torch.equal(served_block.tokens, plain_block.tokens)
    assert torch.allclose(served_block.q, plain_block.q)
    temperature, g = torch.tensor([0.8]), torch.Generator().manual_seed(0)
    sampled = model.propose(served[1:], anchor, temperature, g).tokens
    assert torch.equal(sampled, drafter.propose(plain[None, 1:], lm_head, anchor, temperature,
                                                torch.Generator().manual_seed(0)).tokens)
