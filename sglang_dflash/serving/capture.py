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
CUDA-graph capture time like any other Python in the forward, so captured graphs include their tensor work; their
Python does not run at replay. That is harmless where SGLang captures the whole forward (decode / verify graphs: the
hand-over runs at capture and is recorded too), but SGLang 0.5.17's prefill graphs (breakable / full, on by default
on CUDA) capture only the model's body and run its logits processor eagerly afterwards: at a replay no layer hook
has recorded anything, and the hand-over used to pass nothing, so the logits processor stored the final hidden state
(one layer wide) and the drafter died at the first request (Qwen3.5 on an H200: "mat1 and mat2 shapes cannot be
multiplied (3x2048 and 10240x2048)"). So while a CUDA graph is being captured the hooks also copy their rows into
one buffer allocated for the largest captured prefill (`graph_rows`), the replay writes it again, and the
hand-over reads it when no hook ran. A hand-over that asks for hidden states and finds none is an error, never
a silent pass.

Some model classes lack the hook although the module that owns their decoder layers has it: SGLang 0.5.17's text-only
Qwen3.5 wrappers (``qwen3_5_text``: Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM) forward to the Qwen3.5 body, which
captures "before layer i" and returns ``(hidden, aux)``, and the wrappers hand ``aux`` to their logits processor. For
those (``BODY_NATIVE``) the plugin gives the wrapper a ``set_dflash_layers_to_capture`` that sets the body's own
capture (ids + 1): the body's capture runs where SGLang's does, after the residual all-reduce, and is recorded in
every CUDA graph like any native capture.

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
# (module, class) of wrappers whose body has the native capture and whose forward hands the body's (hidden, aux) to
# the logits processor; read from SGLang 0.5.17's source (srt/models/qwen3_5_text.py)
BODY_NATIVE = {("sglang.srt.models.qwen3_5_text", "Qwen3_5ForCausalLM"),
               ("sglang.srt.models.qwen3_5_text", "Qwen3_5MoeForCausalLM")}
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
        if getattr(hidden, "_sglang_needs_allreduce_fusion", False):
            raise _unsupported(model, "under tensor parallelism SGLang fuses this layer's all-reduce into the next "
                                      "layer, so its output is a per-rank partial sum, not the residual stream. "
                                      "Fix: --flashinfer-allreduce-fusion-backend none")
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

    def __init__(self, model, layer_ids, compare: bool = False, graph_rows: int = 0):
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
        # rows of the latest graph-captured forward, [graph_rows, K*H], written by the graphs' replays (module
        # docstring); allocated at the first recorded row (its width and dtype), before any graph is captured
        self.graph_rows, self.replayed = int(graph_rows), None
        self.handles = [layers[i].register_forward_hook(self._recorder(n)) for n, i in enumerate(ids)]
        self.handles.append(processor.register_forward_pre_hook(self._hand_over, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _recorder(self, position: int):
        def record(_module, _inputs, output):
            if position == 0:  # a new forward starts at the first captured layer: nothing stale survives an aborted one
                self.rows.clear()
            row = residual_stream(self.model, output)
            self.rows.append(row)
            if self.graph_rows and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                self._keep_for_replay(position, row)
        return record

    def _keep_for_replay(self, position: int, row: torch.Tensor) -> None:
        """Inside a CUDA-graph capture: the copy into the replay buffer is recorded, so every replay refreshes it."""
        n, width = row.shape[0], row.shape[-1]
        if self.replayed is None:
            self.replayed = row.new_empty((self.graph_rows, width * len(self.layer_ids)))
        if n > self.graph_rows:
            raise RuntimeError(f"sglang-dflash capture: a CUDA graph of {n} tokens was captured, but the replay "
                               f"buffer holds {self.graph_rows} (the largest prefill graph at start-up)")
        self.replayed[:n, position * width:(position + 1) * width].copy_(row)

    def _hand_over(self, _module, args, kwargs):
        rows, self.rows = self.rows, []
        given = kwargs.get("aux_hidden_states", args[4] if len(args) > 4 else None)
        if isinstance(given, (list, tuple)) and not given:
            given = None  # an empty native list: nothing captured natively (its capture is off)
        if not rows:
            if given is not None or not _asks_for_hidden(args, kwargs):
                return None  # the native capture handed its rows over, or nobody asks for hidden states
            return self._with_rows(args, kwargs, self._replayed_rows(args, kwargs))  # the layers ran in a graph
        if len(rows) != len(self.layer_ids):
            raise RuntimeError(f"sglang-dflash capture: recorded {len(rows)} layer outputs in one forward, expected "
                               f"{len(self.layer_ids)} (layers {self.layer_ids}); the model ran its layers in an "
                               "unexpected way, so the drafter's context would be wrong")
        if given is not None:
            if self.compare:
                self._check(given, rows)
            return None  # the native capture already hands its rows over
        return self._with_rows(args, kwargs, rows)

    @staticmethod
    def _with_rows(args, kwargs, rows):
        if len(args) > 4:
            return args[:4] + (rows,) + args[5:], kwargs
        return args, {**kwargs, "aux_hidden_states": rows}

    def _replayed_rows(self, args, kwargs) -> torch.Tensor:
        """The rows of a forward whose layers ran inside a replayed CUDA graph: [tokens, K*H] from the buffer."""
        hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        n = hidden.shape[0]
        if self.replayed is None or n > self.replayed.shape[0]:
            raise RuntimeError(
                f"sglang-dflash capture: the logits processor of {type(self.model).__name__} asks for the captured "
                f"hidden states of {n} tokens, but no capture hook ran in this forward and no CUDA graph recorded "
                f"them (graph buffer rows: {self.graph_rows}). The drafter would get the wrong features. Fix: "
                "report the model class; meanwhile serve it with --disable-cuda-graph")
        return self.replayed[:n]

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


def _asks_for_hidden(args, kwargs) -> bool:
    """Whether a logits-processor call wants hidden states stored (its batch's capture mode), read from the
    forward batch / logits metadata it is handed (4th argument)."""
    batch = kwargs.get("logits_metadata", args[3] if len(args) > 3 else None)
    mode = getattr(batch, "capture_hidden_mode", None)
    return bool(mode is not None and mode.need_capture())


def graph_rows() -> int:
    """The most tokens one body-only CUDA graph forward carries (SGLang's prefill graphs, breakable or full: the
    ones that replay the body and run the logits processor eagerly); 0 where there are none (CPU, graphs off)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from . import compat

    prefill = compat.prefill_graph_config()
    if prefill is None or prefill.backend not in (Backend.BREAKABLE, Backend.FULL):
        return 0
    sizes = [int(b) for b in (prefill.bs or [])] + ([int(prefill.max_bs)] if prefill.max_bs else [])
    if not sizes:
        raise RuntimeError("sglang-dflash capture: SGLang's prefill CUDA graphs are on, but their token sizes are "
                           "not set yet. Fix: report the SGLang version; meanwhile pass --disable-cuda-graph")
    return max(sizes)


def _set_layers(self, layer_ids) -> None:
    old = getattr(self, "_dflash_capture", None)
    if old is not None:
        old.remove()
    self._dflash_capture = LayerCapture(self, layer_ids, graph_rows=graph_rows())


def body_native(model):
    """The layer-owning body whose native capture ``model`` hands to its logits processor (BODY_NATIVE), or None."""
    if (type(model).__module__, type(model).__name__) not in BODY_NATIVE:
        return None
    body = getattr(model, "model", None)
    return body if body is not None and hasattr(body, NATIVE) else None


def install_body_capture(model, body) -> None:
    """Give `model` a ``set_dflash_layers_to_capture`` that sets its body's native capture ("before layer i", so ids
    + 1, as SGLang's own wrappers do). The output of the last layer has no "before" in the body: refused."""
    layers = decoder_layers(model)

    def set_layers(layer_ids) -> None:
        ids = [int(i) for i in layer_ids]
        if ids and max(ids) + 1 >= len(layers):
            raise _unsupported(model, f"target_layer_ids {ids} include the last layer ({len(layers) - 1}), whose "
                                      f"output {type(body).__name__} cannot capture")
        body.set_dflash_layers_to_capture([i + 1 for i in ids])

    model.set_dflash_layers_to_capture = set_layers


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
        body = None if native else body_native(model)
        if body is not None and mode != "generic":
            install_body_capture(model, body)
            logger.info("sglang-dflash: DFLASH hidden states of %s captured by its body's own hooks (%s)",
                        type(model).__name__, type(body).__name__)
            native = True
        if mode == "generic" or not native:
            install_capture_hook(model)
            logger.info("sglang-dflash: DFLASH hidden states of %s captured by sglang-dflash's generic layer hooks%s",
                        type(model).__name__, "" if not native else f" ({CAPTURE_ENV}=generic)")
        elif mode == "check":
            original(model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                     dflash_target_layer_ids=dflash_target_layer_ids, **kwargs)
            model._dflash_capture_check = LayerCapture(model, dflash_target_layer_ids, compare=True,
                                                       graph_rows=graph_rows())
            logger.info("sglang-dflash: %s=check: the generic capture of %s runs beside the native one and is "
                        "compared every forward", CAPTURE_ENV, type(model).__name__)
            return None
    return original(model=model, dflash_use_aux_hidden_state=dflash_use_aux_hidden_state,
                    dflash_target_layer_ids=dflash_target_layer_ids, **kwargs)
