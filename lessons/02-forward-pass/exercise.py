"""Lesson 02 exercise: the four operations of a Llama block, in NumPy.

Shapes: T tokens, D hidden size, H query heads, Hkv key/value heads, hd head dim,
F MLP width, N context tokens. Fill in every body, then run `tinyinfer lesson check 02`.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Scale each row of x to unit root-mean-square, then by weight.  x: [T, D], weight: [D] -> [T, D].

    rms = sqrt(mean(x * x over D) + eps); there is no mean subtraction (unlike LayerNorm).
    """
    raise NotImplementedError


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each head's vector by its token's angles.  x: [T, heads, hd], cos, sin: [T, hd/2].

    Pair element i with element i + hd/2 ("rotate half"): with x1 = x[..., :hd/2] and
    x2 = x[..., hd/2:], the result is concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin).
    cos and sin have no heads axis: insert one so they broadcast over heads.
    """
    raise NotImplementedError


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              q_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of new queries over a whole context, with grouped-query heads.

    q: [Tq, H, hd] at positions q_positions [Tq]; k, v: [N, Hkv, hd] for positions 0..N-1.
    Each group of H / Hkv query heads shares one K/V head (repeat K and V along the head axis).
    scores = q·k / sqrt(hd): [H, Tq, N]; a query may not see keys at later positions
    (set those scores to -inf); weights = softmax over N; out = weights · v.
    Returns (out [Tq, H, hd], weights [H, Tq, N]).
    """
    raise NotImplementedError


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Llama's MLP: down(silu(gate(x)) * up(x)).  x: [T, D], w_gate, w_up: [F, D], w_down: [D, F] -> [T, D].

    A linear layer with weight W [out, in] computes x @ W.T; silu(z) = z * sigmoid(z).
    """
    raise NotImplementedError
