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
