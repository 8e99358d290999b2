"""Drafter checkpoints in the published layout: config.json + safetensors (one file or index-sharded)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file, save_file

from .config import DFlashConfig, DFlashConfigError
from .drafter import DFlashDrafter

# prefixes some exporters add in front of the published names
_KNOWN_PREFIXES = ("model.",)
# DFlash2's codebooks under their other exporter's names -> the published names (bare [V, r] tensors, as z-lab
# publishes them and SGLang loads them). The `dflash` package's DFlash2DraftModel holds them as nn.Embedding, so its
# save_pretrained writes `.weight` after each (its from_pretrained maps the bare names onto those).
TENSOR_ALIASES = {f"candidate_selector.{side}_codebook.weight": f"candidate_selector.{side}_codebook"
                  for side in ("predecessor", "successor")}


def save_drafter(drafter: DFlashDrafter, path: str | Path, max_shard_bytes: int | None = None,
                 dtype: torch.dtype | None = None, config_changes: Mapping[str, Any] | None = None) -> None:
    """Write config.json and model.safetensors (or model-0000N-of-0000M.safetensors + index when sharded).
    config_changes: `published_drafter_config` arguments for the written config.json (e.g. mask_token)."""
    path = Path(path)
    drafter.config.save(path, **(config_changes or {}))
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if max_shard_bytes is None or sum(t.numel() * t.element_size() for t in state.values()) <= max_shard_bytes:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


_REDOWNLOAD = ("download the drafter again (or copy it again from its source) and check that every "
               "*.safetensors file arrived whole")


def weight_files(path: str | Path) -> list[Path]:
    """The drafter directory's safetensors files: those its index names, else every *.safetensors in it."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise DFlashConfigError("weights", str(path), "no *.safetensors file in the drafter directory",
                                "export the drafter as safetensors (config.json + model.safetensors)")
    return [path / f for f in files]


def check_safetensors_file(file: str | Path) -> None:
    """A safetensors file is whole: its header parses and the file is exactly as long as the header says (8 bytes
    of header length, the JSON header, then every tensor's bytes at its data_offsets). Reads the header only, so it
    costs nothing at start-up; a cut download then fails here, naming the file, instead of inside the loader with
    safetensors' own message (or, for a cut past the last tensor's start, with a tensor of garbage)."""
    file = Path(file)
    if not file.is_file():
        raise DFlashConfigError("weights", str(file), "is missing (the index names it)", _REDOWNLOAD)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:
            raise DFlashConfigError("weights", str(file), f"is truncated: {size} bytes, shorter than its own header "
                                    f"({'no header length' if n is None else f'{8 + n} bytes'})", _REDOWNLOAD)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise DFlashConfigError("weights", str(file), f"has an unreadable header ({e})", _REDOWNLOAD) from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    expected = 8 + n + end
    if size < expected:
        raise DFlashConfigError("weights", str(file), f"is truncated: {size} bytes, but its header places tensor "
                                f"data up to byte {expected} ({expected - size} bytes missing)", _REDOWNLOAD)
    if size > expected:
        raise DFlashConfigError("weights", str(file), f"has {size - expected} bytes past its last tensor "
                                f"({size} bytes, header says {expected}): not one safetensors file", _REDOWNLOAD)


def check_finite(name: str, tensor: torch.Tensor, source: str | Path) -> None:
    """THE check of one drafter tensor at load (the plain loader here and SGLang's draft model's load_weights): a
    NaN or inf weight is refused, naming the tensor. Served, it would not change the output (the target decides
    every token) but would make every draft garbage, silently: acceptance collapses to one token per step."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
    raise DFlashConfigError("weights", name, f"holds {nan} NaN and {inf} inf values (of {tensor.numel()}) in "
                            f"{source}", "the checkpoint is corrupt or was saved from a diverged training run: "
                            "download it again, or re-export the drafter from a checkpoint whose weights are finite")


def read_drafter_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter directory, names as published (known exporter prefixes stripped); every file
    checked whole first (`check_safetensors_file`), every tensor finite (`check_finite`)."""
    files = weight_files(path)
    for f in files:
        check_safetensors_file(f)
    state = {}
    for f in files:
        tensors = load_file(str(f))
        for name, t in tensors.items():
            check_finite(name, t, f)
        state.update(tensors)
    for prefix in _KNOWN_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    for alias, name in TENSOR_ALIASES.items():
        if alias in state:
            if name in state:
                raise DFlashConfigError("weights", alias, f"the checkpoint holds both {name!r} and {alias!r}",
                                        "keep one of the two names (they are the same tensor)")
            state[name] = state.pop(alias)
    return state


def _shape_fix(name: str) -> str:
    """What to check when the tensor `name` has another shape than the config implies."""
    if "candidate_selector." in name:
        return "check dflash_config.selector_rank and vocab_size against the codebooks ([vocab_size, rank])"
    if "_conv." in name:
        return ("check dflash_config.conv_kernel_size and conv_group_size (base_kernel [2, taps, hidden_size], "
                "kernel_projection [2 * taps * hidden_size / group, hidden_size])")
    return "check hidden_size, head counts and target_layer_ids"


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 target_config=None) -> DFlashDrafter:
    """Load a published-layout drafter. Optionally validate it against the target's config first."""
    cfg = DFlashConfig.from_pretrained(path)
    if target_config is not None:
        cfg.validate_against_target(target_config)
    state = read_drafter_weights(path)
    drafter = DFlashDrafter(cfg)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        dflash2 = any("_conv." in n or "candidate_selector." in n for n in missing + unexpected)
        fix = "check num_hidden_layers / target_layer_ids against the checkpoint"
        if dflash2 and cfg.is_dflash2:
            fix = f"a {cfg.architecture} checkpoint needs its convolution and selector tensors; is it a DFlash one?"
        elif dflash2:
            fix = 'the checkpoint is a DFlash2 drafter: set architectures to ["DFlash2DraftModel"] and its keys'
        raise DFlashConfigError(
            "weights", str(path), f"tensor names do not match the config (missing {missing[:6]}, "
            f"unexpected {unexpected[:6]})", fix)
    for name, t in state.items():
        if t.shape != expected[name].shape:
            raise DFlashConfigError("weights", name, f"shape {tuple(t.shape)} != {tuple(expected[name].shape)} "
                                    "implied by config.json", _shape_fix(name))
    drafter.load_state_dict(state, strict=True)
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    return drafter.to(device=device, dtype=dtype).eval()
