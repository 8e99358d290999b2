"""The DFlash drafter as a plain PyTorch module (reference engine and training; the server uses SGLang layers).

Parameter names are the published ones (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``), so a checkpoint loads
unchanged. The drafter has no embedding and no lm_head: both belong to the target.

Data path of one forward:
    context  = hidden_norm(fc(concat of target hidden states at target_layer_ids))   [b, C, H], one row per token
    x        = target_embedding(block ids) * input_embedding_scale                   [b, Q, H]
    per layer: attention of the Q block queries over keys/values [context ; block]   (KV injection: every layer
               projects the same context with its own k_proj/v_proj, k_norm and RoPE; the context skips
               input_layernorm), then the SwiGLU MLP
    hidden   = norm(x)                                                                [b, Q, H]

Which keys a query may see is decided by positions: full-attention layers see the whole block (bidirectional),
causal / sliding layers apply their rules on top of the caller's ``visible`` mask (padding, or one block per anchor
in training). Training may pass a flex-attention ``BlockMask`` instead of the dense mask (full-attention layers
only: the BlockMask is then their whole rule), which builds no [Q, K] tensor.

DFlash2 drafters (``config.is_dflash2``) wrap each layer's attention and MLP in a grouped dynamic causal
convolution and pick their drafts with a candidate selector instead of the argmax (both in ``dflash2.py``): ``propose``
is THE draft head for both kinds.

The SGLang runtime twin is ``serving/draft_model.py`` (``DFlashDraftModel``, SGLang layers); both share
``draft_logits`` and the rope settings of ``DFlashConfig.rope_config``; ``tests/test_drafter_parity.py`` checks
that they compute the same thing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig
from .dflash2 import CandidateSelector, DraftBlock, GroupedCausalConv


class RMSNorm(nn.Module):
    """RMSNorm in float32; Gemma-style checkpoints store w and scale by (1 + w)."""

    def __init__(self, dim: int, eps: float, gemma_style: bool = False):
        super().__init__()
        self.eps, self.gemma_style = eps, gemma_style
        self.weight = nn.Parameter(torch.zeros(dim) if gemma_style else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma_style:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d]; cos/sin [b, n, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def layer_visibility(visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     causal: bool, window: int | None) -> torch.Tensor:
    """visible [b, Q, K] (the caller's mask) narrowed by a layer's causal and sliding-window rules."""
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # > 0: key is before the query
    if causal:
        visible = visible & (dist >= 0)
    if window is not None:
        visible = visible & (dist < window)
        if not causal:
            visible = visible & (-dist < window)
    return visible


class Rope:
    """Rotary embedding tables in float32 whatever the drafter's dtype (inv_freq is kept out of the module so that
    .to(bfloat16) cannot round it). The frequencies come from transformers' rope implementations."""

    def __init__(self, cfg: DFlashConfig):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        rope_cfg = cfg.rope_config()
        rope_type = rope_cfg.rope_parameters.get("rope_type", "default")
        init = (Qwen3RotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
                else ROPE_INIT_FUNCTIONS[rope_type])
        # config only: transformers 5.19 (SGLang 0.5.23's) dropped the default init's `device` parameter
        self.inv_freq, self.scaling = init(rope_cfg)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


@functools.lru_cache(maxsize=2)
def _flex_attention(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    import torch.nn.attention.flex_attention as fa

    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # eager CPU reference path (slow, tests), without warning spam
    return flex_attention


def check_flex_supported(cfg: DFlashConfig) -> None:
    """A flex BlockMask is the whole visibility rule of a layer, so only full-attention layers can take one."""
    bad = [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_causal(i) or cfg.layer_window(i)]
    if bad:
        raise ValueError(f"flex attention: drafter layers {bad} are causal/sliding. Fix: train with "
                         "attention='dense' (the dense mask applies those rules)")


def draft_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, cfg: DFlashConfig,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """THE draft logits, for both runtimes: hidden [.., H] through the TARGET's lm_head [V, H], optionally cast to
    `dtype` (the plain drafter: float32), then the config's output multiplier and final softcap."""
    logits = F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight)
    if dtype is not None:
        logits = logits.to(dtype)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma_norm)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma_norm)
        self.causal, self.window = cfg.layer_is_causal(layer), cfg.layer_window(layer)

    def key_values(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K = rope(k_norm(k_proj(rows))), V = v_proj(rows) of rows [b, n, H] (context rows or normed block rows) at
        the positions of cos/sin [b, n, d]; both [b, kv_heads, n, d]."""
        b = rows.shape[0]
        k = self.k_norm(self.k_proj(rows).view(b, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(rows).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, context, rope, q_pos, k_pos, visible):
        b, q_len, _ = x.shape
        cos, sin = rope
        # KV injection: context rows first, then the block; the context skips input_layernorm (x is already normed)
        k, v = self.key_values(torch.cat([context, x], dim=1), cos, sin)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        gqa = self.heads != self.kv_heads
        if isinstance(visible, torch.Tensor):
            mask = layer_visibility(visible, q_pos, k_pos, self.causal, self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
        else:  # a flex BlockMask (training): full-attention layers only, see check_flex_supported
            if self.causal or self.window:
                raise ValueError("a flex BlockMask reached a causal/sliding drafter layer. Fix: use the dense mask")
            out = _flex_attention(x.device.type)(q, k, v, block_mask=visible, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma_norm)
        # DFlash2: a convolution around each sublayer (its input before, its output after)
        self.attention_conv = GroupedCausalConv(cfg) if cfg.is_dflash2 else None
        self.mlp_conv = GroupedCausalConv(cfg) if cfg.is_dflash2 else None

    def forward(self, x, context, rope, q_pos, k_pos, visible):
        attn = _convolved(self.attention_conv, lambda h: self.self_attn(h, context, rope, q_pos, k_pos, visible))
        x = x + attn(self.input_layernorm(x))
        return x + _convolved(self.mlp_conv, self.mlp)(self.post_attention_layernorm(x))


def _convolved(conv: GroupedCausalConv | None, sublayer):
    """The sublayer, wrapped in its DFlash2 convolution if it has one."""
    if conv is None:
        return sublayer

    def wrapped(h):
        h, coefficients = conv.prepare(h)
        return conv.finish(sublayer(h), coefficients)

    return wrapped


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, cfg.gemma_norm)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, cfg.gemma_norm)
        self.candidate_selector = CandidateSelector(cfg) if cfg.is_dflash2 else None
        self.rope = Rope(cfg)

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[.., K*H] target hidden states (concatenated in target_layer_ids order) -> [.., H] context rows."""
        return self.hidden_norm(self.fc(target_features.to(self.fc.weight.dtype)))

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, context: torch.Tensor,
                context_positions: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds [b, Q, H], context [b, C, H] (from project_context), positions [b, Q] / [b, C] int64,
        visible [b, Q, C+Q] bool (None: everything visible) or a flex BlockMask over the same [Q, C+Q] (training,
        full-attention layers only). Returns the normed hidden states [b, Q, H]."""
        b, q_len, _ = block_embeds.shape
        x = block_embeds.to(self.fc.weight.dtype)
        context = context.to(x.dtype)
        k_pos = torch.cat([context_positions, block_positions], dim=1)
        if visible is None:
            visible = torch.ones(b, q_len, k_pos.shape[1], dtype=torch.bool, device=x.device)
        rope = self.rope(k_pos, x.dtype)
        for layer in self.layers:
            x = layer(x, context, rope, block_positions, k_pos, visible)
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits [.., V] float32 through the TARGET's lm_head (module function `draft_logits`)."""
        return draft_logits(hidden, lm_head_weight, self.config, torch.float32)

    def propose(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, anchor_ids: torch.Tensor,
                temperature: torch.Tensor | None = None, generator: torch.Generator | None = None,
                seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> DraftBlock:
        """THE draft head: hidden [n, L, H] of block positions 1..L -> the drafted tokens. DFlash: the argmax of the
        draft logits (point masses, whatever the temperature). DFlash2: the selector's path from anchor_ids [n]
        (the bonus tokens), argmax where temperature [n] is 0 (or None), else drawn from q at that temperature
        (with the seeded noise of (seeds, positions + i) where seeds [n] is given: CandidateSelector.walk)."""
        logits = self.draft_logits(hidden, lm_head_weight)
        if self.candidate_selector is None:
            return DraftBlock(logits.argmax(dim=-1))
        return self.candidate_selector.walk(hidden, logits, anchor_ids, temperature, generator, seeds, positions)

    def block_embeddings(self, block_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Rows of the TARGET's embedding table, times the config's input_embedding_scale."""
        return F.embedding(block_ids, embed_weight) * self.config.input_embedding_scale
