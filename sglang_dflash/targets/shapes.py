"""Exact-shape, weight-free checkpoints of the seed targets and their DFlash drafters, for cost measurements.

No weights can be fetched here, and the cost of a decode step does not depend on the weights' values. So this
module writes only ``config.json`` (and, optionally, a tokenizer copied from a directory you name); SGLang then
builds randomly initialised weights of the right shapes itself with ``--load-format dummy`` (target) and
``--speculative-draft-load-format dummy`` (drafter) -- see ``sglang/srt/model_loader/loader.py:DummyModelLoader``
and ``sglang/srt/speculative/draft_worker_common.py:_draft_load_format_fields`` in sglang 0.5.17. Without a
tokenizer, start the server with ``--skip-tokenizer-init`` and send ``input_ids`` (the benchmark's ``random``
dataset does).

Acceptance measured on such a pair is meaningless (tau ~ 1: only the bonus token survives) and must never be
reported as acceptance. What it does measure: the cost of one speculative step relative to one plain decode
step, from which the throughput a given tau implies follows (see benchmarks/README.md).

    python -m sglang_dflash.targets.shapes list
    python -m sglang_dflash.targets.shapes write qwen3-8b OUT          # OUT/target/config.json, OUT/draft/config.json
    python -m sglang_dflash.targets.shapes write qwen3-8b OUT --tokenizer-from DIR
    python -m sglang_dflash.targets.shapes write qwen3-8b OUT --dflash2   # the drafter as a DFlash2 drafter

The table is data: shapes.json beside this module, where every value names its source. The public model hub
cannot be reached from this workplace, so the configs were read from public code that reproduces them (test
fixtures and docs of other projects, found with the code search); values that come from one source only, or
where sources disagree, are marked UNVERIFIED in ``notes``. Check them against the real ``config.json``
before quoting a number as "the shape of X".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..config import published_drafter_config


@dataclass(frozen=True)
class Shape:
    """One target (and, where it has one, its DFlash drafter) as config.json dicts."""

    name: str
    target: dict[str, Any]
    drafter: dict[str, Any] | None
    sources: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # published parameter count of the text model (embeddings included), to check the shape against
    published_params: float | None = None


def _load_shapes() -> dict[str, Shape]:
    """The table in shapes.json (shipped as package data). A drafter is stored as the arguments of
    `published_drafter_config`, so the published layout has one writer."""
    table = json.loads(resources.files(__package__).joinpath("shapes.json").read_text(encoding="utf-8"))
    shapes = {}
    for s in table["shapes"]:
        drafter = published_drafter_config(**s["drafter"]) if s.get("drafter") else None
        shapes[s["name"]] = Shape(name=s["name"], target=s["target"], drafter=drafter, sources=tuple(s["sources"]),
                                  notes=tuple(s.get("notes", ())), published_params=s.get("published_params"))
    return shapes


SHAPES: dict[str, Shape] = _load_shapes()

# What `--dflash2` adds to a shape's drafter: the DFlash2 keys with the values z-lab's published DFlash2 configs use
# (Qwen3.5-4B-DFlash2 style, as in tests/test_config.py's PUBLISHED_DFLASH2): the same layer stack plus the
# convolutions and the candidate selector, for the DFlash2 step's cost against the DFlash one (issue #36 item 4).
DFLASH2_KEYS = {"architectures": ["DFlash2DraftModel"]}
DFLASH2_CONFIG = {"conv_kernel_size": 4, "conv_group_size": 128, "selector_rank": 64, "selector_top_k": 32,
                  "output_multiplier": 1.0, "final_logit_softcapping": 30.0}


def as_dflash2(drafter: dict[str, Any]) -> dict[str, Any]:
    """A DFlash drafter config turned into a DFlash2 one of the same layer stack (DFLASH2_CONFIG's values)."""
    d = copy.deepcopy(drafter)
    d.update(DFLASH2_KEYS)
    d["dflash_config"].update(DFLASH2_CONFIG)
    return d


def get(name: str) -> Shape:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}: use one of {sorted(SHAPES)}")
    return SHAPES[name]


# ------------------------------------------------------------------------------------------------ shrinking
def _fit_hidden(hidden: int, *configs: dict[str, Any]) -> int:
    """The smallest width >= hidden that every config's head count divides (transformers checks hidden % heads
    for some families, e.g. SmolLM2's 9 heads)."""
    step = math.lcm(*(int(c.get("num_attention_heads") or 1) for c in configs))
    return -(-hidden // step) * step


def shrink(config: dict[str, Any], *, layers: int = 2, hidden: int = 64, vocab: int = 512) -> dict[str, Any]:
    """A tiny config of the same family and layer pattern (for CPU tests): widths scaled, ratios kept."""
    c = copy.deepcopy(config)
    old_h = c["hidden_size"]
    hidden = _fit_hidden(hidden, c)
    scale = hidden / old_h
    c["hidden_size"] = hidden
    for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if c.get(k):
            c[k] = max(8, int(round(c[k] * scale / 8)) * 8)
    # head dims: the largest becomes 32 and the others keep their ratio to it, so that per-layer-type shapes
    # that differ at full size (Gemma-4: sliding 256 vs global 512) still differ in the tiny config
    dims = [k for k in ("head_dim", "global_head_dim", "linear_key_head_dim", "linear_value_head_dim") if c.get(k)]
    top = max([c[k] for k in dims], default=32)
    for k in dims:
        c[k] = max(8, c[k] * 32 // top) if top > 32 else c[k]
    if c.get("num_experts"):
        c["num_experts"] = min(c["num_experts"], 8)
        for k in ("num_experts_per_tok", "top_k_experts"):
            if c.get(k):
                c[k] = min(c[k], 2)
    if "layer_types" in c:
        # a prefix of the real pattern, long enough to hold every layer kind: layer i keeps its kind, so rules that
        # derive the kinds from a period (Qwen3.5's full_attention_interval, Gemma's 5:1) agree with the list
        types = c["layer_types"]
        first = max(types.index(kind) for kind in dict.fromkeys(types))
        c["layer_types"] = types[:max(layers, first + 1)]
        layers = len(c["layer_types"])
    c["num_hidden_layers"] = layers
    c["vocab_size"] = vocab
    if c.get("sliding_window"):  # short windows: tiny tests cross them, tiny KV pools hold them
        c["sliding_window"] = min(c["sliding_window"], 64)
    if "dflash_config" in c:
        n_t = c.get("num_target_layers", layers)
        c["dflash_config"] = dict(c["dflash_config"], mask_token_id=vocab - 1,
                                  target_layer_ids=[i for i in c["dflash_config"]["target_layer_ids"] if i < n_t])
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = c.get(k)
        if isinstance(v, int) and v >= vocab:
            c[k] = 1
        elif isinstance(v, list):
            c[k] = [x if x < vocab else 1 for x in v]
    return c


def shrink_pair(shape: Shape | str, *, layers: int = 4, hidden: int = 64, vocab: int = 512
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(target, drafter) configs shrunk together: the drafter keeps its own layer count and layer kinds, and reads
    the tiny target (its hidden size, vocabulary, layer count; target_layer_ids spread over the tiny target's
    layers, as many as fit)."""
    shape = get(shape) if isinstance(shape, str) else shape
    hidden = _fit_hidden(hidden, shape.target, *([shape.drafter] if shape.drafter else []))
    target = shrink(shape.target, layers=layers, hidden=hidden, vocab=vocab)
    if shape.drafter is None:
        return target, None
    d = shape.drafter
    drafter = shrink(d, layers=d["num_hidden_layers"], hidden=hidden, vocab=vocab)
    n_t = target["num_hidden_layers"]
    n_ids = min(len(d["dflash_config"]["target_layer_ids"]), n_t - 1)
    ids = sorted({1 + round(i * (n_t - 2) / max(1, n_ids - 1)) for i in range(n_ids)})
    drafter["num_target_layers"] = n_t
    drafter["dflash_config"] = dict(drafter["dflash_config"], target_layer_ids=ids, mask_token_id=vocab - 1)
    return target, drafter


# ------------------------------------------------------------------------------------------------ SGLang's view
def sglang_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The target config.json to write for SGLang 0.5.17: the published text config, in SGLang's naming where the
    published checkpoint gets renamed on load.

    Gemma-4: the published checkpoints are the multimodal Gemma4ForConditionalGeneration, whose ``text_config``
    (HF naming: ``head_dim`` / ``num_key_value_heads`` = sliding layers, ``global_head_dim`` /
    ``num_global_key_value_heads`` = full layers) SGLang renames while loading the config (model_type ``gemma4``
    only): base fields become the full layers' and ``swa_head_dim`` / ``swa_v_head_dim`` /
    ``swa_num_key_value_heads`` the sliding layers'. Its Gemma4 model classes and KV pool read only that naming.
    A text-only ``gemma4_text`` file is not renamed, so it is written renamed here: the result is what SGLang
    holds for the published checkpoint's text model (tests/test_shape_startup.py compares the two). The HF names
    stay too (``global_*`` then equal the base ones, so either reading of the full layers agrees).
    Other families are returned unchanged.
    """
    c = copy.deepcopy(config)
    if c.get("model_type") != "gemma4_text" or "swa_num_key_value_heads" in c:
        return c
    sliding_dim, sliding_kv = c["head_dim"], c["num_key_value_heads"]
    full_dim = c.get("global_head_dim") or sliding_dim
    full_kv = c.get("num_global_key_value_heads") or sliding_kv
    c.update(swa_head_dim=sliding_dim, swa_v_head_dim=sliding_dim, swa_num_key_value_heads=sliding_kv,
             head_dim=full_dim, v_head_dim=full_dim, num_key_value_heads=full_kv)
    return c


def published_wrapper_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """Gemma-4 only: the published multimodal layout around a text config (model_type ``gemma4``), with a small
    vision tower. For tests: SGLang's own config loading of this is the reference for ``sglang_text_config``
    (the wrapper itself cannot be served from a config-only directory: SGLang loads its image processor)."""
    assert text_config["model_type"] == "gemma4_text", text_config["model_type"]
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                              "head_dim": 16},
            "tie_word_embeddings": True, "torch_dtype": text_config.get("torch_dtype", "bfloat16")}


# ------------------------------------------------------------------------------------------------ writing
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


def write(shape: Shape | str, out: str | Path, tokenizer_from: str | Path | None = None,
          dflash2: bool = False) -> dict[str, Path]:
    """Write ``out/target/config.json`` and (if the shape has a drafter) ``out/draft/config.json``; ``dflash2``: the
    drafter as a DFlash2 drafter (``as_dflash2``).

    A README.txt beside them says that the weights are to be random (``--load-format dummy``) and where each value
    came from. Returns the directories written.
    """
    shape = get(shape) if isinstance(shape, str) else shape
    if dflash2:
        if shape.drafter is None:
            raise ValueError(f"{shape.name} has no drafter to write as DFlash2")
        shape = Shape(**{**shape.__dict__, "drafter": as_dflash2(shape.drafter),
                         "notes": shape.notes + ("drafter written as DFlash2 (shapes.DFLASH2_CONFIG): its "
                                                 "convolution and selector sizes are not the shape's own",)})
    out = Path(out)
    dirs = {"target": out / "target"}
    if shape.drafter is not None:
        dirs["draft"] = out / "draft"
    for role, d in dirs.items():
        d.mkdir(parents=True, exist_ok=True)
        cfg = sglang_text_config(shape.target) if role == "target" else shape.drafter
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if tokenizer_from is not None:
            copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_from) / f).exists()]
            if not copied:
                raise FileNotFoundError(f"--tokenizer-from {tokenizer_from}: no tokenizer files "
                                        f"({', '.join(TOKENIZER_FILES)}) there")
            for f in copied:
                shutil.copy(Path(tokenizer_from) / f, d / f)
    readme = [f"Exact-shape config of {shape.name} (written by sglang_dflash.targets.shapes). NO WEIGHTS: serve with",
              "  --load-format dummy [--speculative-draft-load-format dummy]"
              + ("" if tokenizer_from else " --skip-tokenizer-init (send input_ids)"),
              "Random weights: acceptance measured with them is meaningless; use only for step cost.", "",
              "Sources:", *[f"- {s}" for s in shape.sources], "", "Notes:", *[f"- {n}" for n in shape.notes]]
    (out / "README.txt").write_text("\n".join(readme) + "\n")
    return dirs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_dflash.targets.shapes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the shapes, their sources and notes")
    w = sub.add_parser("write", help="write config.json files (no weights)")
    w.add_argument("name", choices=sorted(SHAPES))
    w.add_argument("out")
    w.add_argument("--tokenizer-from", default=None, help="copy tokenizer files from this directory")
    w.add_argument("--dflash2", action="store_true", help="write the drafter as a DFlash2 drafter (DFLASH2_CONFIG)")
    a = p.parse_args(argv)
    if a.cmd == "list":
        for s in SHAPES.values():
            print(f"{s.name}: target {s.target['architectures'][0]}, drafter "
                  f"{'-' if s.drafter is None else str(s.drafter['num_hidden_layers']) + ' layers'}")
            for n in s.notes:
                print(f"    note: {n}")
        return 0
    dirs = write(a.name, a.out, a.tokenizer_from, dflash2=a.dflash2)
    for role, d in dirs.items():
        print(f"{role}: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
