"""Tiny checkpoints SGLang loads: a tokenizer trained offline, tiny random targets, drafters in the published layout.

For the CPU server tests (tests/serving) and the GPU end-to-end run on the tiny pair (benchmarks/gpu_e2e.py).
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512):
    """A byte-level BPE trained offline on torch's functional.py; ids 0..4 are SPECIALS (eos = 1, mask = 4)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    src = Path(torch.__file__).parent / "functional.py"
    text = [line for line in src.read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT
    fast.save_pretrained(str(out_dir))
    return fast


def save_for_sglang(model, out_dir: str | Path) -> Path:
    """A transformers model as a checkpoint directory SGLang 0.5.17 loads as written: transformers 5 writes only
    rope_parameters, while SGLang reads rope_theta (falling back to 10000), and the dtype is written explicitly."""
    path = Path(out_dir)
    model.save_pretrained(str(path))
    dtype = str(model.dtype).removeprefix("torch.")
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        cfg["rope_theta"] = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def save_tiny_target(out_dir: str | Path, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 4,
                     peak: float = 8.0, seed: int = 0, vocab_size: int = 512, dtype: str = "float32",
                     tie_word_embeddings: bool = False):
    """A tiny random target (sglang_dflash.targets.tiny) as an HF checkpoint directory with a tokenizer; returns
    the model.

    ``tie_word_embeddings``: the (peak-scaled) lm_head becomes the embedding table too, for model classes that
    always compute logits with their embedding table (SGLang 0.5.17's Gemma3ForCausalLM)."""
    import torch

    from ..targets.tiny import tiny_target

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size)
    model = tiny_target(arch, vocab_size=len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
                        peak=peak, dtype=getattr(torch, dtype))
    if tie_word_embeddings:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(model.get_output_embeddings().weight)
        model.config.tie_word_embeddings = True
        model.tie_weights()
    save_for_sglang(model, out)
    return model


def save_drafter_dir(drafter, target_dir: str | Path, out_dir: str | Path, dtype: str = "float32",
                     mask_token: str | None = "<|mask|>") -> None:
    """Write a drafter (sglang_dflash.drafter.DFlashDrafter) in the published layout, with the target's tokenizer.
    mask_token: the name written next to mask_token_id (the tiny tokenizers' "<|mask|>"; None: id only)."""
    import shutil

    import torch

    from ..checkpoint import save_drafter

    out = Path(out_dir)
    # config.json through the one writer (config.published_drafter_config): the name of the mask token and the
    # dtype the weights are written in (torch_dtype for SGLang 0.5.17, dtype for transformers 5)
    save_drafter(drafter, out, dtype=getattr(torch, dtype),
                 config_changes=dict(mask_token=mask_token or None, torch_dtype=dtype, dtype=dtype))
    for f in Path(target_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
