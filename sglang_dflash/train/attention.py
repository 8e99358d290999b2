"""The drafter's forward for training with a flex-attention BlockMask instead of a dense [Q, K] mask.

Same maths as DFlashDrafter.forward (KV injection of the context into every layer, RoPE at each key's position),
built from the drafter's own submodules, only the attention call differs. Full-attention layers only: their
visibility is exactly the block mask; causal / sliding layers use the dense path (DFlashDrafter.forward).
On CUDA the flex kernel is compiled once (torch.compile); on CPU it runs eagerly (slow, for tests).
"""

from __future__ import annotations

import functools

import torch

from ..drafter import DFlashDrafter, apply_rope


@functools.lru_cache(maxsize=2)
def _flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    import torch.nn.attention.flex_attention as fa

    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # eager CPU reference path, without the warning spam
    return flex_attention


def check_flex_supported(drafter: DFlashDrafter) -> None:
    cfg = drafter.config
    bad = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_causal(i) or cfg.layer_window(i)]
    if bad:
        raise ValueError(f"flex training path: drafter layers {bad} are causal/sliding. Fix: train with "
                         "attention='dense' (the dense mask applies those rules)")


def forward_flex(drafter: DFlashDrafter, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                 context: torch.Tensor, context_positions: torch.Tensor, block_mask) -> torch.Tensor:
    """DFlashDrafter.forward with flex attention; returns the normed hidden states [b, Q, H]."""
    flex = _flex(block_embeds.device.type)
    x = block_embeds.to(drafter.fc.weight.dtype)
    context = context.to(x.dtype)
    k_pos = torch.cat([context_positions, block_positions], dim=1)
    cos, sin = drafter.rope(k_pos, x.dtype)
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        b, q_len, _ = h.shape
        kv_in = torch.cat([context, h], dim=1)
        q = attn.q_norm(attn.q_proj(h).view(b, q_len, attn.heads, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(kv_in).view(b, -1, attn.kv_heads, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(kv_in).view(b, -1, attn.kv_heads, attn.head_dim).transpose(1, 2)
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos, sin)
        out = flex(q, k, v, block_mask=block_mask, enable_gqa=attn.heads != attn.kv_heads)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)
