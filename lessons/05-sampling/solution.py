"""Lesson 05 solution (for teachers): the sampling pipeline."""

from __future__ import annotations

import numpy as np


def softmax_with_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities [V] of softmax(logits / temperature); temperature 0 is one-hot greedy."""
    if temperature == 0:
        p = np.zeros(len(logits))
        p[int(np.argmax(logits))] = 1.0
        return p
    e = np.exp((logits - np.max(logits)) / temperature)
    return e / e.sum()


def top_k_filter(probs: np.ndarray, logits: np.ndarray, k: int) -> np.ndarray:
    """Zero every token outside the k with the largest logits (k = 0 keeps all)."""
    if k <= 0 or k >= len(probs):
        return probs
    out = np.zeros_like(probs)
    keep = np.argsort(-logits, kind="stable")[:k]
    out[keep] = probs[keep]
    return out


def top_p_filter(probs: np.ndarray, logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of best-ranked tokens whose probability reaches top_p of the total."""
    if top_p >= 1.0:
        return probs
    order = np.argsort(-logits, kind="stable")
    order = order[probs[order] > 0]  # tokens already cut stay cut
    cumulative = np.cumsum(probs[order])
    n_keep = int(np.searchsorted(cumulative, top_p * probs.sum(), side="left")) + 1
    out = np.zeros_like(probs)
    keep = order[:n_keep]
    out[keep] = probs[keep]
    return out


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Zero every token whose probability is below min_p times the largest probability."""
    return np.where(probs >= min_p * probs.max(), probs, 0.0)


def processed_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> np.ndarray:
    """Temperature, then top-k, top-p, min-p, then renormalise."""
    p = softmax_with_temperature(logits, temperature)
    if temperature == 0:
        return p
    p = min_p_filter(top_p_filter(top_k_filter(p, logits, top_k), logits, top_p), min_p)
    return p / p.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id with exactly one uniform number, by the inverse CDF."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
