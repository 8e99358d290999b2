"""Tiny randomly initialised targets and drafters (Llama, Qwen3, Gemma3, Qwen2, Mistral, Phi-3) for tests, CI and
smoke runs.

Weights are random but deterministic (seeded). ``peak`` scales the lm_head so that logits are spread out: exact
top-2 ties (which make two correct decoders legitimately disagree) then become rare even in low precision.
"""

from __future__ import annotations

import torch

from ..config import DFlashConfig, embedding_scale_for_target, published_drafter_config
from ..drafter import DFlashDrafter

ARCHS = ("llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3")


def tiny_target(arch: str = "qwen3", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4,
                seed: int = 0, peak: float = 4.0, sliding_window: int = 8, dtype=torch.float32):
    """A small causal LM of the given family with random weights."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden_size // 4, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common), tf.Qwen3ForCausalLM
    elif arch == "gemma3":
        # alternate sliding and full layers with a short window, so sequences cross the window in tests
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        cfg = tf.Gemma3TextConfig(**common, sliding_window=sliding_window, layer_types=layer_types,
                                  query_pre_attn_scalar=hidden_size // 4)
        cls = tf.Gemma3ForCausalLM
    elif arch == "qwen2":
        # Qwen2: q/k/v biases; SGLang 0.5.17's Qwen2ForCausalLM has no DFLASH capture hook (our generic one serves it)
        common.pop("head_dim")
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "mistral":
        # no sliding window, as Mistral-7B v0.2 onwards (SGLang serves MistralForCausalLM as a Llama subclass)
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif arch == "phi3":
        # Phi-3: fused qkv_proj and gate_up_proj weights (SGLang serves Phi3ForCausalLM as a Llama subclass)
        common.pop("head_dim")
        cfg, cls = tf.Phi3Config(**common, rope_scaling=None), tf.Phi3ForCausalLM
    else:
        raise ValueError(f"arch={arch!r}: use one of {ARCHS}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(peak)
    return model.to(dtype).eval()


def tiny_drafter_config(target_config, num_layers: int = 1, block_size: int = 16,
                        target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                        **overrides) -> dict:
    """A config.json dict in the published layout (written by `published_drafter_config`), shaped for
    `target_config`. `overrides`: more `published_drafter_config` arguments or top-level keys."""
    n_target = target_config.num_hidden_layers
    hidden = target_config.hidden_size
    args = dict(hidden=hidden, inter=2 * hidden, layers=num_layers, heads=4, kv=2, head_dim=hidden // 4,
                vocab=target_config.vocab_size,
                ids=target_layer_ids if target_layer_ids is not None else [1, n_target - 2],
                mask=mask_token_id if mask_token_id is not None else target_config.vocab_size - 1,
                rope_theta=10000.0, max_pos=2048, block=block_size,
                input_embedding_scale=embedding_scale_for_target(target_config),
                torch_dtype=None)  # tiny drafters live in float32 unless cast; the saver records the dtype it writes
    args.update(overrides)
    return published_drafter_config(n_target, **args)


def tiny_drafter(target_config, seed: int = 1, dtype=torch.float32, **kwargs) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DFlashConfig.from_dict(tiny_drafter_config(target_config, **kwargs))).to(dtype).eval()


# The DFlash2 keys of the tiny drafters (hidden 64 = 4 groups of 16 channels; rank-8 codebooks; 4 candidates)
TINY_DFLASH2 = dict(architecture="DFlash2DraftModel", conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                    selector_top_k=4)


def tiny_dflash2_drafter(target_config, seed: int = 1, dtype=torch.float32, **kwargs) -> DFlashDrafter:
    """A tiny DFlash2 drafter (TINY_DFLASH2, then `kwargs`) whose convolutions and selector are random too: a fresh
    drafter's convolutions are the identity and its codebooks near zero, which would hide either from a test."""
    drafter = tiny_drafter(target_config, seed=seed, **{**TINY_DFLASH2, **kwargs})
    randomize_dflash2(drafter, seed)
    return drafter.to(dtype)


def as_dflash2(drafter: DFlashDrafter, seed: int = 1, **keys) -> DFlashDrafter:
    """A DFlash2 drafter with `drafter`'s backbone (a trained one keeps being accepted): identity convolutions and a
    random selector (TINY_DFLASH2, then `keys`)."""
    cfg = DFlashConfig.from_dict(drafter.config.to_dict(**{**TINY_DFLASH2, **keys}))
    torch.manual_seed(seed)
    out = DFlashDrafter(cfg).to(next(drafter.parameters()).dtype)
    missing, unexpected = out.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("_conv." in n or "candidate_selector." in n for n in missing), missing
    randomize_dflash2(out, seed, convolutions=False)
    return out.eval()


@torch.no_grad()
def randomize_dflash2(drafter: DFlashDrafter, seed: int, convolutions: bool = True) -> None:
    """Random DFlash2 weights in place: convolutions near the identity (tap 0 around 1, the others and the dynamic
    coefficients around 0), codebooks N(0, 1), so that transitions reorder the candidates now and then."""
    g = torch.Generator().manual_seed(seed)
    if convolutions:
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                base = torch.randn(conv.base_kernel.shape, generator=g) * 0.3
                base[:, 0] += 1.0
                conv.base_kernel.copy_(base)
                w = conv.kernel_projection.weight
                w.copy_(torch.randn(w.shape, generator=g) * 0.3 / w.shape[1] ** 0.5)
    sel = drafter.candidate_selector
    for w in (sel.predecessor_codebook, sel.successor_codebook):
        w.copy_(torch.randn(w.shape, generator=g))
