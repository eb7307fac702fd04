"""Lesson 07 solution (for teachers): static and continuous batching, step by step."""

from __future__ import annotations


def simulate_batching(output_lengths: list[int], max_num_seqs: int, batching: str) -> list[int]:
    """How many requests run in each engine step, until every request has finished."""
    waiting = list(output_lengths)
    running: list[int] = []  # steps each running request still needs
    sizes = []
    while waiting or running:
        if batching == "continuous" or not running:
            while waiting and len(running) < max_num_seqs:
                running.append(waiting.pop(0))
        sizes.append(len(running))
        running = [left - 1 for left in running if left > 1]
    return sizes


def predicted_speedup(output_lengths: list[int], max_num_seqs: int) -> float:
    """Throughput of continuous over static batching, if every step costs the same time."""
    static = simulate_batching(output_lengths, max_num_seqs, "static")
    continuous = simulate_batching(output_lengths, max_num_seqs, "continuous")
    return len(static) / len(continuous)
