"""What training a DFlash2 drafter adds (`train run --arch dflash2`): its config, the neutral init of its new parts,
the warm start from a DFlash drafter, and the teacher-forced selector loss.

Neutral init (`neutral_init`): the drafter drafts exactly as its backbone alone would, so a warm start from a trained
DFlash drafter begins at that drafter's tau, not below it.
    convolutions   base_kernel[:, 0] = 1, the other taps 0, kernel_projection 0      -> identity (exactly)
    selector       hidden_projection W = 0, codebooks P, S ~ N(0, CODEBOOK_STD)     -> transition term exactly 0
With every transition 0 the selector's greedy path is the argmax of the unary scores, i.e. of the draft logits. Only
W is zero, so the gradient still reaches it (d s / d W = (P[a] * S[c]) h^T, non-zero) and, once W moves, P and S.

Selector loss (`selector_loss`), teacher-forced: for block position i = 1..B-1 with true previous token a (the block's
anchor token x_a for i = 1, else the true token x_{a+i-1}) and true token y = x_{a+i}, the candidates are the top-K
draft logits of position i (unary scores u, as `CandidateSelector.walk` takes them) and

    s(c | a) = u(c) + < P[a] * W h_i , S[c] >          (CandidateSelector.transition)
    loss     = sum_i w_i CE(softmax over the K candidates, y) / sum_i w_i,   w_i = position_weights (as the block CE)

over the rows whose y is among the candidates. Rows where it is not are left out instead of adding y as a column:
at inference the selector can only choose among the candidates, so there it cannot make that position right anyway,
and a y column would train the transition term to lift tokens the walk never sees. Bringing y into the top K is the
block CE's job. Gradients reach u (the backbone, through the topk values) and the selector.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..config import DFLASH2_ARCHITECTURES, DFLASH2_KEYS, SUPPORTED_ARCHITECTURE, DFlashConfig
from ..dflash2 import CandidateSelector
from ..drafter import DFlashDrafter
from .blocks import IGNORE, position_weights

# SmolLM2 (hidden 576) sizes; z-lab's published defaults are kernel 4, group 128, rank 64, top-K 32. 128 does not
# divide 576; 64 does (9 groups: one dynamic coefficient per tap for each 64 channels, a head_dim's worth). Rank 32
# halves the codebooks (2 x 49,152 x r: 6.3 MB in bf16 at 32, 12.6 MB at 64) for a 576-wide drafter.
DEFAULT_SIZES = dict(conv_kernel_size=4, conv_group_size=64, selector_rank=32, selector_top_k=32)
# codebook scale at init: with W = 0 it changes no draft; it sets how fast the transition term can grow once W moves
# (the term is bilinear in P and S, so N(0, 0.02)-sized codebooks would keep it ~1e-3 for thousands of steps)
CODEBOOK_STD = 0.1


def dflash2_config(cfg: DFlashConfig, **sizes: int) -> DFlashConfig:
    """The DFlash2 config with `cfg`'s backbone and the given DFLASH2_KEYS (DEFAULT_SIZES for those not given)."""
    keys = {**DEFAULT_SIZES, **sizes}
    return DFlashConfig.from_dict(cfg.to_dict(architecture=DFLASH2_ARCHITECTURES[0], **keys))


def backbone_config(cfg: DFlashConfig) -> DFlashConfig:
    """`cfg` without its DFlash2 parts (compares equal to the DFlash config of the same backbone)."""
    return dataclasses.replace(cfg, architecture=SUPPORTED_ARCHITECTURE, **{k: 0 for k in DFLASH2_KEYS})


def dflash2_part(name: str) -> str:
    """Which part a drafter parameter belongs to: "selector", "conv" (DFlash2's new parts) or "backbone"."""
    if name.startswith("candidate_selector."):
        return "selector"
    return "conv" if "_conv." in name else "backbone"


@torch.no_grad()
def neutral_init(drafter: DFlashDrafter, seed: int = 0) -> None:
    """The DFlash2 parts of `drafter` at their neutral init (module doc), in place."""
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(seed)
    for w in (sel.predecessor_codebook, sel.successor_codebook):
        w.copy_(torch.randn(w.shape, generator=g) * CODEBOOK_STD)
    sel.hidden_projection.weight.zero_()


@torch.no_grad()
def warm_start(drafter: DFlashDrafter, init: DFlashDrafter) -> str:
    """Copy `init`'s weights into the DFlash2 `drafter`: all of them from a DFlash2 drafter of the same config, the
    backbone from a DFlash drafter of the same backbone (the DFlash2 parts keep their values: call `neutral_init`
    first). Returns what was copied ("all" / "backbone"); raises ValueError naming the difference."""
    if init.config.is_dflash2:
        if init.config != drafter.config:
            raise ValueError(f"the DFlash2 init drafter's config {init.config} differs from {drafter.config}")
        drafter.load_state_dict(init.state_dict())
        return "all"
    if backbone_config(drafter.config) != init.config:
        raise ValueError(f"the init drafter's config {init.config} differs from this drafter's backbone "
                         f"{backbone_config(drafter.config)}")
    missing, unexpected = drafter.load_state_dict(init.state_dict(), strict=False)
    if unexpected or any(dflash2_part(n) == "backbone" for n in missing):
        raise ValueError(f"backbone weights do not match: missing {missing[:6]}, unexpected {unexpected[:6]}")
    return "backbone"


def previous_tokens(ids: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block ids [N*B] (x_a, MASK, ...) and labels [N*B] (IGNORE, x_{a+1}, ...) -> [N, B]: the true token before each
    block position (x_a before position 1, x_{a+k-1} before position k; IGNORE past a sequence's end; position 0
    has none and gets x_a, unused)."""
    ids, labels = ids.view(-1, block_size), labels.view(-1, block_size)
    true = torch.cat([ids[:, :1], labels[:, 1:]], dim=1)  # x_{a+k} at block position k
    return torch.cat([ids[:, :1], true[:, :-1]], dim=1)


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  ids: torch.Tensor, block_size: int, gamma: float = 7.0) -> tuple[torch.Tensor, dict]:
    """The teacher-forced selector loss (module doc) over N blocks laid out block after block: hidden [N*B, H], draft
    logits [N*B, V] (float32), labels and block ids [N*B]. Returns (loss, stats): stats are detached scalars,
    `covered` (share of labelled rows whose true token is a candidate), `top1` / `unary_top1` (share of
    covered rows where the selector's best / the best draft logit is the true token, teacher-forced)."""
    b, k = block_size, selector.top_k
    n = labels.numel() // b
    unary, candidates = logits.float().topk(k, dim=-1)  # all rows: slicing [N*B, V] first would copy it
    unary, candidates = unary.view(n, b, k)[:, 1:].reshape(-1, k), candidates.view(n, b, k)[:, 1:].reshape(-1, k)
    previous = previous_tokens(ids, labels, b)[:, 1:].reshape(-1)
    y = labels.view(n, b)[:, 1:].reshape(-1)
    rows = hidden.view(n, b, -1)[:, 1:].reshape(n * (b - 1), -1)
    projected = selector.hidden_projection(rows.to(selector.hidden_projection.weight.dtype)).float()
    scores = unary + selector.transition(projected, previous.clamp(min=0), candidates)
    hit = candidates == y[:, None]
    covered = hit.any(dim=-1) & (y != IGNORE)
    target = hit.float().argmax(dim=-1)  # the true token's column (any where uncovered: weight 0 there)
    ce = F.cross_entropy(scores, target, reduction="none")
    w = position_weights(b, gamma, logits.device)[1:].repeat(n) * covered
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        labelled = (y != IGNORE).sum().clamp(min=1)
        n_covered = covered.sum().clamp(min=1)
        stats = {"covered": covered.sum() / labelled,
                 "top1": ((scores.argmax(-1) == target) & covered).sum() / n_covered,
                 "unary_top1": ((target == 0) & covered).sum() / n_covered}
    return loss, stats


@torch.no_grad()
def selector_drafts(drafter: DFlashDrafter, hidden: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """The drafts [N*B] the selector's greedy walk makes from each block's anchor token (position 0 gets IGNORE):
    what inference drafts, for the held-out block acceptance."""
    b = block_size
    n = ids.numel() // b
    selector = drafter.candidate_selector
    hidden = hidden.to(selector.hidden_projection.weight.dtype)  # bf16 under autocast, the weights float32
    walk = selector.walk(hidden.view(n, b, -1)[:, 1:], logits.view(n, b, -1)[:, 1:], ids.view(n, b)[:, 0])
    return torch.cat([torch.full_like(walk.tokens[:, :1], IGNORE), walk.tokens], dim=1).reshape(-1)
