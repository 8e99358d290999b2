"""Goodness-of-fit helpers shared by the sampling tests, and the power they have.

Power, stated the same way everywhere: a Pearson chi-square test of N draws over cells with null probabilities p has,
against a true distribution q, noncentrality lambda = N * sum((q - p)^2 / p) >= 4 * N * TV(q, p)^2 (Cauchy-Schwarz:
(sum |q - p|)^2 <= sum (q - p)^2 / p * sum p). So any q at total-variation distance >= eps from p (measured on the
tested, pooled cells) is rejected with probability >= `power` once 4 * N * eps^2 reaches the lambda at which the
noncentral chi-square with the test's degrees of freedom exceeds the threshold that often. `detectable_tv` returns
that eps. The same bound holds for grouped (conditional) tests with eps the mean TV over the observations.
"""

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, chisquare, ncx2


def _pooled(counts: np.ndarray, probs: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts with cells of expectation < min_expected pooled into one (dropped if empty)."""
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return obs, exp


def _as_arrays(counts, probs) -> tuple[np.ndarray, np.ndarray]:
    counts = np.asarray(torch.as_tensor(counts).double())
    probs = np.asarray(torch.as_tensor(probs).double())
    return counts, probs / probs.sum()


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square p-value of observed counts against probabilities (float64, cells with tiny expectation pooled).
    Observations in a cell of probability 0 fail outright (p-value 0)."""
    counts, probs = _as_arrays(counts, probs)
    if counts[probs == 0].sum() > 0:
        return 0.0
    obs, exp = _pooled(counts, probs, min_expected)
    return float(chisquare(obs, exp).pvalue)


def grouped_chi2(groups, min_expected: float = 5.0) -> tuple[float, int, int, bool]:
    """One chi-square test over several conditional distributions at once: `groups` is an iterable of
    (counts, probs), each the draws observed in one context and the probabilities they should follow there.
    The Pearson statistics and degrees of freedom add up (Anderson & Goodman's test of Markov transition
    probabilities). Returns (p-value, draws, degrees of freedom, whether a draw landed on a probability-0 cell)."""
    stat, df, n, impossible = 0.0, 0, 0, False
    for counts, probs in groups:
        counts, probs = _as_arrays(counts, probs)
        n += int(counts.sum())
        impossible |= bool(counts[probs == 0].sum() > 0)
        obs, exp = _pooled(counts, probs, min_expected)
        if len(obs) > 1:
            stat += float(((obs - exp) ** 2 / exp).sum())
            df += len(obs) - 1
    pvalue = float(chi2.sf(stat, df)) if df else 1.0
    return (0.0 if impossible else pvalue), n, df, impossible


def detectable_tv(n: int, df: int, alpha: float, power: float = 0.95) -> float:
    """The smallest total-variation error a chi-square test of n draws with df degrees of freedom at threshold
    alpha rejects with probability >= power (worst case over the direction of the error; see the module doc)."""
    critical = chi2.isf(alpha, df)
    lam = brentq(lambda x: ncx2.sf(critical, df, x) - power, 1e-9, 1e6)
    return float(np.sqrt(lam / (4 * n)))
