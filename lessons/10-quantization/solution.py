"""Lesson 10 solution (for teachers): symmetric grouped weight quantization."""

from __future__ import annotations

import numpy as np


def float16_up(scale: np.ndarray) -> np.ndarray:
    """Round float32 scales *up* to float16, so the grid still covers its range (given)."""
    half = np.asarray(scale, dtype=np.float32).astype(np.float16)
    low = half.astype(np.float32) < scale
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half


def code_range(bits: int) -> tuple[int, int]:
    """Smallest and largest signed code (given)."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def group_scales(w: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    """One scale per group.  w: [out, in] -> float16 [out, groups]."""
    starts = np.arange(0, w.shape[1], group_size)
    lo = np.minimum(np.minimum.reduceat(w, starts, axis=1), 0.0)  # [out, groups]
    hi = np.maximum(np.maximum.reduceat(w, starts, axis=1), 0.0)
    qmin, qmax = code_range(bits)
    return float16_up(np.maximum(lo / qmin, hi / qmax))


def quantize(w: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of w."""
    w = np.asarray(w, dtype=np.float32)
    scales = group_scales(w, group_size, bits)
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)[:, :w.shape[1]]  # [out, in]
    steps = np.divide(w, s, out=np.zeros_like(w), where=s > 0)
    qmin, qmax = code_range(bits)
    return np.clip(np.round(steps), qmin, qmax).astype(np.int8), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """Each code times its group's scale."""
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)[:, :codes.shape[1]]
    return codes.astype(np.float32) * s


def weight_bytes(quantized_params: int, kept_params: int, bits: int, group_size: int) -> float:
    """Bytes of quantized linear layers plus 16-bit kept parameters."""
    per_weight = 2.0 if bits == 16 else bits / 8 + 2 / group_size
    return quantized_params * per_weight + 2.0 * kept_params
