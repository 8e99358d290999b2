"""Goodness-of-fit helper shared by the sampling tests."""

import numpy as np
import torch
from scipy.stats import chisquare


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square p-value of observed counts against probabilities (float64, cells with tiny expectation pooled).
    Observations in a cell of probability 0 fail outright (p-value 0)."""
    counts = np.asarray(torch.as_tensor(counts).double())
    probs = np.asarray(torch.as_tensor(probs).double())
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)
