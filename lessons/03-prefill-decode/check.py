"""Lesson 03 checker: FLOP and byte counts by their definitions; phase_times on real engine traces."""

from __future__ import annotations

from types import ModuleType

import numpy as np

import tinyinfer
from lessons.checking import Checklist, expect, expect_close, expect_equal
from lessons.support import tiny_model
from tinyinfer.trace import StepTrace

checks = Checklist()


def run_traces(prompts: list[list[int]], max_tokens: int, budget: int) -> list[StepTrace]:
    """The step traces of a real engine run on a small random model."""
    engine = tinyinfer.Engine(tiny_model(), max_num_batched_tokens=budget)
    for prompt in prompts:
        engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    return traces


def expected_phases(traces: list[StepTrace]) -> tuple[float, int, float, int]:
    """The split as the lesson defines it, from the traces' own counters."""
    prefill = [t for t in traces if t.prefill_tokens]
    decode = [t for t in traces if not t.prefill_tokens]
    return (sum(sum(t.timings.values()) for t in prefill), sum(t.prefill_tokens for t in prefill),
            sum(sum(t.timings.values()) for t in decode), sum(t.decode_tokens for t in decode))


def compare_phases(ex: ModuleType, traces: list[StepTrace], what: str) -> None:
    got = ex.phase_times(traces)
    want = expected_phases(traces)
    for name, value in zip(("prefill_tokens", "decode_tokens"), (want[1], want[3])):
        expect_equal(getattr(got, name, None), value, f"{what}: {name}")
    for name, value in zip(("prefill_seconds", "decode_seconds"), (want[0], want[2])):
        expect_close(getattr(got, name, None), value, f"{what}: {name}", rtol=1e-9, atol=1e-12)


@checks.case("a 1x4 input through a 4 -> 3 layer, and random sizes (seed 1)", "linear_flops",
             "each of the num_tokens x d_out outputs costs d_in multiplies and d_in adds")
def flops(ex: ModuleType) -> None:
    expect_equal(ex.linear_flops(1, 4, 3), 2 * 1 * 4 * 3, "linear_flops(1, 4, 3)")
    rng = np.random.default_rng(1)
    for t, i, o in rng.integers(1, 5000, (5, 3)).tolist():
        expect_equal(ex.linear_flops(t, i, o), 2 * t * i * o, f"linear_flops({t}, {i}, {o})")


@checks.case("weights, inputs and outputs at 2 and 4 bytes per value (seed 2)", "linear_bytes",
             "bytes = (d_out * d_in + num_tokens * d_in + num_tokens * d_out) * bytes_per_value")
def traffic(ex: ModuleType) -> None:
    rng = np.random.default_rng(2)
    for (t, i, o), b in zip(rng.integers(1, 5000, (6, 3)).tolist(), (2, 4, 2, 4, 1, 2)):
        expect_equal(ex.linear_bytes(t, i, o, b), (o * i + t * i + t * o) * b, f"linear_bytes({t}, {i}, {o}, {b})")


@checks.case("one token vs 512 tokens through a 4096 x 4096 layer at 16-bit", "arithmetic_intensity",
             "divide linear_flops by linear_bytes; one token gives about 1 FLOP per byte")
def intensity(ex: ModuleType) -> None:
    for t in (1, 512):
        want = 2 * t * 4096 * 4096 / ((4096 * 4096 + 2 * t * 4096) * 2)
        expect_close(ex.arithmetic_intensity(t, 4096, 4096, 2), want, f"arithmetic_intensity({t}, 4096, 4096, 2)")
    expect(ex.arithmetic_intensity(512, 4096, 4096, 2) > 100 * ex.arithmetic_intensity(1, 4096, 4096, 2),
           "512 tokens should reuse each weight byte about 500 times more than 1 token")


@checks.case("one request: a 40-token prompt in chunks of 16, then 8 decode steps", "phase_times",
             "a step is prefill when trace.prefill_tokens > 0; add sum(trace.timings.values()) to that phase")
def phases_single(ex: ModuleType) -> None:
    traces = run_traces([list(range(1, 41))], max_tokens=9, budget=16)
    compare_phases(ex, traces, "phase_times of one request")


@checks.case("two requests, the second arriving with a longer prompt", "phase_times",
             "a step that mixes prefill and decode tokens counts as prefill, with its prefill_tokens only")
def phases_mixed(ex: ModuleType) -> None:
    traces = run_traces([list(range(1, 6)), list(range(1, 30))], max_tokens=6, budget=12)
    compare_phases(ex, traces, "phase_times of two requests")
