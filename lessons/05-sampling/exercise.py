"""Lesson 05 exercise: from logits to one token — temperature, top-k, top-p, min-p, seeded draws.

All arrays are [V]: one value per vocabulary entry. Fill in every body, then run
`tinyinfer lesson check 05`.
"""

from __future__ import annotations

import numpy as np


def softmax_with_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities [V] of softmax(logits / temperature).

    temperature 0 means greedy: all probability on the largest logit (the lowest id on a tie,
    which np.argmax gives). Subtract the max logit before np.exp so nothing overflows.
    """
    raise NotImplementedError


def top_k_filter(probs: np.ndarray, logits: np.ndarray, k: int) -> np.ndarray:
    """Zero every token outside the k with the largest logits (k = 0 keeps all).

    Rank by logits, ties to the lower id: np.argsort(-logits, kind="stable").
    """
    raise NotImplementedError


def top_p_filter(probs: np.ndarray, logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of best-ranked tokens whose probability reaches top_p of the total.

    probs may not sum to 1 (top-k may have run first): the target is top_p * probs.sum().
    Walk tokens from the largest logit down, adding their probability; keep tokens up to and
    including the one that reaches the target. top_p = 1 keeps all.
    """
    raise NotImplementedError


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Zero every token whose probability is below min_p times the largest probability."""
    raise NotImplementedError


def processed_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> np.ndarray:
    """The distribution a token is drawn from: temperature, then top-k, top-p, min-p, then renormalise.

    With temperature 0 the answer is the one-hot greedy distribution (no filters needed).
    """
    raise NotImplementedError


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id with exactly one uniform number, by the inverse CDF.

    cdf = np.cumsum(probs); u = rng.random() * cdf[-1]; the token is the first index whose
    cdf exceeds u: np.searchsorted(cdf, u, side="right"). The same seed then gives the same
    token as the engine.
    """
    raise NotImplementedError
