"""Random weights that behave like a model (targets/random_weights.py, issue #44 item 1): greedy outputs of a
re-initialised target depend on the context and differ across prompts, where SGLang's dummy weights loop; the draw
is reproducible per (seed, rank, name); MoE routing spreads. The SGLang loader path (the plugin's hook under
`--load-format dummy`, every shape) is checked in tests/test_shape_startup.py."""

from __future__ import annotations

import pytest
import torch

from sglang_dflash.targets.random_weights import LOGIT_STD, ROUTER_STD, Scales, init_rule, model_like_init
from sglang_dflash.targets.tiny import tiny_target


def sglang_dummy(model: torch.nn.Module) -> None:
    """What SGLang 0.5.17's DummyModelLoader leaves: uniform(-1e-3, 1e-3), one seed for every tensor."""
    for t in model.state_dict().values():
        if torch.is_floating_point(t):
            g = torch.Generator()
            g.manual_seed(1234)
            t.uniform_(-1e-3, 1e-3, generator=g)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(n: int, vocab: int, length: int = 24) -> list[list[int]]:
    g = torch.Generator()
    g.manual_seed(0)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3"])
def test_outputs_depend_on_the_context_where_sglang_dummy_loops(arch):
    ps = prompts(8, 512)
    model = tiny_target(arch, vocab_size=512, hidden_size=64, num_layers=4)
    model_like_init(model)
    outs = [greedy(model, p, 32) for p in ps]
    assert len({tuple(o) for o in outs}) == len(ps)  # every prompt its own answer
    assert min(len(set(o)) for o in outs) >= 10  # no short loops
    # the history matters: the same last token after different prompts is followed by different tokens
    after_7 = {greedy(model, p[:-1] + [7], 1)[0] for p in ps}
    assert len(after_7) >= 3  # (SGLang's dummy weights: 1)
    if arch != "gemma3":  # the contrast, on the families whose dummy outputs loop (the Gemma-3 norm is 1 + w)
        sglang_dummy(model)
        assert max(len(set(greedy(model, p, 32)[-16:])) for p in ps) <= 2  # a loop of one or two tokens


def test_draw_is_reproducible_per_seed_rank_and_name():
    a, b, c = (tiny_target("qwen3", vocab_size=128, hidden_size=32, num_layers=2) for _ in range(3))
    model_like_init(a, seed=0, rank=0)
    model_like_init(b, seed=0, rank=0)
    model_like_init(c, seed=0, rank=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    q0, q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(sa[q0], sc[q0])  # another tensor-parallel rank: another shard
    assert not torch.equal(sa[q0], sa[q1])  # every layer its own weights (SGLang's dummy gives them the same)


def test_scales_follow_the_rules():
    model = tiny_target("llama", vocab_size=256, hidden_size=64, num_layers=2)
    counts = model_like_init(model)
    sd = model.state_dict()
    assert torch.equal(sd["model.norm.weight"], torch.ones(64))
    assert sd["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert sd["lm_head.weight"].std().item() == pytest.approx(LOGIT_STD / 8, rel=0.05)
    assert sd["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(64 ** -0.5, rel=0.05)
    # a residual branch's output projection: 1 / sqrt(2 L) smaller (L = 2 layers here)
    assert sd["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(128 ** -0.5 / 2, rel=0.05)
    assert sd["model.layers.0.self_attn.o_proj.weight"].std().item() == pytest.approx(64 ** -0.5 / 2, rel=0.05)
    assert counts["normal"] > 0 and counts["ones"] > 0


def test_rules_by_name():
    sc = Scales(hidden=64, embed_std=1.0, branch=0.125, gemma=False)
    assert init_rule("model.layers.3.layer_scalar", (1,), sc) == "ones"
    assert init_rule("model.layers.0.moe.per_expert_scale", (8,), sc) == "ones"
    assert init_rule("model.layers.0.router.scale", (64,), sc) == "ones"
    assert init_rule("model.layers.0.self_attn.q_norm.weight", (16,), sc) == "ones"
    assert init_rule("model.layers.0.post_attention_layernorm.weight", (64,), sc) == "ones"  # Llama: pre-MLP norm
    assert init_rule("model.layers.0.self_attn.sinks", (64,), sc) == 1.0
    assert init_rule("model.layers.0.mlp.experts.w13_weight_bias", (32, 128), sc) == 0.02
    assert init_rule("model.layers.0.mlp.experts.w13_weight", (32, 128, 64), sc) == 64 ** -0.5
    assert init_rule("model.layers.0.mlp.experts.w2_weight", (32, 64, 256), sc) == 256 ** -0.5 * 0.125
    assert init_rule("model.layers.0.linear_attn.out_proj.weight", (64, 256), sc) == 256 ** -0.5 * 0.125
    assert init_rule("model.layers.0.mlp.router.weight", (32, 64), sc) == ROUTER_STD / 8
    assert init_rule("model.layers.0.mlp.gate.weight", (32, 64), sc) == ROUTER_STD / 8
    assert init_rule("model.layers.0.linear_attn.A_log", (8,), sc) is None  # left as SGLang made it
    assert init_rule("fc.weight", (64, 320), sc) == 320 ** -0.5  # the drafter's context projection
    gemma = Scales(hidden=64, embed_std=0.125, branch=0.125, gemma=True)
    assert init_rule("model.embed_tokens.weight", (512, 64), gemma) == 0.125
    # Gemma's post-norms normalise each branch: their weight is the branch's scale; its projections stay unit
    assert init_rule("model.layers.0.post_feedforward_layernorm_2.weight", (64,), gemma) == (0.125,)
    assert init_rule("model.layers.0.pre_feedforward_layernorm.weight", (64,), gemma) == "ones"
    assert init_rule("model.layers.0.self_attn.o_proj.weight", (64, 256), gemma) == 256 ** -0.5


def test_tied_head_is_drawn_once_as_the_embedding():
    model = tiny_target("qwen3", vocab_size=128, hidden_size=32, num_layers=2)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    model_like_init(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.1)


def test_moe_routing_spreads():
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=16, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    model_like_init(model)
    ids = torch.tensor([prompts(1, 512, 64)[0]])
    with torch.no_grad():
        router = model(ids, output_router_logits=True).router_logits
    chosen = torch.cat([r.topk(2, dim=-1).indices.flatten() for r in router]).unique()
    assert chosen.numel() >= 14  # of 16 experts, over 64 tokens and 2 layers


def test_norms_that_add_to_their_weight_get_unit_scale():
    """SGLang's GemmaRMSNorm / Gemma3RMSNorm scale by (1 + weight) (Qwen3.5 uses them): their unit weight is 0;
    Gemma4RMSNorm scales by (weight + scale_shift). A plain RMSNorm keeps 1. (Set to 1 everywhere, the first Qwen3.5
    run doubled every normalised input.)"""

    class GemmaRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((8,), 0.5))

    class Gemma4RMSNorm(GemmaRMSNorm):
        scale_shift = 1.0

    class RMSNorm(GemmaRMSNorm):
        pass

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm, self.q_norm, self.norm = GemmaRMSNorm(), Gemma4RMSNorm(), RMSNorm()
            self.config = type("C", (), {"hidden_size": 8, "num_hidden_layers": 2})()

    b = Block()
    model_like_init(b)
    assert torch.equal(b.input_layernorm.weight, torch.zeros(8))  # 1 + 0 = 1
    assert torch.equal(b.q_norm.weight, torch.zeros(8))  # 0 + scale_shift 1 = 1
    assert torch.equal(b.norm.weight, torch.ones(8))
