"""Hidden-state capture for targets whose SGLang 0.5.17 model class has no ``set_dflash_layers_to_capture``.

DFlash needs, per token, the output of target decoder layer k (HF ``hidden_states[k + 1]``) for each k in
``target_layer_ids``, concatenated in that order and returned through the logits processor as aux hidden states
(SGLang packs them into ``logits_output.hidden_states`` under CaptureHiddenMode.FULL).

Gemma-3 (``Gemma3ForCausalLM``): its decoder layers return ``(hidden, residual)`` with the residual kept apart,
so the residual-stream value after layer k is ``hidden + residual``. (SGLang's own EAGLE-3 capture for Gemma-3
records ``hidden`` alone at the next layer's input, which is not that value, so it is not reused.) We hook the
layers' outputs and call the logits processor with the captured rows. Forward hooks run at CUDA-graph capture
time like any other Python in the forward, so captured graphs include them.
"""

from __future__ import annotations

import types

import torch


def install_capture_hook(model) -> None:
    """Give `model` a ``set_dflash_layers_to_capture(layer_ids)`` (ids are 0-based decoder layer indices)."""
    if type(model).__name__ not in ("Gemma3ForCausalLM",):
        raise ValueError(
            f"target model class {type(model).__name__} has no DFLASH hidden-state capture in SGLang 0.5.17 and "
            "sglang-dflash adds one only for Gemma3ForCausalLM. Fix: use a supported target (Llama, Qwen2/3, "
            "Qwen3-MoE, Gemma-3/4, GPT-OSS, DeepSeek-V2/3, ...)")
    model.set_dflash_layers_to_capture = types.MethodType(_gemma3_set_layers, model)


def _gemma3_set_layers(self, layer_ids) -> None:
    layer_ids = [int(i) for i in layer_ids]
    n = len(self.model.layers)
    if layer_ids != sorted(layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"dflash target_layer_ids={layer_ids}: must be strictly increasing (the capture order). "
                         "Fix: sort the ids in the drafter's config.json")
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise ValueError(f"dflash target_layer_ids={layer_ids}: ids {bad} outside the target's {n} layers. "
                         "Fix: use a drafter made for this target")
    if getattr(self, "_dflash_capture_handles", None):
        for h in self._dflash_capture_handles:
            h.remove()
    self._dflash_captured = []
    captured = self._dflash_captured

    def record(_module, _inputs, output):
        hidden, residual = output
        captured.append(hidden if residual is None else hidden + residual)

    self._dflash_capture_handles = [self.model.layers[i].register_forward_hook(record) for i in layer_ids]
    self.capture_aux_hidden_states = True
    self.forward = types.MethodType(_gemma3_forward_with_capture, self)


@torch.no_grad()
def _gemma3_forward_with_capture(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
    self._dflash_captured.clear()
    hidden_states = self.model(input_ids, positions, forward_batch, input_embeds, **kwargs)
    if isinstance(hidden_states, tuple):  # SGLang's own capture list, if something else enabled it
        hidden_states = hidden_states[0]
    aux = list(self._dflash_captured)
    self._dflash_captured.clear()
    return self.logits_processor(input_ids, hidden_states, self.model.embed_tokens, forward_batch, aux)
