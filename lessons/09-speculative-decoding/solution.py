"""Lesson 09 solution (for teachers): speculative decoding's acceptance rule."""

from __future__ import annotations

import numpy as np


def sample_inverse_cdf(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probs [V] with one uniform number (lesson 05's sampler; given)."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def accept_greedy(target_choices: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens one verification emits under greedy decoding."""
    out = []
    for i, d in enumerate(draft_tokens):
        if d != target_choices[i]:
            return out + [target_choices[i]]
        out.append(d)
    return out + [target_choices[len(draft_tokens)]]


def accept_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, draft_tokens: list[int],
                   rng: np.random.Generator) -> list[int]:
    """Tokens one verification emits when sampling."""
    out = []
    for i, d in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() < min(1.0, p[d] / q[d]):
            out.append(d)
            continue
        residual = np.maximum(p - q, 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        return out + [sample_inverse_cdf(residual, rng)]
    return out + [sample_inverse_cdf(target_probs[len(draft_tokens)], rng)]


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Mean tokens a verification emits with independent acceptance probability a."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)
