"""A transformers causal LM seen as a DFlash target: its embedding, its lm_head, and a cached forward that returns
logits plus the hidden states at the drafter's target_layer_ids."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class HFTarget:
    def __init__(self, model, layer_ids: tuple[int, ...] | list[int] = ()):
        self.model = model.eval()
        self.config = model.config
        self.layer_ids = tuple(layer_ids)
        self.embed_weight = model.get_input_embeddings().weight
        self.lm_head_weight = model.get_output_embeddings().weight
        self.device = self.embed_weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @staticmethod
    def new_cache() -> DynamicCache:
        # A cache built without the model config keeps every layer at full length. Sliding-window layers still
        # attend within their window (the mask enforces it), and unlike a sliding cache it can be cropped back
        # after a partly rejected block.
        return DynamicCache()

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, start: int, cache: DynamicCache
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed tokens at positions start.. on top of `cache` (which must hold exactly `start` tokens).
        Returns logits [T, V] float32 and the concatenated hidden states [T, K*H] (None without layer ids)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        positions = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                         output_hidden_states=bool(self.layer_ids))
        features = None
        if self.layer_ids:
            # HF hidden_states[0] is the embedding output, so layer k's output is hidden_states[k + 1]
            features = torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1)
        return out.logits[0].float(), features

    @torch.inference_mode()
    def forward_tree(self, token_ids: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor, start: int,
                     cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score a draft tree on top of `cache` (exactly `start` tokens) in one pass: node i sits at position
        start + depth[i] and sees the whole prefix plus ancestors[i] (its ancestors and itself), so its row equals
        what a plain forward over its root path would give. ``token_ids`` / ``depth`` [T], ``ancestors`` [T, T]
        bool. The cache then holds the T tree rows after the prefix: `keep_rows` keeps the accepted path's."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        positions = (start + depth.to(self.device))[None]
        dtype = self.embed_weight.dtype
        q_pos = positions[0, :, None]
        k_pos = torch.cat([torch.arange(start, device=self.device), positions[0]])[None, :]
        tree = torch.cat([torch.ones(len(depth), start, dtype=torch.bool, device=self.device),
                          ancestors.to(self.device)], dim=1)

        def additive(window: int | None) -> torch.Tensor:
            # an additive float mask (0 / dtype min) reads the same under eager and sdpa attention; passed as a 4D
            # tensor, transformers uses it as is. Sliding layers keep keys with q - k < window, as their own mask does
            allowed = tree if window is None else tree & (q_pos - k_pos < window)
            return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)[None, None]

        layer_types = getattr(self.config, "layer_types", None) or ()
        window = getattr(self.config, "sliding_window", None)
        mask = additive(None)
        if "sliding_attention" in layer_types and window:  # models with sliding layers take one mask per kind
            mask = {"full_attention": mask, "sliding_attention": additive(window)}
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                         use_cache=True, output_hidden_states=bool(self.layer_ids))
        features = None
        if self.layer_ids:
            features = torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1)
        return out.logits[0].float(), features

    @staticmethod
    def keep_rows(cache: DynamicCache, start: int, rows: torch.Tensor) -> None:
        """After forward_tree: keep the tree rows `rows` (the accepted root path, in order) at positions start..,
        drop the rest. Each kept row's K was rotated at start + its depth, which is the slot it moves to."""
        for layer in cache.layers:
            src = start + rows.to(layer.keys.device)
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys[..., src, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :start, :], layer.values[..., src, :]], dim=-2)
