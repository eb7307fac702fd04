"""Lesson 07 checker: your simulation against the real engine's steps (static and continuous)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

import tinyinfer
from lessons.checking import Checklist, expect_close, expect_equal
from lessons.support import tiny_model

checks = Checklist()


def engine_steps(output_lengths: list[int], max_num_seqs: int, batching: str) -> list[int]:
    """Requests per step of the real engine (short prompts, so each prefill takes one step)."""
    engine = tinyinfer.Engine(tiny_model(), max_num_seqs=max_num_seqs, batching=batching)
    for i, n in enumerate(output_lengths):
        engine.add_request([1 + i % 50, 2], tinyinfer.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    sizes = []
    while engine.has_unfinished():
        sizes.append(len(engine.step().seqs))
    return sizes


def compare(ex: ModuleType, lengths: list[int], slots: int, batching: str) -> None:
    expect_equal(list(ex.simulate_batching(list(lengths), slots, batching)), engine_steps(lengths, slots, batching),
                 f"simulate_batching({lengths}, {slots}, {batching!r})")


@checks.case("three requests that all fit", "simulate_batching",
             "each step: count the running requests, then drop those that have used up their steps")
def fits(ex: ModuleType) -> None:
    for batching in ("continuous", "static"):
        compare(ex, [3, 1, 2], 4, batching)


@checks.case("static batching waits for the whole batch", "simulate_batching",
             "static: admit only when nothing is running, then fill every free slot at once")
def static(ex: ModuleType) -> None:
    compare(ex, [5, 1, 1, 4, 2, 2], 2, "static")


@checks.case("continuous batching refills a slot the step after it frees", "simulate_batching",
             "continuous: before every step, move waiting requests into free slots, oldest first")
def continuous(ex: ModuleType) -> None:
    compare(ex, [5, 1, 1, 4, 2, 2], 2, "continuous")


@checks.case("random lengths and slots, both modes (seed 1)", "simulate_batching",
             "a request with n output tokens is in exactly n consecutive steps")
def random_lengths(ex: ModuleType) -> None:
    rng = np.random.default_rng(1)
    for _ in range(3):
        lengths = rng.integers(1, 12, int(rng.integers(3, 10))).tolist()
        slots = int(rng.integers(1, 5))
        for batching in ("continuous", "static"):
            compare(ex, lengths, slots, batching)


@checks.case("equal lengths gain nothing; unequal lengths gain", "predicted_speedup",
             "len(static steps) / len(continuous steps), from your simulate_batching")
def speedup(ex: ModuleType) -> None:
    for lengths, slots in (([4, 4, 4, 4], 2), ([9, 1, 1, 1, 9, 1, 1, 1], 4), ([20, 2, 2, 2, 2, 2], 2)):
        want = len(engine_steps(lengths, slots, "static")) / len(engine_steps(lengths, slots, "continuous"))
        expect_close(ex.predicted_speedup(lengths, slots), want, f"predicted_speedup({lengths}, {slots})")
