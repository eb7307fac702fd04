"""Pieces the Triton matrix-product kernels share (``torch_triton_gemv``, ``torch_quant_kernel``):
the interpreter switch, loop trip counts, masked loads, and the split-K tile counters."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter runs the kernels
MAX_TILES = 4096  # output tiles a split-K launch may count (the size of its counter buffer)


@triton.jit
def trip_count(steps, INTERPRETED_STEPS: tl.constexpr):
    """A loop's trip count: the run-time ``steps`` on the GPU (one compiled kernel serves every
    width); Triton's CPU interpreter, which the tests use, takes only a constant bound, so there
    the launcher passes it as INTERPRETED_STEPS too."""
    if INTERPRETED_STEPS > 0:
        return INTERPRETED_STEPS
    return steps


@triton.jit
def load(pointers, mask, EVEN: tl.constexpr):
    """Load, masked unless EVEN (every tile whole: no mask to test, no zeros to fill)."""
    if EVEN:
        return tl.load(pointers)
    return tl.load(pointers, mask=mask, other=0)


_counters: dict[torch.device, Tensor] = {}


def split_counters(tiles: int, device: torch.device) -> Tensor:
    """Zeroed tile counters for a split-K launch of ``tiles`` output tiles, one buffer per
    device: the last program of a tile to finish adds the partial sums and sets its counter
    back to zero, so every launch leaves them zero."""
    if not split_fits(tiles):
        raise ValueError(f"split K counts at most {MAX_TILES} output tiles, this product has {tiles}")
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def split_fits(tiles: int) -> bool:
    """Whether a launch of this many output tiles may split K (one counter per tile)."""
    return tiles <= MAX_TILES
