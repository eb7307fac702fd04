"""Lesson 09 exercise: the acceptance rule of speculative decoding, greedy and sampled.

A drafter guessed k tokens d_0..d_{k-1}. The target model scored them in one pass, giving its
distribution at k + 1 positions: after the context, after d_0, ..., after d_{k-1}.
Fill in every body, then run `tinyinfer lesson check 09`.
"""

from __future__ import annotations

import numpy as np


def sample_inverse_cdf(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probs [V] with one uniform number (lesson 05's sampler; given)."""
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def accept_greedy(target_choices: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens one verification emits under greedy decoding.

    target_choices[i] is the target's argmax at position i (k + 1 entries). Accept d_i while
    it equals target_choices[i]; at the first mismatch emit target_choices[i] instead and
    stop. If all k are accepted, also emit the bonus token target_choices[k].
    """
    raise NotImplementedError


def accept_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, draft_tokens: list[int],
                   rng: np.random.Generator) -> list[int]:
    """Tokens one verification emits when sampling; the output follows the target's distribution.

    target_probs: [k + 1, V] (p), draft_probs: [k, V] (q, what the drafter sampled from).
    For i = 0..k-1: draw u = rng.random(); accept d_i if u < min(1, p_i[d_i] / q_i[d_i]).
    On the first rejection, emit sample_inverse_cdf(r, rng) with r = max(0, p_i - q_i)
    normalised (use p_i if r is all zero), and stop. If all are accepted, emit a bonus token
    sample_inverse_cdf(p_k, rng). Draw from rng in exactly this order.
    """
    raise NotImplementedError


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Mean tokens a verification emits if each guess is accepted independently with probability a.

    Accepting exactly j guesses (then emitting one more token) has probability a^j (1 - a) for
    j < k and a^k for j = k. The sum is (1 - a^(k+1)) / (1 - a), or k + 1 when a = 1.
    """
    raise NotImplementedError
