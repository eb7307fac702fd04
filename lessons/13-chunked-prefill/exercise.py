"""Lesson 13 exercise: split a prompt into chunks, prefill it chunk by chunk, and plan the steps.

Fill in every body, then run `tinyinfer lesson check 13`.

The runner API you need (as in lesson 04, see tinyinfer/runners/runner.py):
    kv = model.runner.new_kv_cache(num_pages, page_size)        # empty K/V storage
    batch = make_batch([(new_ids, start_position, page_table, False)], page_size)
    logits = model.runner.forward(batch, kv)                     # [1, V]: the last new token's
"""

from __future__ import annotations

import numpy as np

from tinyinfer.model import Model
from tinyinfer.runners.runner import make_batch

PAGE_SIZE = 16


def chunk_ranges(num_tokens: int, budget: int) -> list[tuple[int, int]]:
    """Positions 0..num_tokens-1 as consecutive [start, end) chunks of at most budget positions.

    chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    """
    raise NotImplementedError


def prefill_chunked(model: Model, prompt_ids: list[int], chunk: int) -> np.ndarray:
    """The last prompt position's logits [V], computed chunk by chunk (chunk_ranges(len, chunk)).

    Allocate the pages for the whole prompt once (page table = [0, 1, ...]); each chunk is one
    forward at its own start position, writing its K/V into the cache the next chunk reads.
    """
    raise NotImplementedError


def prefill_per_step(prompt_len: int, decoding: int, budget: int) -> list[int]:
    """Prompt tokens computed in each step until the prompt is done, while `decoding` other
    sequences decode (one token each per step, scheduled first). Every step computes at most
    `budget` tokens in all.

    prefill_per_step(200, 3, 64) == [61, 61, 61, 17]
    """
    raise NotImplementedError
