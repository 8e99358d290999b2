"""Target hidden-state capture for DFLASH on model classes without SGLang's own ``set_dflash_layers_to_capture``.

DFlash needs, per token, the residual stream after target decoder layer k (HF ``hidden_states[k + 1]``) for each k
in ``target_layer_ids``, in that order, handed to the model's logits processor as aux hidden states (SGLang packs
them into ``logits_output.hidden_states`` under CaptureHiddenMode.FULL).

SGLang's native hooks (Llama and its subclasses Mistral / Phi-3, Qwen3, Gemma-4, ...) record ``hidden + residual`` at
the input of layer k + 1, which is the output of layer k. SGLang 0.5.17 has none for e.g. Qwen2 or Gemma-3. The
generic capture here works on any decoder-only model class laid out as SGLang's are (a list of decoder layers, each
returning ``(hidden, residual)`` or the summed hidden state, and a ``logits_processor`` module the model calls once
per forward):

- a forward hook on each chosen layer records ``hidden + residual`` (the same tensors and the same op as the native
  hooks: bit-identical rows), and
- a forward pre-hook on the logits processor hands the recorded rows over as ``aux_hidden_states`` when the model's
  own forward passes none.

The model's forward is left as it is (pipeline proxies, embeddings, tied heads: nothing re-implemented). Hooks run at
CUDA-graph capture time like any other Python in the forward, so captured graphs include them.

``SGLANG_DFLASH_CAPTURE`` picks the mechanism: ``auto`` (default) native where the class has one, generic otherwise;
``generic`` always ours; ``check`` native plus ours, compared row for row every forward (a mismatch stops the server;
it reads tensors on the host, so it is for CPU tests and debugging, not for CUDA graphs).
"""

from __future__ import annotations

import logging
import types

import torch

from ..settings import CAPTURE as CAPTURE_ENV, CAPTURE_MODES as MODES, current as settings

logger = logging.getLogger("sglang_dflash")

NATIVE = "set_dflash_layers_to_capture"
# where SGLang's model classes keep their decoder layers (CausalLM.model.layers for nearly all; multimodal wrappers)
LAYER_PATHS = ("model.layers", "language_model.model.layers", "language_model.layers", "model.language_model.layers")


class CaptureUnsupportedError(ValueError):
    """The target's model class cannot be captured; the message names the class and the fix."""


def capture_mode() -> str:
    return settings().capture


def _unsupported(model, why: str) -> CaptureUnsupportedError:
    return CaptureUnsupportedError(
        f"DFLASH cannot capture hidden states of the target model class {type(model).__name__}: {why}. SGLang 0.5.17 "
        f"gives it no {NATIVE}, and sglang-dflash's generic capture needs a decoder-only model with its decoder "
        f"layers at one of {', '.join(LAYER_PATHS)} and a `logits_processor` module. Fix: serve this target "
        "without --speculative-algorithm DFLASH, or use a target family SGLang serves as a decoder-only causal LM "
        "(Llama, Mistral, Phi-3, Qwen2/3, Gemma-3/4, ...)")


def decoder_layers(model) -> torch.nn.ModuleList:
    for path in LAYER_PATHS:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    raise _unsupported(model, "no list of decoder layers found")


def residual_stream(model, output) -> torch.Tensor:
    """A decoder layer's output as the residual-stream value after the layer (what HF's hidden_states hold)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and len(output) == 2 and isinstance(output[0], torch.Tensor):
        hidden, residual = output
        if residual is None:
            return hidden
        if isinstance(residual, torch.Tensor) and residual.shape == hidden.shape:
            return hidden + residual
    raise _unsupported(model, f"a decoder layer returned {type(output).__name__} of "
                              f"{[type(o).__name__ for o in output] if isinstance(output, (tuple, list)) else ''}, "
                              "not a tensor or (hidden, residual)")


class LayerCapture:
    """Forward hooks recording the residual stream after the chosen layers, and the hand-over to the logits
    processor. ``compare``: the model's native capture stays on and every forward compares the two."""

    def __init__(self, model, layer_ids, compare: bool = False):
        layers = decoder_layers(model)
        processor = getattr(model, "logits_processor", None)
        if not isinstance(processor, torch.nn.Module):
            raise _unsupported(model, "it has no `logits_processor` module")
        ids = [int(i) for i in layer_ids]
        if not ids or ids != sorted(set(ids)):
            raise ValueError(f"dflash target_layer_ids={ids}: must be non-empty and strictly increasing (the capture "
                             "order). Fix: sort the ids in the drafter's config.json")
        bad = [i for i in ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"dflash target_layer_ids={ids}: ids {bad} outside the target's {len(layers)} layers. "
                             "Fix: use a drafter made for this target")
        self.model, self.layer_ids, self.compare = model, ids, compare
        self.rows: list[torch.Tensor] = []
        self.compared = 0
        self.handles = [layers[i].register_forward_hook(self._recorder(n == 0)) for n, i in enumerate(ids)]
        self.handles.append(processor.register_forward_pre_hook(self._hand_over, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _recorder(self, first: bool):
        def record(_module, _inputs, output):
            if first:  # a new forward starts at the first captured layer: nothing stale survives an aborted one
                self.rows.clear()
            self.rows.append(residual_stream(self.model, output))
        return record

    def _hand_over(self, _module, args, kwargs):
        rows, self.rows = self.rows, []
        given = kwargs.get("aux_hidden_states", args[4] if len(args) > 4 else None)
        if isinstance(given, (list, tuple)) and not given:
            given = None  # an empty native list: nothing captured natively (its capture is off)
        if len(rows) != len(self.layer_ids):
            if given is None and not rows:
                return None  # a logits call outside a captured forward (nothing recorded, nothing asked)
            raise RuntimeError(f"sglang-dflash capture: recorded {len(rows)} layer outputs in one forward, expected "
                               f"{len(self.layer_ids)} (layers {self.layer_ids}); the model ran its layers in an "
                               "unexpected way, so the drafter's context would be wrong")
        if given is not None:
            if self.compare:
                self._check(given, rows)
            return None  # the native capture already hands its rows over
        if len(args) > 4:
            return args[:4] + (rows,) + args[5:], kwargs
        return args, {**kwargs, "aux_hidden_states": rows}

    def _check(self, native, ours) -> None:
        native = list(native) if not isinstance(native, torch.Tensor) else list(native.split(ours[0].shape[-1], -1))
        for layer, a, b in zip(self.layer_ids, native, ours):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                raise RuntimeError(f"sglang-dflash capture check: generic capture of layer {layer} differs from "
                                   f"the native one ({tuple(a.shape)} vs {tuple(b.shape)}, max |diff| {diff})")
        self.compared += 1
        if self.compared & (self.compared - 1) == 0:  # 1, 2, 4, 8, ...: a trail in the log without flooding it
            logger.info("sglang-dflash capture check: generic capture equal to the native one on %d forwards "
                        "(layers %s)", self.compared, self.layer_ids)


def _set_layers(self, layer_ids) -> None:
    old = getattr(self, "_dflash_capture", None)
    if old is not None:
        old.remove()
    self._dflash_capture = LayerCapture(self, layer_ids)


def install_capture_hook(model) -> None:
    """Give `model` our ``set_dflash_layers_to_capture(layer_ids)`` (0-based decoder layer indices), replacing a
    native one on this instance. Raises CaptureUnsupportedError (the startup error) if the class cannot be
    captured."""
    decoder_layers(model)
    if not isinstance(getattr(model, "logits_processor", None), torch.nn.Module):
        raise _unsupported(model, "it has no `logits_processor` module")
    model.set_dflash_layers_to_capture = types.MethodType(_set_layers, model)


def configure_capture(original, *, model, dflash_use_aux_hidden_state, dflash_target_layer_ids, **kwargs):
    """AROUND hook body for SGLang's ``configure_aux_hidden_state_capture`` (runs at model load, before CUDA-graph
    capture): installs the generic capture where needed, then lets SGLang call ``set_dflash_layers_to_capture``."""
    if dflash_use_aux_hidden_state:
        mode = capture_mode()
        native = hasattr(model, NATIVE)
        if mode == "generic" or not native:
            install_capture_hook(model)
            logger.info("sglang-dflash: DFLASH hidden states of %s captured by sglang-dflash's generic layer hooks%s",
                        type(model).__name__, "" if not native else f" ({CAPTURE_ENV}=generic)")
        elif mode == "check":
            original(model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                     dflash_target_layer_ids=dflash_target_layer_ids, **kwargs)
            model._dflash_capture_check = LayerCapture(model, dflash_target_layer_ids, compare=True)
            logger.info("sglang-dflash: %s=check: the generic capture of %s runs beside the native one and is "
                        "compared every forward", CAPTURE_ENV, type(model).__name__)
            return None
    return original(model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                    dflash_target_layer_ids=dflash_target_layer_ids, **kwargs)
