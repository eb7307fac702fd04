"""Lesson 04 checker: your generation loops against the engine's greedy output; the size formula
against ModelConfig.kv_bytes_per_token."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

import tinyinfer
from lessons.checking import Checklist, expect_equal
from lessons.support import LLAMA2_70B, tiny_config, tiny_model
from tinyinfer.config import config_from_dict

checks = Checklist()


def engine_greedy(model: tinyinfer.Model, prompt: list[int], n: int) -> list[int]:
    """The engine's own greedy continuation: the reference."""
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return tinyinfer.Engine(model).generate(prompt, params)[0].token_ids


def cases(seed: int) -> list[tuple[list[int], int]]:
    """Prompts and lengths crossing page boundaries (pages hold 16 tokens)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, int(p)).tolist(), int(n)) for p, n in ((5, 6), (1, 10), (14, 20), (33, 4))]


def check_generator(ex: ModuleType, name: str, count: Callable[[int, int], int]) -> None:
    model = tiny_model(seed=4)
    for prompt, n in cases(4):
        tokens, computed = getattr(ex, name)(model, prompt, n)
        expect_equal(list(tokens), engine_greedy(model, prompt, n),
                     f"{name} tokens for a {len(prompt)}-token prompt, n={n}")
        expect_equal(computed, count(len(prompt), n), f"{name}: tokens computed for a {len(prompt)}-token prompt, n={n}")


@checks.case("tokens and work for prompts of 1 to 33 tokens", "generate_recompute",
             "each step: logits = model.logits(ids); append argmax(logits[-1]); it computed len(ids) tokens")
def recompute(ex: ModuleType) -> None:
    check_generator(ex, "generate_recompute", lambda p, n: sum(p + i for i in range(n)))


@checks.case("tokens and work for prompts of 1 to 33 tokens", "generate_cached",
             "first forward: the whole prompt at start 0; then [last token] at start = tokens so far")
def cached(ex: ModuleType) -> None:
    check_generator(ex, "generate_cached", lambda p, n: p + n - 1)


@checks.case("a small GQA model, an MQA model and Llama-2-70B", "kv_cache_bytes",
             "2 (K and V) x layers x kv_heads x head_dim x tokens x bytes_per_value")
def size(ex: ModuleType) -> None:
    configs = {"tiny GQA": tiny_config(), "tiny MQA": tiny_config(kv_heads=1),
               "Llama-2-70B": config_from_dict(LLAMA2_70B)}
    for name, config in configs.items():
        for tokens, b in ((1, 2), (1000, 4), (32768, 2)):
            expect_equal(ex.kv_cache_bytes(config, tokens, b), config.kv_bytes_per_token(b) * tokens,
                         f"kv_cache_bytes({name}, {tokens} tokens, {b} bytes)")
