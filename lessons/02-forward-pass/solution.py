"""Lesson 02 solution (for teachers): the four operations of a Llama block."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Scale each row of x to unit root-mean-square, then by weight.  x: [T, D] -> [T, D]."""
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)  # [T, 1]
    return x / rms * weight


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each head's vector by its token's angles.  x: [T, heads, hd], cos, sin: [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, hd/2]: broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              q_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of new queries over a whole context, with grouped-query heads."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)  # [N, H, hd]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("thd,nhd->htn", q, k) / np.sqrt(q.shape[-1])  # [H, Tq, N]
    future = np.arange(k.shape[0])[None, :] > q_positions[:, None]  # [Tq, N]
    scores = np.where(future[None], -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)  # exp never overflows
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("htn,nhd->thd", weights, v), weights


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """Llama's MLP: down(silu(gate(x)) * up(x)).  x: [T, D] -> [T, D]."""
    gate = x @ w_gate.T  # [T, F]
    up = x @ w_up.T  # [T, F]
    return (gate / (1.0 + np.exp(-gate)) * up) @ w_down.T
