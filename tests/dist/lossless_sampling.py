"""The lossless-sampling check shared by the speculative engine tests: chi-square goodness of fit of
sampled tokens against the target's exact next-token distribution (``tiny_models.next_token_fixture``)."""

import numpy as np
import torch
from scipy.stats import chisquare

NUM_SAMPLES = 2000
SIGNIFICANCE = 0.001  # per position; a lossless engine fails one of 4 positions with probability < 0.4%
PROMPT = [5, 6]


def goodness_of_fit_p_values(sequences: np.ndarray, next_probs: torch.Tensor) -> list[float]:
    """Chi-square p-value of each generated position against the exact conditional distribution."""
    previous = np.concatenate([np.full((len(sequences), 1), PROMPT[-1]), sequences[:, :-1]], axis=1)
    p_values = []
    for pos in range(sequences.shape[1]):
        expected = next_probs[torch.as_tensor(previous[:, pos])].sum(0).numpy()
        observed = np.bincount(sequences[:, pos], minlength=len(expected)).astype(float)
        keep = expected >= 5  # pool rare tokens so every cell has a usable expectation
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        p_values.append(float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue))
    return p_values
