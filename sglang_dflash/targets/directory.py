"""A target given as a checkpoint directory (`sglang-dflash convert`'s output, or any Hugging Face causal-LM
directory with a tokenizer): what the training pipeline (`python -m sglang_dflash.train ... --target DIR`) needs
from a target, read from the directory instead of hard-coded as in smollm2.py / gemma3.py.

The drafter's defaults come from the target (`drafter_config_for`), as the shipped drafters' did by hand: the
target's hidden size, heads, MLP width, rms eps, rope base and context length (max_position_embeddings: a drafter
must place context positions as far as the target serves), target layers spread over the depth like the published
drafters' ([1 .. L-3], five of them), and a mask token the tokenizer has (`pick_mask_token`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import default_target_layer_ids, embedding_scale_for_target, published_drafter_config
from .gguf_wheels import prompt_ids

# special tokens named as spares or masks (Llama-3's <|reserved_special_token_N|>, Gemma's <unusedN>, a <|mask|> that
# the tokenizer does not declare as its mask token)
MASK_WORDS = ("reserved", "unused", "mask")


def is_target_dir(value: str | Path) -> bool:
    return Path(value).is_dir() and (Path(value) / "config.json").is_file()


def pick_mask_token(tokenizer, vocab_size: int) -> tuple[int, str | None, str]:
    """(id, token or None, why) of the drafter's mask token: a token the target never reads in text or in its chat
    template, whose embedding row exists. In order:
    1. the tokenizer's own mask token (Gemma-3's <mask>, the shipped Gemma drafter's);
    2. a special token named as a spare or a mask ("reserved", "unused", "mask"), the highest id;
    3. an embedding row past the tokenizer's last token (no text maps to it; z-lab's Qwen3 drafters use 151669,
       the first row past Qwen3's tokenizer);
    4. a special token that is neither bos / eos / pad / unk nor in the chat template, the highest id (SmolLM2:
       <empty_output>, id 16, the shipped SmolLM2 drafter's)."""
    vocab = tokenizer.get_vocab()
    if tokenizer.mask_token is not None and vocab.get(tokenizer.mask_token, vocab_size) < vocab_size:
        return vocab[tokenizer.mask_token], tokenizer.mask_token, "the tokenizer's mask token"
    roles = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    spare = sorted((i, t.content) for i, t in tokenizer.added_tokens_decoder.items()
                   if t.special and i not in roles and i < vocab_size and t.content not in template)
    named = [(i, c) for i, c in spare if any(w in c.lower() for w in MASK_WORDS)]
    if named:
        return named[-1][0], named[-1][1], "a special token named as a spare or a mask"
    if vocab_size > len(tokenizer):
        return len(tokenizer), None, (f"the first embedding row past the tokenizer's {len(tokenizer)} tokens "
                                      f"(the embedding has {vocab_size}): no text maps to it")
    if spare:
        return spare[-1][0], spare[-1][1], ("a special token that is not bos / eos / pad / unk and that the chat "
                                            "template never writes")
    raise ValueError(f"no mask token for the drafter: the tokenizer has no mask token, no spare special token, and "
                     f"its {len(tokenizer)} tokens fill the embedding's {vocab_size} rows. Fix: pass "
                     "--mask-token-id N (a token id that text and the chat template never produce)")


def drafter_config_for(target_config, tokenizer, num_layers: int = 2, target_layer_ids=None, block_size: int = 16,
                       intermediate_size: int | None = None, mask_token_id: int | None = None) -> tuple[dict, str]:
    """(config.json dict of a DFlash drafter for this target in the published layout, how the mask was chosen)."""
    from .gguf_file import rope_settings

    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    layers, hidden, heads = int(t.num_hidden_layers), int(t.hidden_size), int(t.num_attention_heads)
    if target_layer_ids is None:
        target_layer_ids = sorted({i for i in default_target_layer_ids(layers, 5) if 0 <= i < layers}) or [layers // 2]
    mask_name = None
    if mask_token_id is None:
        mask_token_id, mask_name, why = pick_mask_token(tokenizer, int(t.vocab_size))
    else:
        why = "--mask-token-id"
    cfg = published_drafter_config(
        layers, hidden=hidden, inter=int(intermediate_size or t.intermediate_size), layers=num_layers, heads=heads,
        kv=int(getattr(t, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(t, "head_dim", None) or hidden // heads), vocab=int(t.vocab_size),
        ids=list(target_layer_ids), mask=int(mask_token_id), rope_theta=rope_settings(t)[0],
        max_pos=getattr(t, "max_position_embeddings", None), block=block_size,
        rms_norm_eps=float(getattr(t, "rms_norm_eps", 1e-6)), input_embedding_scale=embedding_scale_for_target(t),
        mask_token=mask_name)
    return cfg, f"mask token id {mask_token_id}" + (f" {mask_name!r}" if mask_name else "") + f": {why}"


class DirectoryTarget:
    """The interface of smollm2.py / gemma3.py (load_tokenizer, load_target, chat_ids, drafter_config, convert,
    STOP_IDS, PAD_ID, VOCAB_SIZE, GGUF) for a checkpoint directory."""

    GGUF = None  # already converted: --gguf does not apply

    def __init__(self, path: str | Path):
        from transformers import AutoConfig

        self.path = Path(path)
        if not is_target_dir(self.path):
            raise ValueError(f"--target {str(path)!r}: no config.json there. Fix: pass a checkpoint directory "
                             "(sglang-dflash convert GGUF_FILE DIR writes one), or one of smollm2, gemma3, tiny")
        self.config = AutoConfig.from_pretrained(str(self.path))
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.VOCAB_SIZE = int(text.vocab_size)
        gen = self.path / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        self.STOP_IDS = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if not self.STOP_IDS:
            raise ValueError(f"--target {str(path)!r}: neither generation_config.json nor config.json names an "
                             "eos_token_id, so generation would never stop. Fix: add eos_token_id to config.json")
        pad = getattr(text, "pad_token_id", None)
        self.PAD_ID = int(pad) if pad is not None else int(self.STOP_IDS[0])
        self._tokenizer = None
        self.mask_choice = None  # how drafter_config chose the mask token, for the log

    def load_tokenizer(self, path=None):
        from transformers import AutoTokenizer

        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        return self._tokenizer

    def load_target(self, dtype: torch.dtype = torch.float32, device="cpu", hf_dir=None):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.path), dtype=dtype).to(device).eval()

    def chat_ids(self, tokenizer, user_text: str, system: str | None = None) -> list[int]:
        if not tokenizer.chat_template:
            raise SystemExit(f"the target {self.path} has no chat template, and training prompts are chat turns. "
                             "Fix: convert it again with `sglang-dflash convert GGUF OUT --chat-template FILE --force`"
                             " (or add chat_template.jinja to the directory)")
        return prompt_ids(tokenizer, user_text, system)

    def convert(self, hf_dir=None) -> Path:
        return self.path

    def drafter_config(self, num_layers: int = 2, target_layer_ids=None, block_size: int = 16,
                       intermediate_size: int | None = None, mask_token_id: int | None = None) -> dict:
        cfg, self.mask_choice = drafter_config_for(self.config, self.load_tokenizer(), num_layers, target_layer_ids,
                                                   block_size, intermediate_size, mask_token_id)
        return cfg
