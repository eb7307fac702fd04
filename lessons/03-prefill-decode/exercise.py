"""Lesson 03 exercise: count a linear layer's work and traffic, and split a run into prefill and decode.

Fill in every body, then run `tinyinfer lesson check 03`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyinfer.trace import StepTrace


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds and tokens of the prefill steps and of the decode steps of a run."""

    prefill_seconds: float
    prefill_tokens: int
    decode_seconds: float
    decode_tokens: int


def linear_flops(num_tokens: int, d_in: int, d_out: int) -> int:
    """FLOPs of y = x @ W.T with x: [num_tokens, d_in], W: [d_out, d_in].

    Every output value is d_in multiplications and d_in additions.
    """
    raise NotImplementedError


def linear_bytes(num_tokens: int, d_in: int, d_out: int, bytes_per_value: int) -> int:
    """Bytes moved from and to memory: read W [d_out, d_in] and x [num_tokens, d_in], write y [num_tokens, d_out]."""
    raise NotImplementedError


def arithmetic_intensity(num_tokens: int, d_in: int, d_out: int, bytes_per_value: int) -> float:
    """FLOPs per byte moved: how much arithmetic each byte of memory traffic pays for."""
    raise NotImplementedError


def phase_times(traces: list[StepTrace]) -> PhaseTimes:
    """Add up the steps of a run: a step that computed any prompt tokens is a prefill step, else decode.

    A step's time is the sum of trace.timings.values(). A prefill step adds its time and its
    trace.prefill_tokens; a decode step adds its time and its trace.decode_tokens.
    """
    raise NotImplementedError
