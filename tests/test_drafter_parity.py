"""The two runtimes of the drafter compute the same thing: the plain-torch `DFlashDrafter` (reference engine,
training) and the SGLang model `DFlashDraftModel` (serving, SGLang layers), loaded with the same weights, on CPU in
float32, without a server.

Checked: the context K/V the server writes into the draft KV pool (`write_context_kv`: fc + hidden_norm, then every
layer's K/V at once from stacked weights) equals every plain layer's `key_values` of the same context rows; the
block forward (fused qkv / gate_up linears, SGLang's norms and RoPE, `RadixAttention` with the layer's attention
type and window) equals the plain forward; the draft logits agree. SGLang's attention kernel itself is the one
stand-in: `ContextThenBlockAttention` below attends over the pool's context K/V and the block's own K/V with the
visibility SGLang's attention type and window define (ENCODER_ONLY: all keys; DECODER: causal, window), as the
torch_native backend would. The kernels are covered by the CPU server tests (tests/serving).

SGLang's layers pick their CPU implementations at import time (SGLANG_USE_CPU_ENGINE=1, and a stub libcuda for its
kernel package), so the checks run in a fresh subprocess with the CPU server's environment:
`test_parity_in_sglang_cpu_engine` runs this file there; outside it the checks themselves are skipped."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sglang_dflash.drafter import DFlashDrafter
from sglang_dflash.targets.tiny import tiny_drafter, tiny_target

IN_CPU_ENGINE = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
in_cpu_engine = pytest.mark.skipif(not IN_CPU_ENGINE, reason="runs inside test_parity_in_sglang_cpu_engine")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")

TOL = dict(atol=1e-5, rtol=1e-5)
CONTEXT, BLOCK = 11, 8


class DictKVPool:
    """Stands in for the draft KV pool: set_kv_buffer(layer, loc, k, v) as SGLang's MHATokenToKVPool takes it."""

    def __init__(self):
        self.k, self.v = {}, {}

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[layer.layer_id], self.v[layer.layer_id] = k.clone(), v.clone()


class ContextThenBlockAttention:
    """Stands in for SGLang's attention kernel, for one request: the block's queries over [context K/V from the pool ;
    the block's own K/V], visibility from the layer's attn_type and sliding_window_size."""

    def __init__(self, pool: DictKVPool, context_pos: torch.Tensor, block_pos: torch.Tensor):
        self.pool, self.k_pos, self.q_pos = pool, torch.cat([context_pos, block_pos]), block_pos

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **_):
        from sglang.srt.layers.radix_attention import AttentionType

        keys = torch.cat([self.pool.k[layer.layer_id], k]).transpose(0, 1)  # [kv_heads, C+Q, d]
        values = torch.cat([self.pool.v[layer.layer_id], v]).transpose(0, 1)
        queries = q.view(q.shape[0], layer.tp_q_head_num, layer.head_dim).transpose(0, 1)
        dist = self.q_pos[:, None] - self.k_pos[None, :]
        visible = torch.ones_like(dist, dtype=torch.bool)
        if layer.attn_type == AttentionType.DECODER:
            visible &= dist >= 0
        if layer.sliding_window_size > -1:  # SGLang's window: a query sees keys at distance <= window size
            visible &= dist <= layer.sliding_window_size
        out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=visible,
                                             scale=layer.scaling, enable_gqa=True)[0]
        return out.transpose(0, 1).reshape(q.shape[0], -1)


def sglang_twin(drafter: DFlashDrafter, target, tmp_dir):
    """DFlashDraftModel with the plain drafter's weights (published names through its own load_weights), built
    under CPU server args for the saved target (SGLang's layers read the published config as they are built)."""
    from sglang.srt.runtime_context import get_context, get_parallel
    from sglang.srt.server_args import ServerArgs

    from sglang_dflash.serving.draft_model import DFlashDraftModel

    target.save_pretrained(tmp_dir)
    args = ServerArgs(model_path=str(tmp_dir), device="cpu", dtype="float32", load_format="dummy",
                      skip_tokenizer_init=True)
    # one process, no tensor parallelism: SGLang's parallel linears read tp rank/size at construction
    with get_context().preserve_config(), get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1,
                                                                   attn_tp_rank=0):
        get_context().set_server_args(args)
        model = DFlashDraftModel(dict(drafter.config.raw)).float()
        model.load_weights(drafter.state_dict().items())
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def pair(request, tmp_path_factory):
    """qwen3: full-attention (non-causal) layers. gemma3: Gemma norms (1 + w), input_embedding_scale, a causal
    sliding layer beside a full one, an output multiplier and a logit softcap."""
    target = tiny_target(request.param)
    extra = {}
    if request.param == "gemma3":
        extra = dict(model_type="gemma3", num_layers=2, layer_types=["sliding_attention", "full_attention"],
                     sliding_window=5, final_logit_softcapping=7.0, output_multiplier=0.5)
    drafter = tiny_drafter(target.config, block_size=BLOCK, **extra)
    with torch.no_grad():  # random norm weights: a norm bug must not hide behind all-ones (or all-zeros) weights
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return request.param, target, drafter, sglang_twin(drafter, target, tmp_path_factory.mktemp(request.param))


def inputs(target, drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    features = torch.randn(CONTEXT, cfg.num_context_features * cfg.hidden_size, generator=g)
    block = torch.full((BLOCK,), cfg.mask_token_id)
    block[0] = int(torch.randint(cfg.vocab_size, (1,), generator=g))
    block[3] = int(torch.randint(cfg.vocab_size, (1,), generator=g))  # a non-mask token inside the block
    return features, block, torch.arange(CONTEXT), torch.arange(CONTEXT, CONTEXT + BLOCK)


def run_in_cpu_engine(test_file: str, tmp_path) -> str:
    """pytest on `test_file` (in this folder) in a fresh subprocess with the CPU server's environment; its stdout."""
    import shutil

    from sglang_dflash.testing import build_stub_libcuda, cpu_server_env

    if not shutil.which("gcc"):
        pytest.skip("the stub libcuda needs gcc")
    env = cpu_server_env(build_stub_libcuda(tmp_path / "stub"))
    # -n 0: in this process (pyproject's addopts would start two xdist workers for one file)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-W",
                        "ignore", Path(test_file).name], cwd=Path(__file__).parent, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.skipif(IN_CPU_ENGINE, reason="this is the subprocess")
def test_parity_in_sglang_cpu_engine(tmp_path):
    out = run_in_cpu_engine(__file__, tmp_path)
    assert "10 passed, 1 skipped" in out, out[-2000:]  # every check ran: 5 per drafter, 2 drafters


@in_cpu_engine
def test_config_shapes_what_is_checked(pair):
    arch, _, drafter, _ = pair
    cfg = drafter.config
    if arch == "gemma3":  # the cases this test means to cover are really in the config
        assert cfg.gemma_norm and cfg.input_embedding_scale != 1.0 and cfg.final_logit_softcapping
        assert cfg.output_multiplier != 1.0
        assert [cfg.layer_is_causal(i) for i in range(2)] == [True, False] and cfg.layer_window(0) == 5


@in_cpu_engine
@torch.no_grad()
def test_context_kv_written_by_the_server_equals_the_plain_layers(pair):
    _, target, drafter, model = pair
    features, _, ctx_pos, _ = inputs(target, drafter)
    pool = DictKVPool()
    model.write_context_kv(features, ctx_pos, torch.arange(CONTEXT), pool)
    context = drafter.project_context(features)[None]
    assert torch.allclose(model.project_context(features), context[0], **TOL)
    cos, sin = drafter.rope(ctx_pos[None], context.dtype)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.key_values(context, cos, sin)  # [1, kv_heads, C, d]
        assert torch.allclose(pool.k[i], k[0].transpose(0, 1), **TOL), f"layer {i}: context K differs"
        assert torch.allclose(pool.v[i], v[0].transpose(0, 1), **TOL), f"layer {i}: context V differs"


def served_and_plain(model, target, drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of `inputs` through the SGLang model (bound to the target; its context K/V written into a
    DictKVPool, attention by ContextThenBlockAttention) and through the plain drafter: both [Q, H]."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    model.bind_target(target.get_input_embeddings(), target.get_output_embeddings())
    embed = target.get_input_embeddings().weight
    features, block, ctx_pos, block_pos = inputs(target, drafter)
    pool = DictKVPool()
    model.write_context_kv(features, ctx_pos, torch.arange(CONTEXT), pool)
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    with forward_context(ForwardContext(attn_backend=ContextThenBlockAttention(pool, ctx_pos, block_pos))):
        served = model(block, block_pos, batch).hidden_states
    plain = drafter(drafter.block_embeddings(block[None], embed), block_pos[None],
                    drafter.project_context(features)[None], ctx_pos[None])[0]
    return served, plain


@in_cpu_engine
@torch.no_grad()
def test_block_forward_and_draft_logits_equal_the_plain_drafter(pair, monkeypatch):
    # RowParallelLinear asks the TP group (never initialised here) whether to use symmetric memory; one rank: no
    monkeypatch.setattr("sglang.srt.layers.linear.get_tp_group", lambda: SimpleNamespace(world_size=1))
    _, target, drafter, model = pair
    served, plain = served_and_plain(model, target, drafter)
    _, block, _, _ = inputs(target, drafter)
    assert torch.allclose(served, plain, **TOL), (served - plain).abs().max()
    lm_head = target.get_output_embeddings().weight
    served_logits, plain_logits = model.draft_logits(served[1:]), drafter.draft_logits(plain[1:], lm_head)
    assert torch.allclose(served_logits, plain_logits, **TOL)
    assert torch.equal(served_logits.argmax(-1), plain_logits.argmax(-1))
    assert torch.equal(model.greedy_drafts(served[1:], block[:1]), plain_logits.argmax(-1))


@in_cpu_engine
def test_features_of_the_wrong_width_stop_with_the_widths_and_the_fix(pair):
    """The Qwen3.5 failure (the final hidden state handed over instead of the captured layers): a named error with
    the widths, not a matmul shape error inside the drafter."""
    _, _, drafter, model = pair
    cfg = drafter.config
    model.target_name = "Qwen3_5MoeForCausalLM"
    one_layer = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(RuntimeError, match=f"Qwen3_5MoeForCausalLM handed the drafter {cfg.hidden_size} features.*"
                                           f"final hidden state.*Fix"):
        model.write_context_kv(one_layer, torch.arange(3), torch.arange(3), DictKVPool())


@in_cpu_engine
def test_served_loader_refuses_a_non_finite_weight_naming_it(pair):
    """SGLang's draft model loads through its own load_weights: a NaN or inf tensor stops it with the plain loader's
    error (checkpoint.check_finite), naming the tensor as the checkpoint spells it."""
    from sglang_dflash.config import DFlashConfigError

    _, _, drafter, model = pair
    for bad in (float("nan"), float("inf")):
        state = {f"model.{k}": v.clone() for k, v in drafter.state_dict().items()}
        state["model.layers.0.self_attn.k_proj.weight"][0, 1] = bad
        with pytest.raises(DFlashConfigError, match=r"model.layers.0.self_attn.k_proj.weight.*\d NaN and \d inf.*Fix"):
            model.load_weights(state.items())
