"""Any GGUF file -> a checkpoint directory SGLang serves (`sglang-dflash convert GGUF_FILE OUT_DIR`).

The weights go through the same path as the shipped targets (gguf_wheels.py: transformers dequantizes them,
bf16, the head tied or the GGUF's own `output.weight`); what this module adds is what those modules hard-coded per
model, read from the GGUF's own metadata instead:
- eos / bos / pad token ids (`tokenizer.ggml.*_token_id`; llama.cpp's end-of-turn `eot` / `eom` ids join eos as
  stop ids). transformers 5.12 reads them into config.json but not into the tokenizer: its Llama converter names
  the bos token as eos (SmolLM2's tokenizer came out with eos `<|im_start|>`), and its Qwen2 converter names no
  eos at all (the default `</s>`, not in the vocabulary). So the tokenizer's special tokens are set here by id.
- the chat template (`tokenizer.chat_template`), the context length (`ARCH.context_length`, transformers'
  `max_position_embeddings`) and the rope base (written as `rope_theta`, which SGLang reads; gguf_wheels.py).
- the tokenizer: transformers' GGUF conversion, except where it is known to be wrong. Gemma's SentencePiece-BPE
  vocabulary becomes a Unigram model there (gemma3.py has the evidence); for Gemma-3 we rebuild it as BPE
  (`gemma3.tokenizer_from_gguf`, checked on Gemma-3-270M), for the other Gemma GGUFs we refuse and ask for the
  model's own tokenizer (`--tokenizer DIR`). Every tokenizer must decode a probe text back to itself.
Refused, with the reason and the fix: a missing or non-GGUF file, an architecture transformers cannot load as a
causal LM, and rope scaling the GGUF stores in a form transformers drops (Llama-3.1's `rope_freqs.weight`), which
would serve a model whose logits differ from the file's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .gguf_wheels import head_is_tied, load_dequantized, one_reader_per_file, write_checkpoint

MAGIC = b"GGUF"
# transformers' name of an architecture whose GGUF name differs (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
TRANSFORMERS_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                      "minimax-m2": "minimax_m2"}
# transformers 5.12 converts these GGUF vocabularies (SentencePiece BPE) into Unigram models that segment text
# differently from the model's own tokenizer (gemma3.py). gemma3 is rebuilt by us; the others are refused.
WRONG_TOKENIZER = ("gemma", "gemma2", "gemma3", "gemma4")
REBUILT_TOKENIZER = ("gemma3",)
# End-of-turn tokens by name, as llama.cpp recognises them when a GGUF names no eot id: a chat template that writes
# one ends every turn with it, so generation must stop there too, whatever tokenizer.ggml.eos_token_id names (a
# GGUF may name <eos> while its template closes turns with <end_of_turn>).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_text|>", "<EOT>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>")
PROBE = "Hello, world! The capital of France is Paris.\n  def f(x):\n\treturn x * 2  # caf\u00e9"


class GGUFConvertError(ValueError):
    """A GGUF file `convert` cannot turn into a checkpoint that serves the same model; the message says why and
    what to do."""


@dataclass
class GGUFMetadata:
    """What `convert` needs from a GGUF's key-value header and tensor list."""

    path: Path
    architecture: str
    fields: dict = field(repr=False)  # key -> value (str, int, float, bool or list)
    tensor_names: tuple[str, ...] = field(repr=False, default=())

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def arch(self, key: str, default=None):
        """An architecture-scoped key, e.g. arch("context_length") reads llama.context_length."""
        return self.fields.get(f"{self.architecture}.{key}", default)

    def token_id(self, kind: str) -> int | None:
        value = self.fields.get(f"tokenizer.ggml.{kind}_token_id")
        return None if value is None else int(value)

    @property
    def tokens(self) -> list[str]:
        return self.fields.get("tokenizer.ggml.tokens") or []

    def token(self, token_id: int | None) -> str | None:
        tokens = self.tokens
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    def stop_ids(self, chat_template: str | None = None) -> list[int]:
        """eos, llama.cpp's end-of-turn (eot) and end-of-message (eom) tokens, then the TURN_ENDS tokens the chat
        template writes: generation stops at any."""
        ids = [self.token_id(k) for k in ("eos", "eot", "eom")]
        tokens = self.tokens
        if chat_template and tokens:
            index = {t: i for i, t in enumerate(tokens) if t in TURN_ENDS}
            ids += [index[t] for t in TURN_ENDS if t in index and t in chat_template]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def transformers_architecture(self) -> str:
        return TRANSFORMERS_NAMES.get(self.architecture, self.architecture)


def read_metadata(path: str | Path) -> GGUFMetadata:
    """The GGUF's header (keys and tensor names), after checking that the file exists and is a GGUF."""
    path = Path(path)
    if not path.exists():
        raise GGUFConvertError(f"GGUF file {str(path)!r} does not exist. Fix: pass the path of a .gguf file")
    if not path.is_file():
        raise GGUFConvertError(f"{str(path)!r} is not a file. Fix: pass the path of a .gguf file (a split GGUF "
                               "must be merged first, e.g. with llama.cpp's gguf-split --merge)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise GGUFConvertError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, a GGUF with "
                               f"{MAGIC!r}). Fix: pass a .gguf file (for a safetensors checkpoint directory, no "
                               "conversion is needed: sglang-dflash serve --target DIR)")
    try:
        import gguf
    except ImportError:
        raise GGUFConvertError("the `gguf` package is needed to read GGUF files. Fix: pip install gguf "
                               "(or pip install -e '.[demo]')") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file: say which
        raise GGUFConvertError(f"{str(path)!r} could not be read as a GGUF ({type(e).__name__}: {e}). Fix: "
                               "download the file again (a truncated download fails here)") from None
    fields = {}
    for key, f in reader.fields.items():
        try:
            fields[key] = field_value(f)
        except Exception:  # noqa: BLE001 - a value type this reader cannot decode; convert never needs it
            continue
    arch = fields.get("general.architecture")
    if not arch:
        raise GGUFConvertError(f"{str(path)!r} has no general.architecture key. Fix: use a GGUF written by "
                               "llama.cpp's converters, which always write it")
    return GGUFMetadata(path, str(arch), fields, tuple(t.name for t in reader.tensors))


def field_value(f):
    """A GGUF key's value: a str / int / float / bool, or a list of them for an array."""
    if hasattr(f, "contents"):  # gguf >= 0.11
        return f.contents()
    import gguf
    from transformers.integrations.ggml import _gguf_parse_value  # older gguf: transformers' own reading

    value = [_gguf_parse_value(f.parts[i], f.types) for i in f.data]
    return value if f.types and f.types[0] == gguf.GGUFValueType.ARRAY else (value[0] if value else None)


def check_loadable(meta: GGUFMetadata) -> None:
    """Refuse before the (slow) weight load what transformers cannot load, or would load as another model."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))  # key groups
    if meta.transformers_architecture not in supported:
        raise GGUFConvertError(
            f"GGUF architecture {meta.architecture!r} is not one transformers can load from a GGUF (it loads "
            f"{', '.join(supported)}). Fix: serve the model's original Hugging Face "
            "checkpoint instead (sglang-dflash serve --target HF_DIR), or use a GGUF of a supported architecture")
    if "rope_freqs.weight" in meta.tensor_names:
        raise GGUFConvertError(
            "the GGUF stores per-frequency rope factors (rope_freqs.weight, Llama-3.1-style rope scaling), which "
            "transformers' GGUF loader drops: the converted model would compute other logits than the GGUF's. Fix: "
            "serve the model's original Hugging Face checkpoint instead (sglang-dflash serve --target HF_DIR)")
    scaling = meta.arch("rope.scaling.type")
    if scaling not in (None, "none") and meta.transformers_architecture != "gpt_oss":
        raise GGUFConvertError(
            f"the GGUF's rope scaling {meta.architecture}.rope.scaling.type={scaling!r} is not read by transformers' "
            "GGUF loader (only gpt-oss's is): the converted model would compute other logits than the GGUF's. Fix: "
            "serve the model's original Hugging Face checkpoint instead (sglang-dflash serve --target HF_DIR)")


def rope_settings(config) -> tuple[float, dict]:
    """(rope_theta, further config keys) to write explicitly: transformers 5 keeps the rope base only in
    rope_parameters, flat ({"rope_theta": ...}) or per layer type (Gemma-3: full and sliding attention), and SGLang
    reads `rope_theta` (and Gemma-3's `rope_local_base_freq`), falling back to 10000 without it."""
    rope = config.to_dict().get("rope_parameters") or {}
    if "full_attention" in rope:
        extra = {}
        if "sliding_attention" in rope:
            extra["rope_local_base_freq"] = rope["sliding_attention"].get("rope_theta", 10000.0)
        return float(rope["full_attention"].get("rope_theta", 10000.0)), extra
    return float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)), {}


# ------------------------------------------------------------------------------------------------ tokenizer
def load_tokenizer(meta: GGUFMetadata, tokenizer_dir: str | Path | None = None):
    """(tokenizer, where it came from): `tokenizer_dir` (the model's own), our Gemma-3 rebuild, or transformers'
    conversion of the GGUF's vocabulary."""
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        try:
            return AutoTokenizer.from_pretrained(str(tokenizer_dir)), f"{tokenizer_dir}"
        except Exception as e:  # noqa: BLE001
            raise GGUFConvertError(f"--tokenizer {str(tokenizer_dir)!r} could not be loaded ({type(e).__name__}: "
                                   f"{e}). Fix: pass a directory with the model's tokenizer.json (or tokenizer "
                                   "files) and tokenizer_config.json") from None
    if not meta.tokens:
        raise GGUFConvertError("the GGUF has no vocabulary (tokenizer.ggml.tokens). Fix: pass the model's own "
                               "tokenizer with --tokenizer DIR")
    if meta.architecture in REBUILT_TOKENIZER:
        from .gemma3 import tokenizer_from_gguf

        return tokenizer_from_gguf(meta.path, chat_template=None), "the GGUF's vocabulary, rebuilt as BPE (gemma3.py)"
    if meta.architecture in WRONG_TOKENIZER:
        raise GGUFConvertError(
            f"transformers' GGUF tokenizer conversion for {meta.architecture!r} builds a Unigram model from a "
            "SentencePiece-BPE vocabulary, which splits words into pieces the model never saw (see "
            "sglang_dflash/targets/gemma3.py), so the converted tokenizer would be wrong. Fix: pass the model's own "
            "tokenizer with --tokenizer DIR (the tokenizer files of its Hugging Face repository)")
    try:
        tok = AutoTokenizer.from_pretrained(str(meta.path.parent), gguf_file=meta.path.name)
    except Exception as e:  # noqa: BLE001
        raise GGUFConvertError(f"transformers could not build a tokenizer from the GGUF's vocabulary "
                               f"({type(e).__name__}: {e}). Fix: pass the model's own tokenizer with "
                               "--tokenizer DIR") from None
    return tok, "the GGUF's vocabulary (transformers' conversion)"


def fix_special_tokens(tok, meta: GGUFMetadata) -> list[str]:
    """Set the tokenizer's bos / eos / pad / unk tokens to the GGUF's ids (transformers' conversion misnames them,
    see the module docstring), and make it prepend bos exactly when the GGUF says so (tokenizer.ggml.add_bos_token).
    Returns what was changed, for the report."""
    changes = []
    for kind, gguf_kind in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        name = meta.token(meta.token_id(gguf_kind))
        if name is None:
            continue
        if getattr(tok, f"{kind}_token") != name:
            changes.append(f"{kind}_token {getattr(tok, f'{kind}_token')!r} -> {name!r}")
            setattr(tok, f"{kind}_token", name)
    add_bos, bos_id = meta.get("tokenizer.ggml.add_bos_token"), meta.token_id("bos")
    if add_bos is not None and bos_id is not None:
        ids = tok("a").input_ids
        adds = bool(ids) and ids[0] == bos_id
        if bool(add_bos) != adds:
            set_bos_prepending(tok, bool(add_bos), meta.token(bos_id), bos_id)
            changes.append(f"prepends bos: {adds} -> {bool(add_bos)} (tokenizer.ggml.add_bos_token)")
    return changes


def set_bos_prepending(tok, add: bool, bos: str, bos_id: int) -> None:
    """Prepend bos to every encoding (add) or to none, keeping the backend's other post-processing (byte-level
    offsets)."""
    from tokenizers import processors

    backend = tok.backend_tokenizer
    old = backend.post_processor
    keep = [] if old is None or isinstance(old, processors.TemplateProcessing) else [old]
    if add:
        template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                 special_tokens=[(bos, bos_id)])
        keep.append(template)
    backend.post_processor = processors.Sequence(keep) if len(keep) > 1 else (keep[0] if keep else None)
    if hasattr(tok, "add_bos_token"):
        try:
            tok.add_bos_token = add
        except Exception:  # noqa: BLE001 - read-only on some tokenizer classes; the backend decides
            pass


def check_tokenizer(tok, meta: GGUFMetadata, vocab_size: int) -> None:
    """The tokenizer fits the model and reads text back: refuse a broken one rather than write it."""
    if len(tok) > vocab_size:
        raise GGUFConvertError(f"the tokenizer has {len(tok)} tokens but the model's embedding has {vocab_size} "
                               "rows. Fix: pass the model's own tokenizer with --tokenizer DIR")
    for kind in ("eos", "bos"):
        tid, name = meta.token_id(kind), meta.token(meta.token_id(kind))
        if tid is not None and name is not None and tok.convert_tokens_to_ids(name) != tid:
            raise GGUFConvertError(f"the tokenizer maps the GGUF's {kind} token {name!r} to id "
                                   f"{tok.convert_tokens_to_ids(name)}, the GGUF to {tid}. Fix: pass the model's own "
                                   "tokenizer with --tokenizer DIR")
    ids = tok(PROBE, add_special_tokens=False).input_ids
    back = tok.decode(ids)
    if back != PROBE:
        raise GGUFConvertError(f"the converted tokenizer does not read text back: {PROBE!r} -> {len(ids)} tokens "
                               f"-> {back!r}. Fix: pass the model's own tokenizer with --tokenizer DIR")


# ------------------------------------------------------------------------------------------------ convert
@dataclass
class Converted:
    """What `convert_gguf` wrote, for the report."""

    out: Path
    architecture: str  # the transformers class, e.g. LlamaForCausalLM
    num_layers: int
    vocab_size: int
    context_length: int | None
    tied: bool
    stop_ids: list[int]
    stop_tokens: list[str]
    bos: str | None
    chat_template: str  # where it came from, or "none"
    tokenizer: str  # where it came from
    notes: list[str]


def convert_gguf(gguf: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                 chat_template: str | Path | None = None, force: bool = False) -> Converted:
    """Write a checkpoint directory SGLang and transformers load (config.json, bf16 model.safetensors, tokenizer,
    generation_config.json) from any GGUF transformers can dequantize; see the module docstring."""
    with one_reader_per_file():  # the header is parsed once, not once per transformers call
        return _convert(Path(gguf), Path(out_dir), tokenizer_dir, chat_template, force)


def _convert(gguf: Path, out: Path, tokenizer_dir, chat_template, force: bool) -> Converted:
    meta = read_metadata(gguf)
    check_loadable(meta)
    if out.exists() and not out.is_dir():
        raise GGUFConvertError(f"OUT_DIR {str(out)!r} exists and is not a directory. Fix: pass a new directory")
    if (out / "config.json").exists() or (out / "model.safetensors").exists():
        if not force:
            raise GGUFConvertError(f"{str(out)!r} already holds a checkpoint. Fix: pass another OUT_DIR, or "
                                   "--force to overwrite it")
        for name in ("model.safetensors", "config.json"):
            (out / name).unlink(missing_ok=True)
    template_text = None
    if chat_template is not None:
        if not Path(chat_template).is_file():
            raise GGUFConvertError(f"--chat-template {str(chat_template)!r} is not a file. Fix: pass a file holding "
                                   "a Jinja chat template (e.g. the chat_template.jinja of the model's repository)")
        template_text = Path(chat_template).read_text()
    tok, tok_source = load_tokenizer(meta, tokenizer_dir)  # before the weights: a refusal costs seconds, not minutes
    notes = [] if tokenizer_dir is not None else fix_special_tokens(tok, meta)
    if template_text is not None:
        tok.chat_template, template_source = template_text, str(chat_template)
    elif meta.get("tokenizer.chat_template"):
        tok.chat_template, template_source = meta.get("tokenizer.chat_template"), "the GGUF"
    elif getattr(tok, "chat_template", None):
        template_source = tok_source
    else:
        template_source = "none"
    try:
        model = load_dequantized(meta.path)
    except Exception as e:  # noqa: BLE001 - transformers' own message says what it could not load
        raise GGUFConvertError(f"transformers could not load the GGUF's weights ({type(e).__name__}: {e}). Fix: "
                               "serve the model's original Hugging Face checkpoint instead (sglang-dflash serve "
                               "--target HF_DIR)") from None
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(model.get_input_embeddings().weight.shape[0])
    check_tokenizer(tok, meta, vocab)
    stop_ids = meta.stop_ids(tok.chat_template if template_source != "none" else None)
    if not stop_ids:
        raise GGUFConvertError("the GGUF names no eos token (tokenizer.ggml.eos_token_id), so generation would "
                               "never stop. Fix: use a GGUF written by llama.cpp's converters, which write it")
    bos_id, pad_id = meta.token_id("bos"), meta.token_id("padding")
    eos = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    rope_theta, rope_extra = rope_settings(text_cfg)
    ids = {"bos_token_id": bos_id, "eos_token_id": eos, "pad_token_id": pad_id}
    ids = {k: v for k, v in ids.items() if v is not None}
    tied = head_is_tied(model)
    name = meta.get("general.name") or meta.path.stem
    write_checkpoint(model, tok, out, rope_theta=rope_theta,
                     config_updates=dict(architectures=[type(model).__name__], **rope_extra, **ids,
                                         _name_or_path=f"{name} (from {meta.path.name}, bf16)"),
                     generation_config=ids)
    context = getattr(text_cfg, "max_position_embeddings", None)
    if context is None:
        notes.append("the GGUF names no context length: config.json has transformers' default")
    if template_source == "none":
        notes.append("no chat template (a base model?): /v1/chat/completions and `train prepare` need one. Fix: "
                     "convert again with --chat-template FILE (a Jinja template)")
    (out / "conversion.json").write_text(json.dumps(
        {"gguf": str(meta.path), "general.architecture": meta.architecture, "tokenizer": tok_source,
         "chat_template": template_source, "stop_ids": stop_ids, "notes": notes}, indent=2) + "\n")
    return Converted(out, type(model).__name__, int(text_cfg.num_hidden_layers), vocab, context, tied, stop_ids,
                     [tok.convert_ids_to_tokens(i) for i in stop_ids], meta.token(bos_id), template_source, tok_source,
                     notes)
