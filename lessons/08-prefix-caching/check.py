"""Lesson 08 checker: your keys and reuse counts against the engine's PagePool prefix cache."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import Checklist, expect, expect_equal
from tinyinfer.kv import PagePool, page_hash

checks = Checklist()
BS = 4


def engine_chain(token_ids: list[int]) -> list[int]:
    """The engine's chained page hashes of the full pages."""
    keys: list[int] = []
    for i in range(len(token_ids) // BS):
        keys.append(page_hash(keys[-1] if keys else None, token_ids[i * BS:(i + 1) * BS]))
    return keys


def engine_reuse(history: list[list[int]], prompt: list[int]) -> int:
    """Tokens of prompt the engine serves from its cache after computing every history prompt."""
    pool = PagePool(64, BS, enable_prefix_caching=True)
    for seq, ids in enumerate(history):
        pool.add_sequence(seq, ids)
        pool.ensure_capacity(seq, len(ids))
        pool.commit(seq, ids)
        pool.free(seq)  # finished: its full pages stay cached
    return pool.add_sequence(len(history), prompt)


def compare_reuse(ex: ModuleType, history: list[list[int]], prompt: list[int], what: str) -> None:
    cached = {key for ids in history for key in ex.prefix_keys(ids, BS)}
    expect_equal(ex.reusable_tokens(prompt, cached, BS), engine_reuse(history, prompt), what)


@checks.case("equal inputs give equal keys, different inputs different keys", "page_key",
             "return hash((parent, tuple(tokens))): the parent makes the key stand for the whole prefix")
def keys(ex: ModuleType) -> None:
    a = ex.page_key(None, (1, 2, 3, 4))
    expect(isinstance(a, (int, np.integer)), "page_key should return an int", f"got {type(a).__name__}")
    expect_equal(ex.page_key(None, (1, 2, 3, 4)), a, "page_key(None, (1, 2, 3, 4)) computed twice")
    b = ex.page_key(a, (5, 6, 7, 8))
    expect(b != ex.page_key(None, (5, 6, 7, 8)), "page_key must depend on the parent",
           "page_key(a, (5, 6, 7, 8)) equals page_key(None, (5, 6, 7, 8))")
    expect(b != ex.page_key(a, (5, 6, 7, 9)), "page_key must depend on the tokens")


@checks.case("full pages only, chained like the engine's", "prefix_keys",
             "one key per full page: len(token_ids) // page_size keys; feed each key in as the next parent")
def chains(ex: ModuleType) -> None:
    rng = np.random.default_rng(1)
    base = rng.integers(0, 50, 13).tolist()
    variants = [base, base[:8] + [99] + base[9:], [7] + base[1:], base + [3, 3, 3], base[:3]]
    for ids in variants:
        got = list(ex.prefix_keys(ids, BS))
        expect_equal(len(got), len(ids) // BS, f"number of keys for {len(ids)} tokens in pages of {BS}")
    mine = [list(ex.prefix_keys(ids, BS)) for ids in variants]
    theirs = [engine_chain(ids) for ids in variants]
    for i in range(len(variants)):
        for j in range(len(variants)):
            for p in range(min(len(mine[i]), len(mine[j]))):
                expect((mine[i][p] == mine[j][p]) == (theirs[i][p] == theirs[j][p]),
                       f"page {p} of prompts {variants[i]} and {variants[j]}: your keys "
                       f"{'match' if mine[i][p] == mine[j][p] else 'differ'}, the engine's "
                       f"{'match' if theirs[i][p] == theirs[j][p] else 'differ'}",
                       "a page's key must match exactly when every token up to the page's end matches")


@checks.case("a shared system prompt and a new question", "reusable_tokens",
             "count leading pages whose key is cached, stop at the first miss, multiply by page_size")
def shared(ex: ModuleType) -> None:
    system = list(range(100, 110))
    compare_reuse(ex, [system + [1, 2, 3]], system + [7, 8, 9, 10, 11], "reusable_tokens of system + new question")


@checks.case("the same prompt again: its last token is always computed", "reusable_tokens",
             "only (len(token_ids) - 1) // page_size pages can be reused")
def repeat(ex: ModuleType) -> None:
    for n in (8, 9, 3):
        ids = list(range(1, n + 1))
        compare_reuse(ex, [ids], ids, f"reusable_tokens of a {n}-token prompt seen before")


@checks.case("equal later pages after a different early page are not reused", "reusable_tokens",
             "a key stands for the whole prefix: once one page misses, no later page can hit")
def diverged(ex: ModuleType) -> None:
    seen = list(range(1, 13))
    compare_reuse(ex, [seen], [1, 2, 3, 4, 0, 0, 0, 0] + seen[8:] + [5], "reusable_tokens after a difference in page 1")


@checks.case("random histories and prompts (seed 2)", "reusable_tokens",
             "build cached from prefix_keys of every earlier prompt, as the experiment does")
def random_histories(ex: ModuleType) -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        stem = rng.integers(0, 5, int(rng.integers(0, 12))).tolist()
        history = [stem + rng.integers(0, 5, int(rng.integers(1, 8))).tolist() for _ in range(3)]
        prompt = stem + rng.integers(0, 5, int(rng.integers(1, 8))).tolist()
        compare_reuse(ex, history, prompt, f"reusable_tokens({prompt}) after {history}")
