"""Lesson 10 exercise: symmetric int8 / int4 weight quantization with a scale per group.

A weight matrix W [out, in] is cut into groups of group_size inputs along each row (int8 uses
one group per row: group_size = in). Each group keeps small integer codes and one float16
scale, and W ≈ codes * scale. Fill in every body, then run `tinyinfer lesson check 10`.
"""

from __future__ import annotations

import numpy as np


def float16_up(scale: np.ndarray) -> np.ndarray:
    """Round float32 scales *up* to float16, so the grid still covers its range (given)."""
    half = np.asarray(scale, dtype=np.float32).astype(np.float16)
    low = half.astype(np.float32) < scale
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half


def code_range(bits: int) -> tuple[int, int]:
    """Smallest and largest signed code: (-128, 127) for 8 bits, (-8, 7) for 4 (given)."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def group_scales(w: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    """One scale per group.  w: [out, in] -> float16 [out, ceil(in / group_size)].

    With lo = min(group's minimum, 0) and hi = max(group's maximum, 0) (zero must be on the
    grid) and (qmin, qmax) = code_range(bits), the smallest scale whose codes reach both ends
    is max(lo / qmin, hi / qmax); round it up with float16_up. The last group of a row may
    be shorter than group_size.
    """
    raise NotImplementedError


def quantize(w: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales.  w: [out, in] -> (int8 codes [out, in], float16 scales [out, groups]).

    code = round(w / scale), clipped to code_range(bits); a group whose scale is 0 (all zeros)
    gets code 0. Use the float32 value of each float16 scale.
    """
    raise NotImplementedError


def dequantize(codes: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """Back to float32: each code times its group's scale.  -> [out, in]."""
    raise NotImplementedError


def weight_bytes(quantized_params: int, kept_params: int, bits: int, group_size: int) -> float:
    """Bytes of a model's weights: quantized linear layers plus parameters kept at 16 bits.

    A quantized weight takes bits / 8 bytes, plus a 2-byte float16 scale per group of
    group_size weights; bits = 16 means no quantization at all (2 bytes, no scales).
    """
    raise NotImplementedError
