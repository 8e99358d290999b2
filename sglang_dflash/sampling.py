"""Per-request sampling settings and the target's processed next-token distribution.

One definition of "the distribution the target samples from" serves target-only decoding, speculative
verification and the tests, so the two decoders cannot drift apart:

    p = softmax(logits / temperature)
    sort p descending; drop ranks >= top_k; drop tokens whose preceding cumulative mass already exceeds top_p
    (measured on p before top-k, as SGLang's torch sampler does); drop tokens with p < min_p * max(p); renormalise.

temperature == 0 means greedy: the distribution is a point mass on the argmax (first index on exact ties), which
lets greedy and sampled requests share one verification rule.

Seeded draws (``SamplingParams.seed``, SGLang's ``sampling_seed``): counter-based randomness, no generator state.
The noise of the token decided by the row at sequence position t (the position of the input token whose logits
decide it: the prefill's last prompt token, a verify row, a tree node) over token id v is a hash of (seed, t, v)
(``seeded_uniforms``); the draw is the exponential race argmax_v p(v) / E(seed, t, v), E = -log U (``seeded_sample``).
So a seeded request's token at every position is a function of its processed distribution there and of (seed, t)
only: not of the batch it ran in, nor of how it was drafted and verified (acceptance.verify_seeded says why).
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
    seed: int | None = None  # SGLang's sampling_seed: draws keyed by (seed, position), reproducible (module doc)

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

    def __getitem__(self, rows) -> "SamplingTensors":
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])


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


# Counter-based uniforms: 32-bit integer mixing in int64 tensors (every product < 2^63: a value < 2^32 times a
# constant < 2^31, so no overflow on any device), the same ops on CPU and GPU, no host sync, no generator state.
_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x5BD1E995, 0x27D4EB2F  # odd multipliers below 2^31 (each step of _mix32 is a bijection of 32 bits)
_SALT_SEED, _SALT_KEY, _SALT_INDEX = 0x2545F491, 0x61C88647, 0x3C6EF372
# rows of one chunk of seeded_sample's [rows, V] noise: at most this many elements (its int64 temporaries stay small)
_NOISE_CHUNK_ELEMENTS = 1 << 22


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mix of 32-bit values held in int64 (xorshift-multiply, murmur3's finaliser shape)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N] 32-bit keys of (seed, position): the whole 64-bit seed folded in, the position mixed with a second
    function of the seed (so two seeds never share a stream up to a shift of positions)."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    a = _mix32(_mix32((seeds & _M32) ^ _SALT_SEED) ^ ((seeds >> 32) & _M32))
    b = _mix32(a ^ _SALT_KEY)
    return _mix32(a ^ _mix32((positions & _M32) ^ b))


def _unit_interval(hashed: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms strictly inside (0, 1): the top 23 bits, centred in their cell, so every
    value is exact in float32 (24 bits would round the top cell's centre up to 1.0, whose Gumbel noise is +inf)."""
    return ((hashed >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _uniforms_of(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) of mix(mix(index) ^ key)."""
    return _unit_interval(_mix32(_mix32((index.to(torch.int64) & _M32) ^ _SALT_INDEX) ^ keys))


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """THE seeded random numbers: U(seed, position, index) in (0, 1), float32, a pure function of its arguments.
    ``seeds`` [N] int64 (any 64-bit value), ``positions`` [N] (the sequence position of the deciding row),
    ``index`` [K] or [N, K] (token ids) -> [N, K]. Distinct (seed, position, index) give independent-looking
    uniforms (tests/test_seeded_sampling.py checks uniformity and independence across each argument)."""
    keys = _row_keys(seeds, positions)[:, None]
    return _uniforms_of(keys, index if index.dim() == 2 else index[None, :])


def seeded_race(scores: torch.Tensor, ids: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Column index of argmax_j scores[:, j] + G_j, G_j = -log E(seed, position, ids[:, j]), E = -log U: a draw from
    softmax(scores) over the columns (the exponential race in log space; -inf scores never win). ``scores`` [N, K]
    float, ``ids`` [N, K] or [K] the token id each column stands for (the noise is keyed by token id, so a draw
    over a subset of the vocabulary, DFlash2's candidates, sees the same noise as one over the whole of it)."""
    gumbel = seeded_uniforms(seeds, positions, ids).log_().neg_().log_().neg_()
    return (scores.float() + gumbel).argmax(dim=-1)


def seeded_sample(logits: torch.Tensor, s: SamplingTensors, seeds: torch.Tensor, positions: torch.Tensor,
                  filtered: bool = True) -> torch.Tensor:
    """One token per row of [N, V] logits from the processed distribution (``processed_probs``), drawn with the
    seeded noise of (seeds[i], positions[i]): argmax over the row's support of logits / T - log E(seed, t, v).
    The race is scale-free, so no normalisation enters the draw: a row's token depends on its logits, its own
    sampling settings and (seed, t) only. The support is processed_probs' (> 0) where ``filtered`` (a token it
    drops by underflow alone can never win: its logit trails the argmax's by > 100, the noise's range is < 20),
    every token otherwise (filtered=False promises that no row uses top-k, top-p or min-p, as in
    processed_probs). Greedy rows (T == 0): the argmax. No host synchronisation; the [N, V] noise is made in
    chunks of rows."""
    n, v = logits.shape
    greedy = s.temperature == 0
    temp = torch.where(greedy, torch.ones_like(s.temperature), s.temperature).float()
    ids = torch.arange(v, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    per_chunk = max(1, _NOISE_CHUNK_ELEMENTS // max(v, 1))
    for start in range(0, n, per_chunk):
        rows = slice(start, min(n, start + per_chunk))
        scores = logits[rows].float() / temp[rows, None]
        if filtered:
            scores.masked_fill_(processed_probs(logits[rows], s[rows]) == 0, -torch.inf)
        out[rows] = seeded_race(scores, ids, seeds[rows], positions[rows])
    return torch.where(greedy, logits.argmax(dim=-1), out)


def sample_next(logits: torch.Tensor, s: SamplingTensors, generator: torch.Generator | None = None) -> torch.Tensor:
    """Target-only decoding: one token per row from the processed distribution."""
    return sample_from_probs(processed_probs(logits, s), generator)
