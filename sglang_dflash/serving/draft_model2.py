"""DFlash2 drafters in SGLang (``architectures: ["DFlash2DraftModel"]`` or ``["DFlash2BeamDraftModel"]``): the DFlash
SGLang model of draft_model.py plus what DFlash2 adds, taken from the algorithm unchanged (``dflash2.py``):

- ``GroupedCausalConv`` around each layer's attention and MLP (published names ``layers.{i}.attention_conv.*`` /
  ``layers.{i}.mlp_conv.*``). The draft forward's rows are whole blocks of B rows, block after block (the
  TARGET_VERIFY layout of the draft pass, CUDA-graph padding included), which is the [1, N*B, H] the module takes.
  They wrap the SGLang layer's ``self_attn`` and ``mlp`` by a forward pre-hook (convolve the input, keep the
  output side's coefficients) and a forward hook (convolve the output): the layer classes of draft_model.py stay
  as they are. The context K/V (``write_context_kv``) is not convolved, as in the plain drafter.
- ``CandidateSelector`` (``candidate_selector.*``) as the draft head: ``propose`` = the plain drafter's
  ``DFlashDrafter.propose`` on the served hidden states.

Plain tensor ops throughout, so SGLang's draft CUDA graphs can capture the forward and the head. The worker drafts
batches of greedy requests with ``greedy_drafts`` (the selector's argmax path; inside the draft CUDA graph too), and
batches with sampled requests with ``propose`` at each row's temperature (0 for greedy rows: drawn from q where it is
> 0; eager, also after a graph replay), keeping the candidates and q for ``acceptance.verify_sampled_q``. One process
of the vocabulary: ``propose``
needs the whole row of draft logits for its top-K (under a vocabulary-sharded lm_head: a global top-K from each
rank's, not done; refused at start-up at --tp-size > 1). ``tests/test_drafter2_parity.py``: equal to the plain
drafter.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..checkpoint import TENSOR_ALIASES
from ..dflash2 import CandidateSelector, DraftBlock, GroupedCausalConv
from .draft_model import DFlashDraftModel


def _convolve_around(sublayer: nn.Module, conv: GroupedCausalConv, x_arg: int) -> None:
    """Run `sublayer` (whose x, [T, H] with T = whole blocks, is positional argument `x_arg`) inside `conv`:
    prepare on its input, finish on its output with the coefficients prepare returned."""
    pending: list[torch.Tensor] = []

    def before(module, args):
        x, coefficients = conv.prepare(args[x_arg][None])
        pending.append(coefficients)
        return (*args[:x_arg], x[0], *args[x_arg + 1:])

    def after(module, args, out):
        return conv.finish(out[None], pending.pop())[0]

    sublayer.register_forward_pre_hook(before)
    sublayer.register_forward_hook(after)


class DFlash2DraftModel(DFlashDraftModel):
    """SGLang model class for DFlash2 drafters: DFlashDraftModel + convolutions + candidate selector."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config, prefix)
        cfg = self.dflash
        if not cfg.is_dflash2:
            raise ValueError(f"DFlash2DraftModel got a {cfg.architecture} config. Fix: serve it as DFlashDraftModel")
        for layer in self.layers:
            layer.attention_conv = GroupedCausalConv(cfg)
            layer.mlp_conv = GroupedCausalConv(cfg)
            _convolve_around(layer.self_attn, layer.attention_conv, x_arg=1)  # self_attn(positions, x, batch)
            _convolve_around(layer.mlp, layer.mlp_conv, x_arg=0)
        self.candidate_selector = CandidateSelector(cfg)

    def propose(self, hidden: torch.Tensor, anchor_ids: torch.Tensor, temperature: torch.Tensor | None = None,
                generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> DraftBlock:
        """The draft head: hidden [bs * (B-1), H] (positions 1..B-1 of each block), anchor_ids [bs] (the bonus
        tokens), temperature [bs] (0 or None: greedy) -> DraftBlock of [bs, B-1] tokens (+ candidates and q);
        seeds / positions [bs]: the seeded draws (dflash2.CandidateSelector.walk)."""
        if self.vocab.head_sharded:
            raise ValueError(f"DFlash2's selector needs the whole vocabulary's draft logits, but this rank's lm_head "
                             f"holds {self.vocab.head_rows[1]} of {self.dflash.vocab_size} rows. Fix: serve "
                             "DFlash2 drafters without tensor parallelism (not supported yet)")
        hidden = hidden.view(anchor_ids.shape[0], -1, hidden.shape[-1])
        return self.candidate_selector.walk(hidden, self.draft_logits(hidden), anchor_ids, temperature, generator,
                                            seeds, positions)

    def greedy_drafts(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The worker's draft head for batches of greedy requests (and the one the draft CUDA graphs record): the
        selector's argmax path from each block's bonus token, [bs * k] point-mass tokens. Batches with sampled rows
        go through ``propose`` with their temperatures instead (drafts drawn from q, verified with min(1, p/q))."""
        return self.propose(hidden, anchor_ids).tokens.reshape(-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """The published names, and the `dflash` package's names of the codebooks (checkpoint.TENSOR_ALIASES)."""
        return super().load_weights((TENSOR_ALIASES.get(name.removeprefix("model."), name), tensor)
                                    for name, tensor in weights)


class DFlash2BeamDraftModel(DFlash2DraftModel):
    """The same model under the architecture name some DFlash2 checkpoints declare."""


EntryClass = [DFlash2DraftModel, DFlash2BeamDraftModel]
