"""Random weights that behave like a model: the re-initialisation behind every exact-shape cost run (issue #44).

SGLang's `--load-format dummy` fills every floating tensor with uniform(-1e-3, 1e-3) drawn from one seed per
tensor *size*: every norm weight is ~0, every layer of a kind holds the same numbers, and the model's greedy output
is a loop of one or two tokens (or token 0 everywhere) whatever the prompt. Equality checks on such outputs can
barely fail, and a verify block of identical tokens routes to a handful of experts, so MoE step costs come out too
low. `model_like_init` rewrites those tensors as a trained model's are scaled, so that greedy outputs depend on the
context, differ across prompts and spread MoE routing:

- norm weights, `layer_scalar`, per-expert and router scales: 1 (as the norm applies its weight: a norm that scales
  by `1 + weight`, SGLang's GemmaRMSNorm and Gemma3RMSNorm as Qwen3.5 and Gemma-2/3 use them, or by
  `weight + scale_shift`, Gemma4RMSNorm, gets `1 - offset`; else every such norm doubled what it normalised);
- matrices (linear layers, fused experts, convolutions): N(0, 1 / fan_in), fan_in = the last dimension, so every
  layer keeps its input's scale;
- what a residual branch adds (attention and linear-attention output projections, MLP and expert down
  projections; in Gemma, whose post-norms rescale each branch, those norms' weights): scaled by 1 / sqrt(2 L), as
  trained models' branches are small against the stream. With unit-scale branches in every layer the first GPU run
  (benchmarks/results/floor-h200) saw plain decoding disagree with itself at other batch shapes far from any
  near-tie: bf16 noise flipped a token's expert choice and each layer carried the jump on;
- MoE routers: N(0, (ROUTER_STD / sqrt(hidden))^2): router logits of standard deviation ROUTER_STD, so the k-th and
  (k+1)-th experts are rarely within bf16 noise of each other while every token still picks its own experts;
- the token embedding: N(0, 1), or N(0, 1 / hidden) where the model multiplies it by sqrt(hidden) (Gemma), so its
  rows reach the first layer at unit scale either way;
- an untied lm_head: N(0, (LOGIT_STD / sqrt(hidden))^2): logits of standard deviation LOGIT_STD after the final norm;
- biases N(0, 0.02^2); attention sinks N(0, 1); anything else (e.g. a linear-attention layer's A_log) stays as
  SGLang made it.

Each tensor is drawn from its own generator seeded by (seed, tensor-parallel rank, tensor name), so a server
started twice with the same flags holds the same weights, and the plain and the speculative server of one run
serve the same target. Torch only: the SGLang hook that calls it lives in serving/plugin.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

LOGIT_STD = 4.0  # spread of an untied head's logits: top-2 gaps well above bf16 rounding on most steps
ROUTER_STD = 4.0  # spread of MoE router logits
BIAS_STD = 0.02
_ONES = "ones"
# a residual branch's last matrix (its output goes into the stream) by parameter name
_BRANCH_OUT = ("o_proj", "down_proj", "out_proj", "w2_weight")
# Gemma's branch post-norms: they normalise a branch's output, so their weight sets its scale
_GEMMA_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "post_feedforward_layernorm_2")


@dataclass(frozen=True)
class Scales:
    """What a model's tensors are drawn against: its hidden size, its embedding's std, the residual-branch factor
    1 / sqrt(2 L), and whether it is a Gemma (branch post-norms, sqrt(hidden)-scaled embedding)."""

    hidden: int
    embed_std: float
    branch: float
    gemma: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> Scales:
        config = getattr(model, "config", None)
        config = getattr(config, "text_config", None) or config
        hidden, layers = _hidden_size(model), int(getattr(config, "num_hidden_layers", 1) or 1)
        gemma = "gemma" in type(model).__name__.lower()
        return cls(hidden=hidden, embed_std=hidden ** -0.5 if gemma else 1.0, branch=(2 * layers) ** -0.5, gemma=gemma)


def _tensor_seed(seed: int, rank: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{rank}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_rule(name: str, shape: tuple[int, ...], sc: Scales) -> str | float | None:
    """How one tensor is re-drawn: "ones", a value to fill (a float in a 1-tuple), a normal's standard deviation
    (a float), or None (left as it is)."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf in ("layer_scalar", "scale", "per_expert_scale"):
        return _ONES
    if leaf == "sinks":
        return 1.0
    if "bias" in leaf:  # linear biases and fused experts' [E, out] biases; dt_bias of linear attention
        return BIAS_STD
    if len(shape) == 1:
        if sc.gemma and parent in _GEMMA_POST_NORMS:
            return (sc.branch,)
        return _ONES if "norm" in parent or "norm" in leaf else None
    if "embed_tokens" in name or parent in ("wte", "embed", "embeddings"):
        return sc.embed_std
    if parent == "lm_head":
        return LOGIT_STD / sc.hidden ** 0.5
    if "router" in name or parent == "gate":
        return ROUTER_STD / sc.hidden ** 0.5
    std = shape[-1] ** -0.5
    if not sc.gemma and (parent in _BRANCH_OUT or leaf in _BRANCH_OUT):
        std *= sc.branch
    return std


def model_like_init(model: torch.nn.Module, seed: int = 0, rank: int = 0) -> dict[str, int]:
    """Re-draw `model`'s floating tensors (parameters and persistent buffers) in place; returns how many tensors
    each rule touched. A tensor shared under two names (a tied head) is drawn once, by its first name."""
    sc = Scales.of(model)
    offsets = {f"{m}.weight" if m else "weight": off for m, mod in model.named_modules() if (off := norm_offset(mod))}
    counts = {"ones": 0, "filled": 0, "normal": 0, "kept": 0}
    seen: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not torch.is_floating_point(tensor) or tensor.numel() == 0:
                continue
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            rule = init_rule(name, tuple(tensor.shape), sc)
            if rule is None:
                counts["kept"] += 1
            elif rule == _ONES:
                tensor.fill_(1.0 - offsets.get(name, 0.0))
                counts["ones"] += 1
            elif isinstance(rule, tuple):
                tensor.fill_(rule[0] - offsets.get(name, 0.0))
                counts["filled"] += 1
            else:
                gen = torch.Generator(device=tensor.device)
                gen.manual_seed(_tensor_seed(seed, rank, name))
                # drawn in float32 (normal_ has no fp8 kernel), then cast into the tensor's own dtype
                draw = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device).normal_(
                    0.0, float(rule), generator=gen)
                tensor.copy_(draw)
                counts["normal"] += 1
    return counts


# norms that scale by (offset + weight): their "unit" weight is 1 - offset
_ONE_PLUS_WEIGHT_NORMS = ("GemmaRMSNorm", "Gemma3RMSNorm")


def norm_offset(module: torch.nn.Module) -> float:
    """What a norm module adds to its weight before scaling: 1 for SGLang's (1 + weight) norms, Gemma4RMSNorm's
    ``scale_shift``, else 0."""
    if type(module).__name__ in _ONE_PLUS_WEIGHT_NORMS:
        return 1.0
    shift = getattr(module, "scale_shift", None)
    return float(shift) if isinstance(shift, (int, float)) and "norm" in type(module).__name__.lower() else 0.0


def _hidden_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    hidden = getattr(config, "hidden_size", None)
    if hidden:
        return int(hidden)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and getattr(embed, "weight", None) is not None:
        return int(embed.weight.shape[-1])
    raise ValueError(f"{type(model).__name__}: no config.hidden_size and no input embedding to read the hidden size "
                     "from; model_like_init needs it to scale the embedding and the head")
