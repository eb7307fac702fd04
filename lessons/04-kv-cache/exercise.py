"""Lesson 04 exercise: generate with and without a KV cache, and size the cache.

Fill in every body, then run `tinyinfer lesson check 04`.

The runner API you need (see tinyinfer/runners/runner.py):
    kv = model.runner.new_kv_cache(num_pages, page_size)        # empty K/V storage
    batch = make_batch([(new_ids, start_position, page_table, False)], page_size)
    logits = model.runner.forward(batch, kv)                     # [1, V]: the last new token's
forward() writes the K/V of new_ids (positions start_position, start_position + 1, ...) into
the pages of page_table and attends over every position before them that is already stored.
"""

from __future__ import annotations

import math

import numpy as np

from tinyinfer.config import ModelConfig
from tinyinfer.model import Model
from tinyinfer.runners.runner import make_batch

BLOCK_SIZE = 16


def generate_recompute(model: Model, prompt_ids: list[int], n: int) -> tuple[list[int], int]:
    """n greedy tokens, running the whole sequence again for every one (no cache).

    model.logits(ids) returns logits [len(ids), V]; the last row predicts the next token,
    and np.argmax picks it. Returns (the n new tokens, how many tokens were computed in total).
    """
    raise NotImplementedError


def generate_cached(model: Model, prompt_ids: list[int], n: int) -> tuple[list[int], int]:
    """n greedy tokens with a KV cache: compute the prompt once, then one new token per forward.

    Allocate enough pages for len(prompt_ids) + n tokens up front (page table = [0, 1, ...]).
    Returns (the n new tokens, how many tokens were computed in total).
    """
    raise NotImplementedError


def kv_cache_bytes(config: ModelConfig, num_tokens: int, bytes_per_value: int) -> int:
    """Bytes of K and V for num_tokens tokens: every layer stores a K and a V vector per KV head.

    Use config.num_layers, config.num_kv_heads and config.head_dim.
    """
    raise NotImplementedError
