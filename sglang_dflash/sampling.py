"""Per-request sampling settings and the target's processed next-token distribution.

One definition of "the distribution the target samples from" serves target-only decoding, speculative
verification and the tests, so the two decoders cannot drift apart:

    p = softmax(logits / temperature)
    sort p descending; drop ranks >= top_k; drop tokens whose preceding cumulative mass already exceeds top_p
    (measured on p before top-k, as SGLang's torch sampler does); drop tokens with p < min_p * max(p); renormalise.

temperature == 0 means greedy: the distribution is a point mass on the argmax (first index on exact ties), which
lets greedy and sampled requests share one verification rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = -1  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SamplingTensors:
    """SamplingParams of a batch as [N] tensors, for one vectorised call (rows can be repeated per position)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, vocab size where off
    top_p: torch.Tensor
    min_p: torch.Tensor

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device=None) -> "SamplingTensors":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([p.temperature for p in params], **f32),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64,
                               device=device),
            top_p=torch.tensor([p.top_p for p in params], **f32),
            min_p=torch.tensor([p.min_p for p in params], **f32),
        )

    def repeat_interleave(self, n: int) -> "SamplingTensors":
        return SamplingTensors(*(t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p,
                                                                   self.min_p)))


def processed_probs(logits: torch.Tensor, s: SamplingTensors, filtered: bool = True) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities of the processed distribution (rows of s apply per row).

    filtered=False is a promise from the caller that no row uses top-k, top-p or min-p (all at their neutral
    values): the full-vocabulary sort is then skipped. No host synchronisation either way."""
    logits = logits.float()
    greedy = s.temperature == 0
    temp = torch.where(greedy, torch.ones_like(s.temperature), s.temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if filtered:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop = ((rank >= s.top_k[:, None]) | (mass_before > s.top_p[:, None])
                | (sorted_p < s.min_p[:, None] * sorted_p[:, :1]))
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    # greedy rows become a point mass on the argmax: zero them, then add 1 at the argmax (0 on sampled rows)
    probs = probs.masked_fill(greedy[:, None], 0.0)
    return probs.scatter_add_(-1, logits.argmax(dim=-1, keepdim=True), greedy[:, None].to(probs.dtype))


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of [N, V] probabilities without a host sync: argmax(p / E), E ~ Exp(1) (the exponential race)."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN and win the argmax for a token of probability 0
    return (probs / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(dim=-1)


def sample_next(logits: torch.Tensor, s: SamplingTensors, generator: torch.Generator | None = None) -> torch.Tensor:
    """Target-only decoding: one token per row from the processed distribution."""
    return sample_from_probs(processed_probs(logits, s), generator)
