"""Lesson 13 solution (for teachers): chunks, chunked prefill through the runner, the step plan."""

from __future__ import annotations

import math

import numpy as np

from tinyinfer.model import Model
from tinyinfer.runners.runner import make_batch

PAGE_SIZE = 16


def chunk_ranges(num_tokens: int, budget: int) -> list[tuple[int, int]]:
    """Positions 0..num_tokens-1 as consecutive [start, end) chunks of at most budget positions."""
    return [(start, min(start + budget, num_tokens)) for start in range(0, num_tokens, budget)]


def prefill_chunked(model: Model, prompt_ids: list[int], chunk: int) -> np.ndarray:
    """The last prompt position's logits [V], computed chunk by chunk."""
    pages = list(range(math.ceil(len(prompt_ids) / PAGE_SIZE)))
    kv = model.runner.new_kv_cache(len(pages), PAGE_SIZE)
    logits = None
    for start, end in chunk_ranges(len(prompt_ids), chunk):
        # Each chunk attends over the positions before it, already in the cache.
        logits = model.runner.forward(make_batch([(prompt_ids[start:end], start, pages, False)], PAGE_SIZE), kv)
    return logits[-1]


def prefill_per_step(prompt_len: int, decoding: int, budget: int) -> list[int]:
    """Prompt tokens per step while `decoding` sequences take their one token first."""
    steps, left = [], prompt_len
    while left > 0:
        n = min(left, budget - decoding)
        steps.append(n)
        left -= n
    return steps
