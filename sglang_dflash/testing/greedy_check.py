"""THE judge of a speculative server's greedy output against a plain server's answer to the same request.

Greedy outputs must be token-for-token identical. The one excuse is kernel noise at a near-tie of the plain server:
a verify scores a token with an extend kernel, plain decoding with a decode kernel, and where the plain server's
top-2 logprobs are closer than that noise the two may legitimately pick different tokens. A divergence is excused
only when the two tokens are exactly the plain server's top-2 AND their gap is at most `tie_tol`; the plain server
then continues greedily from the speculative token (prompt + output up to and including it) and the rest of the
speculative output must equal that continuation, by the same rule, at most `max_excused` times per output.

`top_k` > 2 widens the rule for targets whose logits are flat near the top (random weights: several tokens within
bf16 noise of the best, benchmarks/greedy_judge.py): both tokens among the plain server's top_k and each within
`tie_tol` of its best. At top_k = 2 that is the rule above.

Used by the CPU server tests (tests/serving/compare.py, which turns a failure into pytest.fail and measured the
float32 tolerance) and by the soak (benchmarks/soak.py, which reports every divergence with its gap). The plain
server is reached only through the two functions passed in, so the rule is tested without a server
(tests/serving/test_compare_rules.py). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

# (logprob, token) of the plain server's most likely next tokens after ids (two at least), best first
Top2 = Callable[[list[int]], list[tuple[float, int]]]
# the plain server's greedy continuation of ids, n tokens at most (it may stop earlier, e.g. at EOS)
Continue = Callable[[list[int], int], list[int]]


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where a and b differ (the shorter length if one is a prefix of the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Divergence:
    """The speculative output differs from the plain one at output `position` (counted over the whole output)."""

    position: int
    base: int  # the plain server's token there
    spec: int  # the speculative server's token
    top2: tuple[tuple[float, int], ...]  # the plain server's best (logprob, token) after the shared context: 2 or top_k

    @property
    def gap(self) -> float:
        """The plain server's top-2 logprob gap at the divergence."""
        return self.top2[0][0] - self.top2[1][0]

    def tie_gap(self) -> float:
        """How far below the plain server's best the lower of the two tokens lies; infinite where either is not
        among its best. With two tokens listed and both of them the two, that is `gap`."""
        lp = {t: v for v, t in self.top2}
        if self.base not in lp or self.spec not in lp:
            return float("inf")
        return self.top2[0][0] - min(lp[self.base], lp[self.spec])

    def is_near_tie(self, tie_tol: float) -> bool:
        return self.tie_gap() <= tie_tol

    def as_dict(self) -> dict:
        return {"position": self.position, "base": self.base, "spec": self.spec, "gap": self.gap,
                "top2": [list(t) for t in self.top2]}


@dataclass
class Verdict:
    """excused: the near-tie divergences taken as given, in order; failure: why the output is not lossless (None:
    it is), with the divergence that failed where there is one."""

    excused: list[Divergence] = field(default_factory=list)
    failure: str | None = None
    failed: Divergence | None = None


def judge_greedy(prompt: Sequence[int], base_ids: Sequence[int], spec_ids: Sequence[int], max_tokens: int,
                 top2: Top2, continue_greedy: Continue, tie_tol: float, max_excused: int, top_k: int = 2) -> Verdict:
    """The verdict on spec_ids against base_ids (both the outputs of `prompt` with max_tokens greedy tokens)."""
    prompt, base_ids, spec_ids = list(prompt), list(base_ids), list(spec_ids)
    verdict, done = Verdict(), 0  # done: output tokens already settled before the current frame
    while True:
        i = first_diff(base_ids, spec_ids)
        if i is None:
            return verdict
        where = f"output position {done + i} of prompt {prompt[:len(prompt) - done]}"
        if i >= min(len(base_ids), len(spec_ids)):
            verdict.failure = (f"lengths differ without a token difference at {where}: baseline {len(base_ids)} vs "
                               f"dflash {len(spec_ids)} tokens after it")
            return verdict
        d = Divergence(done + i, base_ids[i], spec_ids[i], tuple(top2(prompt + base_ids[:i])[:top_k]))
        if not d.is_near_tie(tie_tol):
            (_, tok1), (_, tok2) = d.top2[:2]
            rule = ("exactly these two tokens and a gap" if top_k == 2 else
                    f"two of its top-{top_k} tokens each at a distance to its best")
            verdict.failure = (f"greedy divergence at {where}: baseline {d.base} vs dflash {d.spec}; the baseline's "
                               f"top-2 are {tok1}, {tok2} with a logprob gap {d.gap:.3g} (excused only for {rule} "
                               f"<= {tie_tol:.3g}): DFLASH is not lossless here")
            verdict.failed = d
            return verdict
        verdict.excused.append(d)
        if len(verdict.excused) > max_excused:
            verdict.failure = (f"{len(verdict.excused)} near-tie divergences in one output (limit {max_excused}), the "
                               f"last at {where}")
            return verdict
        prompt += spec_ids[: i + 1]
        done += i + 1
        spec_ids = spec_ids[i + 1:]
        remaining = max_tokens - done
        base_ids = continue_greedy(prompt, remaining) if remaining > 0 else []
