"""Lesson 04 solution (for teachers): recompute vs KV cache, and the cache's size."""

from __future__ import annotations

import math

import numpy as np

from tinyinfer.config import ModelConfig
from tinyinfer.model import Model
from tinyinfer.runners.runner import make_batch

BLOCK_SIZE = 16


def generate_recompute(model: Model, prompt_ids: list[int], n: int) -> tuple[list[int], int]:
    """n greedy tokens, running the whole sequence again for every one (no cache)."""
    ids, computed = list(prompt_ids), 0
    for _ in range(n):
        logits = model.logits(ids)  # [len(ids), V]: every position recomputed
        computed += len(ids)
        ids.append(int(np.argmax(logits[-1])))
    return ids[len(prompt_ids):], computed


def generate_cached(model: Model, prompt_ids: list[int], n: int) -> tuple[list[int], int]:
    """n greedy tokens with a KV cache: compute the prompt once, then one new token per forward."""
    pages = list(range(math.ceil((len(prompt_ids) + n) / BLOCK_SIZE)))
    kv = model.runner.new_kv_cache(len(pages), BLOCK_SIZE)
    new_ids, start, out, computed = list(prompt_ids), 0, [], 0
    for _ in range(n):
        logits = model.runner.forward(make_batch([(new_ids, start, pages, False)], BLOCK_SIZE), kv)
        computed += len(new_ids)
        start += len(new_ids)
        out.append(int(np.argmax(logits[-1])))
        new_ids = [out[-1]]  # only the new token: the others' K/V are in the cache
    return out, computed


def kv_cache_bytes(config: ModelConfig, num_tokens: int, bytes_per_value: int) -> int:
    """Bytes of K and V for num_tokens tokens."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * num_tokens * bytes_per_value
