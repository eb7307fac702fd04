"""Lesson 13 checker: chunks, chunked prefill against one full pass, and the step plan against
the chunks the engine's scheduler makes."""

from __future__ import annotations

from types import ModuleType

import numpy as np

import tinyinfer
from lessons.checking import Checklist, expect_close, expect_equal
from lessons.support import tiny_model

checks = Checklist()


@checks.case("fixed and random lengths and budgets", "chunk_ranges",
             "range(0, num_tokens, budget) gives each chunk's start; its end is min(start + budget, num_tokens)")
def ranges(ex: ModuleType) -> None:
    expect_equal(ex.chunk_ranges(10, 4), [(0, 4), (4, 8), (8, 10)], "chunk_ranges(10, 4)")
    expect_equal(ex.chunk_ranges(8, 4), [(0, 4), (4, 8)], "chunk_ranges(8, 4): no empty chunk at the end")
    expect_equal(ex.chunk_ranges(3, 16), [(0, 3)], "chunk_ranges(3, 16): a prompt shorter than the budget")
    rng = np.random.default_rng(13)
    for n, b in rng.integers(1, 200, (20, 2)).tolist():
        want = [(s, min(s + b, n)) for s in range(0, n, b)]
        expect_equal([tuple(c) for c in ex.chunk_ranges(n, b)], want, f"chunk_ranges({n}, {b})")


@checks.case("prompts of 5 to 70 tokens in chunks of 1 to 64", "prefill_chunked",
             "one forward per chunk, start = the chunk's first position, the same pages every time: "
             "each chunk's queries attend over the K/V the chunks before it wrote")
def chunked(ex: ModuleType) -> None:
    model = tiny_model(seed=13)
    rng = np.random.default_rng(13)
    for length in (5, 33, 70):
        prompt = rng.integers(0, 64, length).tolist()
        whole = model.logits(prompt)[-1]  # one pass over the whole prompt: the reference
        for chunk in (1, 7, 16, 64):
            expect_close(ex.prefill_chunked(model, prompt, chunk), whole,
                         f"prefill_chunked of a {length}-token prompt in chunks of {chunk}", rtol=1e-4, atol=1e-4)


def engine_chunks(prompt_len: int, decoding: int, budget: int) -> list[int]:
    """The prompt tokens the engine's scheduler computes per step, while `decoding` sequences decode."""
    model = tiny_model(seed=13)
    engine = tinyinfer.Engine(model, max_num_batched_tokens=budget, num_pages=64, page_size=16)
    keep = tinyinfer.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(decoding):
        engine.add_request([i + 1], keep)
    engine.step()  # the short prompts' prefill: from now on they decode
    prompt = [i % 64 for i in range(prompt_len)]
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=1))
    chunks = []
    while engine.completion(rid).finish_reason is None:
        chunks += [p.end - p.start for p in engine.step().seqs if p.request_id == rid]
    return chunks


@checks.case("a long prompt arriving while others decode, as the engine schedules it", "prefill_per_step",
             "each step the decoding sequences take one token each first; the prompt gets budget - decoding "
             "tokens, and its last chunk only what is left")
def per_step(ex: ModuleType) -> None:
    expect_equal(ex.prefill_per_step(200, 3, 64), [61, 61, 61, 17], "prefill_per_step(200, 3, 64)")
    for prompt_len, decoding, budget in ((100, 0, 32), (150, 2, 40), (64, 5, 64), (30, 1, 64)):
        expect_equal(list(ex.prefill_per_step(prompt_len, decoding, budget)),
                     engine_chunks(prompt_len, decoding, budget),
                     f"prefill_per_step({prompt_len}, {decoding}, {budget}) against the engine's steps")
