"""Lesson 07 exercise: simulate static and continuous batching, step by step.

Fill in every body, then run `tinyinfer lesson check 07`.
"""

from __future__ import annotations


def simulate_batching(output_lengths: list[int], max_num_seqs: int, batching: str) -> list[int]:
    """How many requests run in each engine step, until every request has finished.

    All requests wait in a queue at step 0, in list order. Request i runs for
    output_lengths[i] consecutive steps: its first step prefills the prompt and samples the
    first token, each later step decodes one more. At the start of every step, waiting
    requests fill the free slots (up to max_num_seqs running), in queue order:
      "continuous": whenever a slot is free;
      "static":     only when nothing is running (the whole previous batch has finished).
    A request that finishes in a step frees its slot for the next step.
    Returns the number of running requests of each step, e.g. [2, 2, 1].
    """
    raise NotImplementedError


def predicted_speedup(output_lengths: list[int], max_num_seqs: int) -> float:
    """Throughput of continuous over static batching, if every step costs the same time.

    Both produce the same tokens, so the speedup is the ratio of their numbers of steps.
    """
    raise NotImplementedError
