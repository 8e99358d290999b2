"""The drafter's config.json: parse the published layout, validate it against the target.

A published DFlash drafter (e.g. z-lab/Qwen3-8B-DFlash-b16) is a Qwen3-style layer stack whose config.json carries
the usual transformer fields plus the DFlash keys: top-level ``block_size`` and ``num_target_layers`` and a
``dflash_config`` dict with ``target_layer_ids`` and ``mask_token_id``. Some keys moved between releases, so every
DFlash key is read from ``dflash_config`` first and from the top level second.

DFlash2 drafters (``architectures: ["DFlash2DraftModel"]``, or its alias ``DFlash2BeamDraftModel``) add, in
``dflash_config``: ``conv_kernel_size`` and ``conv_group_size`` (the grouped dynamic causal convolution around each
sublayer: taps, channels per group) and ``selector_rank`` and ``selector_top_k`` (the candidate selector: rank of its
two vocabulary codebooks, candidates per block position). ``output_multiplier`` and ``final_logit_softcapping``
(both DFlash and DFlash2) shape the draft logits.

Every problem raises :class:`DFlashConfigError`, whose message names the key, the bad value and what to do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SUPPORTED_ARCHITECTURE = "DFlashDraftModel"
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel")  # the Beam name is an alias (same model)
ARCHITECTURES = (SUPPORTED_ARCHITECTURE, *DFLASH2_ARCHITECTURES)
# the DFlash2 keys, all in dflash_config, all ints; 0 (or absent) means "not used", as SGLang reads them
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LAYER_TYPES = ("full_attention", "sliding_attention")


class DFlashConfigError(ValueError):
    """A drafter config that cannot be used; the message says which key, which value, and the fix."""

    def __init__(self, key: str, value: Any, problem: str, fix: str):
        self.key, self.value = key, value
        super().__init__(f"drafter config: {key}={value!r}: {problem}. Fix: {fix}")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids a drafter uses when its config names none: evenly spaced over [1, L-3], or [L//2] for one layer."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * span)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """Everything the drafter, the engine and the worker need to know about one drafter checkpoint."""

    # transformer shape (Qwen3 field names)
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    # DFlash
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal, full layers bidirectional (the paper's drafters)
    gemma_norm: bool = False  # RMSNorm scales by (1 + w), as Gemma does
    attention_bias: bool = False
    hidden_act: str = "silu"
    input_embedding_scale: float = 1.0  # block embeddings = target embedding table row * this
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash2 (0: absent; a DFlash2 architecture needs all four, a DFlash one none)
    architecture: str = SUPPORTED_ARCHITECTURE
    conv_kernel_size: int = 0  # taps of the grouped dynamic causal convolutions around each sublayer
    conv_group_size: int = 0  # channels per group (one dynamic coefficient per group and tap)
    selector_rank: int = 0  # rank of the candidate selector's two [V, r] codebooks
    selector_top_k: int = 0  # candidates per block position (top-K of the target lm_head's draft logits)
    # everything as read, so that rope settings and unknown keys survive a save
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DFlashConfig":
        archs = d.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise DFlashConfigError(
                "architectures", archs, f"this is not a drafter checkpoint we serve (one of {list(ARCHITECTURES)})",
                "pass a DFlash or DFlash2 drafter directory whose config.json lists its architecture")
        dflash = d.get("dflash_config") or {}

        def pick(key, default=None):
            return dflash.get(key, d.get(key, default))

        def count(key):  # a DFlash2 key: a non-negative int, 0 when absent or null
            value = pick(key)
            if value is None:
                return 0
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise DFlashConfigError(f"dflash_config.{key}", value, "is not an integer",
                                        f"write dflash_config.{key} as a JSON integer")
            return int(value)

        def need(key):
            if key not in d:
                raise DFlashConfigError(key, None, "missing", f"add '{key}' to config.json (a Qwen3Config field)")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        n_layers = int(need("num_hidden_layers"))
        head_dim = int(d.get("head_dim") or hidden // heads)

        num_target_layers = pick("num_target_layers")
        if num_target_layers is None:
            raise DFlashConfigError("num_target_layers", None, "missing",
                                    "set num_target_layers to the target's num_hidden_layers")
        num_target_layers = int(num_target_layers)

        ids = pick("target_layer_ids")
        ids = default_target_layer_ids(num_target_layers, n_layers) if ids is None else [int(i) for i in ids]

        mask = pick("mask_token_id")
        if mask is None:
            raise DFlashConfigError(
                "dflash_config.mask_token_id", None, "missing",
                "set dflash_config.mask_token_id to the id of a special token of the target's tokenizer")

        layer_types = tuple(d.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers:
            raise DFlashConfigError("layer_types", list(layer_types),
                                    f"has {len(layer_types)} entries for {n_layers} layers",
                                    "give one entry per drafter layer")
        for t in layer_types:
            if t not in LAYER_TYPES:
                raise DFlashConfigError("layer_types", list(layer_types), f"unknown layer type {t!r}",
                                        f"use one of {LAYER_TYPES}")
        window = d.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise DFlashConfigError("sliding_window", window, "sliding_attention layers need a window",
                                    "set sliding_window to a positive number of tokens")

        softcap = pick("final_logit_softcapping")
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            block_size=int(pick("block_size", 16)),
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(ids),
            mask_token_id=int(mask),
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            is_causal=None if d.get("is_causal") is None else bool(d["is_causal"]),
            gemma_norm=str(d.get("model_type", "")).startswith("gemma"),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            architecture=known[0],
            **{key: count(key) for key in DFLASH2_KEYS},
            raw=dict(d),
        )
        cfg.check()
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DFlashConfig":
        """Parse a drafter directory's (or file's) config.json afresh; serving code uses :meth:`load`."""
        file = _config_file(path)
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as e:
            raise DFlashConfigError("config.json", str(file), f"is not valid JSON ({e})",
                                    "re-download or re-export the drafter") from None

    @classmethod
    def load(cls, path: str | Path) -> "DFlashConfig":
        """THE drafter config of a process: parsed and checked once per file, then the same object for every caller.

        SGLang's launcher runs our startup checks, and each scheduler process builds our worker and then the draft
        model; all of them ask for the config of --speculative-draft-model-path. Memoised by the resolved file, its
        modification time and size, so a drafter rewritten in place (training writes into the same directory) is
        read again, and everyone else gets the one object. Treat it as read-only (``raw`` is a plain dict)."""
        file = _config_file(path)
        stat = file.stat()
        key = (str(file.resolve()), stat.st_mtime_ns, stat.st_size)
        cfg = _LOADED.get(key)
        if cfg is None:
            cfg = _LOADED[key] = cls.from_pretrained(file)
        return cfg

    def to_dict(self, **changes: Any) -> dict[str, Any]:
        """config.json in the published layout, written by `published_drafter_config` (the one writer) from this
        config's fields. Keys it does not write (rope settings, torch_dtype, unknown keys of the file this config was
        read from) are kept. `changes`: further `published_drafter_config` arguments (mask_token, torch_dtype, extra
        keys) for the copy being written."""
        raw = dict(self.raw)
        args: dict[str, Any] = dict(
            hidden=self.hidden_size, inter=self.intermediate_size, layers=self.num_hidden_layers,
            heads=self.num_attention_heads, kv=self.num_key_value_heads, head_dim=self.head_dim,
            vocab=self.vocab_size, ids=list(self.target_layer_ids), mask=self.mask_token_id, block=self.block_size,
            rms_norm_eps=self.rms_norm_eps, input_embedding_scale=self.input_embedding_scale,
            layer_types=list(self.layer_types), sliding_window=self.sliding_window, is_causal=self.is_causal,
            model_type=raw.get("model_type", "qwen3"), hidden_act=self.hidden_act,
            attention_bias=self.attention_bias, torch_dtype=None,  # None: torch_dtype as read (or absent)
            architecture=self.architecture, **{key: getattr(self, key) for key in DFLASH2_KEYS})
        if self.is_dflash2:  # DFlash2 writes the logit shaping into dflash_config (DFlash keeps it as read)
            if self.output_multiplier != 1.0:
                args["output_multiplier"] = self.output_multiplier
            if self.final_logit_softcapping:
                args["final_logit_softcapping"] = self.final_logit_softcapping
        args.update(changes)
        written = published_drafter_config(self.num_target_layers, **args)
        d = {**raw, **written}
        d["dflash_config"] = {**(raw.get("dflash_config") or {}), **written["dflash_config"]}
        return d

    def save(self, path: str | Path, **changes: Any) -> None:
        """Write config.json (`to_dict(**changes)`) into the directory `path`."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_dict(**changes), indent=2) + "\n")

    # --------------------------------------------------------------- validation
    def check(self) -> None:
        """Checks that need only the drafter's own config."""
        if self.block_size < 2:
            raise DFlashConfigError("block_size", self.block_size, "a block needs the bonus token plus >= 1 draft",
                                    "use block_size >= 2 (the published drafters use 16)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashConfigError("num_key_value_heads", self.num_key_value_heads,
                                    f"does not divide num_attention_heads={self.num_attention_heads}",
                                    "fix the head counts")
        if not self.target_layer_ids:
            raise DFlashConfigError("dflash_config.target_layer_ids", [], "empty",
                                    "list the target layers whose hidden states feed the drafter")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashConfigError("dflash_config.mask_token_id", self.mask_token_id,
                                    f"outside the vocabulary [0, {self.vocab_size})",
                                    "use the id of a special token that exists in the target's tokenizer")
        if not self.output_multiplier > 0:
            raise DFlashConfigError("dflash_config.output_multiplier", self.output_multiplier,
                                    "must be positive (it scales the draft logits)", "use 1.0 for none")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise DFlashConfigError("dflash_config.final_logit_softcapping", self.final_logit_softcapping,
                                    "is negative (DFlash's exporters read <= 0 as no cap)",
                                    "use a positive cap, or 0 / null for none")
        self._check_dflash2()

    def _check_dflash2(self) -> None:
        """A DFlash2 architecture needs all four DFlash2 keys; a DFlash one none of them (its model has no
        convolutions and no selector, so their tensors would go unused and the drafts would be wrong)."""
        values = {key: getattr(self, key) for key in DFLASH2_KEYS}
        if not self.is_dflash2:
            used = {k: v for k, v in values.items() if v}
            if used:
                key = next(iter(used))
                raise DFlashConfigError(f"dflash_config.{key}", used[key],
                                        f"is a DFlash2 key but architectures lists {self.architecture}",
                                        f'set architectures to ["{DFLASH2_ARCHITECTURES[0]}"] if the checkpoint '
                                        "has the convolution and selector tensors, else remove the DFlash2 keys")
            return
        what = {"conv_kernel_size": "the convolutions' taps (base_kernel is [2, taps, hidden_size])",
                "conv_group_size": "channels per convolution group (kernel_projection is [2 * taps * hidden_size "
                                   "/ group, hidden_size])",
                "selector_rank": "the codebooks' rank (candidate_selector.*_codebook is [vocab_size, rank])",
                "selector_top_k": "the candidates per block position the drafter was trained with"}
        for key, value in values.items():
            if value < 1:
                raise DFlashConfigError(f"dflash_config.{key}", value or None,
                                        f"{self.architecture} needs it (>= 1)",
                                        f"set dflash_config.{key} to {what[key]}")
        if self.hidden_size % self.conv_group_size:
            raise DFlashConfigError("dflash_config.conv_group_size", self.conv_group_size,
                                    f"does not divide hidden_size={self.hidden_size}",
                                    f"set it to {what['conv_group_size']}")
        if self.selector_top_k > self.vocab_size:
            raise DFlashConfigError("dflash_config.selector_top_k", self.selector_top_k,
                                    f"exceeds vocab_size={self.vocab_size}", f"set it to {what['selector_top_k']}")

    def validate_against_target(self, target_config: Any) -> None:
        """Raise DFlashConfigError unless this drafter can run on the target whose (HF) config is given."""
        t = _text_config(target_config)
        vocab, hidden, layers = (_get(t, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers"))
        if vocab is not None and int(vocab) != self.vocab_size:
            raise DFlashConfigError("vocab_size", self.vocab_size, f"the target's vocab_size is {vocab}",
                                    "use a drafter trained for this target (the drafter shares its embedding and "
                                    "lm_head, so the vocabularies must be identical)")
        if hidden is not None and int(hidden) != self.hidden_size:
            raise DFlashConfigError("hidden_size", self.hidden_size, f"the target's hidden_size is {hidden}",
                                    "use a drafter trained for this target")
        if layers is not None:
            layers = int(layers)
            if self.num_target_layers != layers:
                raise DFlashConfigError("num_target_layers", self.num_target_layers,
                                        f"the target has {layers} layers",
                                        "use a drafter trained for this target")
            bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
            if bad:
                raise DFlashConfigError("dflash_config.target_layer_ids", list(self.target_layer_ids),
                                        f"ids {bad} are outside the target's layers [0, {layers})",
                                        "list layer ids of the target (0-based decoder layer indices)")

    # ------------------------------------------------------------------ helpers
    @property
    def is_dflash2(self) -> bool:
        """A DFlash2 drafter: convolutions around each sublayer and a candidate selector after the lm_head."""
        return self.architecture in DFLASH2_ARCHITECTURES

    def layer_is_causal(self, layer: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    def rope_config(self):
        """A transformers Qwen3Config carrying this drafter's rope settings (rope maths lives in transformers)."""
        from transformers import Qwen3Config

        keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "partial_rotary_factor")
        kwargs = {k: self.raw[k] for k in keys if self.raw.get(k) is not None}
        return Qwen3Config(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           head_dim=self.head_dim, **kwargs)


def published_drafter_config(target_layers: int, *, hidden: int, inter: int, layers: int, heads: int, kv: int,
                             head_dim: int, vocab: int, ids: list[int], mask: int, rope_theta: float | None = None,
                             max_pos: int | None = None, block: int = 16, rms_norm_eps: float = 1e-6,
                             input_embedding_scale: float = 1.0, layer_types: list[str] | None = None,
                             sliding_window: int | None = None, is_causal: bool | None = None,
                             mask_token: str | None = None, model_type: str = "qwen3", hidden_act: str = "silu",
                             attention_bias: bool = False, torch_dtype: str | None = "bfloat16",
                             architecture: str = SUPPORTED_ARCHITECTURE, conv_kernel_size: int = 0,
                             conv_group_size: int = 0, selector_rank: int = 0, selector_top_k: int = 0,
                             **extra) -> dict[str, Any]:
    """THE writer of a drafter config.json dict in the published z-lab layout (Qwen3 layer stack + DFlash keys):
    what `DFlashConfig.from_dict` and SGLang's own parser read. Our trained drafters and every saved drafter
    (`DFlashConfig.to_dict`), the shape presets, the real targets' drafters and the tiny test drafters all come from
    here. `rope_theta`, `max_pos`, `torch_dtype`, `is_causal`, `mask_token`: None leaves the key out; `extra`: more
    top-level keys (they win). DFlash2 (`architecture` one of DFLASH2_ARCHITECTURES): the four DFLASH2_KEYS go into
    dflash_config, and so do `output_multiplier` / `final_logit_softcapping` given in `extra` (SGLang reads all six
    there only; a DFlash config keeps them where `extra` puts them, at the top level, as it always has)."""
    d = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "vocab_size": vocab, "hidden_act": hidden_act, "rms_norm_eps": rms_norm_eps, "attention_bias": attention_bias,
        "rope_theta": rope_theta, "max_position_embeddings": max_pos, "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "layer_types": list(layer_types or ["full_attention"] * layers),
        # written even when None: the drafters we trained and ship carry "sliding_window": null (transformers reads
        # null and absent alike, use_sliding_window being false)
        "sliding_window": sliding_window,
        "block_size": block, "num_target_layers": target_layers,
        "dflash_config": {"target_layer_ids": list(ids), "mask_token_id": mask},
        "is_causal": is_causal,
    }
    for key in ("rope_theta", "max_position_embeddings", "torch_dtype", "is_causal"):
        if d[key] is None:
            del d[key]
    if input_embedding_scale != 1.0:
        d["dflash_config"]["input_embedding_scale"] = input_embedding_scale
    if mask_token is not None:
        d["dflash_config"]["mask_token"] = mask_token
    dflash2 = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=selector_rank,
                   selector_top_k=selector_top_k)
    if architecture in DFLASH2_ARCHITECTURES or any(dflash2.values()):
        d["dflash_config"].update(dflash2)
        for key in ("output_multiplier", "final_logit_softcapping"):
            if key in extra:
                d["dflash_config"][key] = extra.pop(key)
    if sliding_window is not None:
        d["use_sliding_window"] = True
    d.update(extra)
    return d


def _config_file(path: str | Path) -> Path:
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise DFlashConfigError("config.json", str(file), "not found",
                                "point --speculative-draft-model-path at the drafter's directory")
    return file


# DFlashConfig.load's memo: (resolved config.json, mtime_ns, size) -> the one parsed, checked config
_LOADED: dict[tuple[str, int, int], DFlashConfig] = {}


def _text_config(cfg: Any) -> Any:
    sub = _get(cfg, "text_config")
    return sub if sub is not None and _get(cfg, "vocab_size") is None else cfg


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def text_field(config: Any, key: str) -> Any:
    """A field of a target's (text) config, from a config.json dict or a transformers config alike."""
    return _get(_text_config(config), key)


def embedding_scale_for_target(target_config: Any) -> float:
    """Gemma targets scale token embeddings by sqrt(hidden); a drafter trained for them records the same scale."""
    t = _text_config(target_config)
    return math.sqrt(_get(t, "hidden_size")) if str(_get(t, "model_type") or "").startswith("gemma") else 1.0
