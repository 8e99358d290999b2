"""What DFlash2 adds to the DFlash drafter: grouped dynamic causal convolutions around each sublayer, and a candidate
selector that walks one path through the top-K candidates of every block position (plain PyTorch; used by
``drafter.DFlashDrafter`` when its config is a DFlash2 one).

Convolution (``GroupedCausalConv``, one around each layer's attention and one around its MLP). Over the positions
t = 0..B-1 of each block (0 = the bonus token), channel c in group g(c) = c // group_size:

    y[t, c] = sum over taps s = 0..min(t, taps-1) of  (base[s, c] + dyn[t, s, g(c)]) * x[t - s, c]

causal (a position sees itself and the s < taps positions before it) and never across a block boundary. The
coefficients dyn come from ONE projection of the sublayer's input, [.., 2, taps, groups]: side 0 convolves the
input before the sublayer, side 1 its output after it (``prepare`` / ``finish``). The context rows (target features)
are not convolved. Parameters as published: ``base_kernel`` [2, taps, H], ``kernel_projection.weight``
[2 * taps * H / group_size, H].

Selector (``CandidateSelector``). Per draft position i = 1..B-1, the K largest draft logits (through the target's
lm_head, after the output multiplier and softcap) give candidates c_i[1..K] with unary scores u_i. A transition from
the previous position's chosen token a (the bonus token for i = 1) to candidate c scores

    s_i(c | a) = u_i(c) + < P[a] * W h_i , S[c] >        P, S: [V, r] codebooks, W: [r, H] hidden_projection

and the path takes, position by position, the argmax (greedy requests) or a draw from q_i = softmax(s_i / T) over
the K candidates (sampled requests at temperature T). q is zero outside the candidates; the verify needs it
(``acceptance.verify_sampled_q``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfig
from .sampling import sample_from_probs, seeded_race


class GroupedCausalConv(nn.Module):
    """The grouped dynamic causal convolution wrapped around one sublayer (see the module doc)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h = cfg.hidden_size
        self.taps, self.group_size, self.block_size = cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size
        self.groups = h // self.group_size
        base = torch.zeros(2, self.taps, h)
        base[:, 0] = 1.0  # identity at initialisation (with the zero projection below); checkpoints overwrite both
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(h, 2 * self.taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, Q, H] (Q = whole blocks) -> (x convolved with side 0, side 1's coefficients for `finish`)."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], 0), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [b, Q, H] convolved with side 1 (coefficients from `prepare`)."""
        return self._convolve(y, dyn, 1)

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        b, q, h = x.shape
        if q % self.block_size:
            raise ValueError(f"DFlash2 convolution: {q} block rows are not whole blocks of {self.block_size}. "
                             "Fix: pass the drafter whole blocks (block_size rows each)")
        shape = (b, q // self.block_size, self.block_size, self.groups, self.group_size)
        x, dyn = x.view(shape), dyn.reshape(*shape[:3], self.taps, self.groups, 1)
        base = self.base_kernel[side].view(self.taps, self.groups, self.group_size).to(x.dtype)
        out = torch.zeros_like(x)
        for s in range(min(self.taps, self.block_size)):
            earlier = x if s == 0 else F.pad(x[:, :, :-s], (0, 0, 0, 0, s, 0))  # x[t - s], zero before the block
            out = out + (base[s] + dyn[:, :, :, s]) * earlier
        return out.view(b, q, h)


@dataclass
class DraftBlock:
    """A drafted block for n requests: ``tokens`` [n, B-1] int64 (positions 1..B-1). DFlash2 also gives the
    ``candidates`` [n, B-1, K] each token was chosen from and ``q`` [n, B-1, K] float32, the distribution it was
    drawn with (a point mass for greedy rows). None: every token is a point-mass draft (DFlash)."""

    tokens: torch.Tensor
    candidates: torch.Tensor | None = None
    q: torch.Tensor | None = None


class CandidateSelector(nn.Module):
    """DFlash2's path through the top-K candidates (see the module doc). Parameter names as published; the codebooks
    are bare [V, r] tensors (``candidate_selector.{predecessor,successor}_codebook``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def transition(self, projected: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """THE transition term < P[a] * W h, S[c] > [n, K] float32, for n rows: projected = W h [n, r] (float32),
        previous tokens a [n], candidates c [n, K]. The walk scores with it, and so does training's selector loss."""
        query = self.predecessor_codebook[previous].float() * projected  # [n, r]
        keys = self.successor_codebook[candidates].float()  # [n, K, r]
        return torch.einsum("nr,nkr->nk", query, keys)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
             temperature: torch.Tensor | None = None, generator: torch.Generator | None = None,
             seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> DraftBlock:
        """hidden [n, L, H] and draft logits [n, L, V] of positions 1..L, anchor_ids [n] (the bonus tokens),
        temperature [n] (0 = greedy; None = all greedy, no random draws). One step per position, in order: the
        score of a candidate depends on the token chosen before it. With ``seeds`` [n] (and ``positions`` [n], the
        bonus token's sequence position) a sampled row's draw at block position i is sampling.seeded_race over its
        candidates with the noise of (seed, position + i - 1), the noise the target's seeded draw of that position
        uses (acceptance.verify_seeded): the same draw from q, coupled to the target's."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)  # [n, L, K], best first
        projected = self.hidden_projection(hidden).float()  # [n, L, r]
        chosen, q_rows, previous = [], [], anchor_ids
        for i in range(hidden.shape[1]):
            scores = unary[:, i] + self.transition(projected[:, i], previous, candidates[:, i])
            best = scores.argmax(dim=-1)
            q = F.one_hot(best, self.top_k).float()
            if temperature is not None:
                greedy = temperature == 0
                t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
                q = torch.where(greedy[:, None], q, torch.softmax(scores / t[:, None], dim=-1))
                if seeds is None:
                    best = sample_from_probs(q, generator)  # a one-hot row draws its own index
                else:  # log q up to a constant: scores / t; greedy rows keep their argmax
                    drawn = seeded_race(scores / t[:, None], candidates[:, i], seeds, positions + i)
                    best = torch.where(greedy, best, drawn)
            previous = candidates[:, i].gather(1, best[:, None])[:, 0]
            chosen.append(previous)
            q_rows.append(q)
        return DraftBlock(torch.stack(chosen, dim=1), candidates, torch.stack(q_rows, dim=1))
