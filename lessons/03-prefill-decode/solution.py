"""Lesson 03 solution (for teachers): FLOPs, bytes, intensity, and the prefill/decode split."""

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
    """FLOPs of y = x @ W.T with x: [num_tokens, d_in], W: [d_out, d_in]."""
    return 2 * num_tokens * d_in * d_out


def linear_bytes(num_tokens: int, d_in: int, d_out: int, bytes_per_value: int) -> int:
    """Bytes moved: read W and x, write y."""
    return (d_out * d_in + num_tokens * d_in + num_tokens * d_out) * bytes_per_value


def arithmetic_intensity(num_tokens: int, d_in: int, d_out: int, bytes_per_value: int) -> float:
    """FLOPs per byte moved."""
    return linear_flops(num_tokens, d_in, d_out) / linear_bytes(num_tokens, d_in, d_out, bytes_per_value)


def phase_times(traces: list[StepTrace]) -> PhaseTimes:
    """Add up the steps of a run: a step that computed any prompt tokens is a prefill step, else decode."""
    prefill_s = decode_s = 0.0
    prefill_n = decode_n = 0
    for trace in traces:
        seconds = sum(trace.timings.values())
        if trace.prefill_tokens:
            prefill_s += seconds
            prefill_n += trace.prefill_tokens
        else:
            decode_s += seconds
            decode_n += trace.decode_tokens
    return PhaseTimes(prefill_s, prefill_n, decode_s, decode_n)
