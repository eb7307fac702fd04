"""Lesson 06 checker: your allocator in lockstep with the engine's PagePool; waste by definition."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import (
    CaseFailed,
    Checklist,
    expect,
    expect_close,
    expect_equal,
    expect_raises,
)
from tinyinfer.errors import OutOfPagesError
from tinyinfer.kv import PagePool

checks = Checklist()


def check_tables(mine: object, pool: PagePool, lengths: dict[int, int], num_pages: int, after: str) -> None:
    """Every invariant an allocator must keep, compared with the engine's pool."""
    expect_equal(mine.num_free, pool.num_free_pages, f"num_free {after}")
    held: list[int] = []
    for seq, n in lengths.items():
        table = list(mine.page_table(seq))
        expect_equal(len(table), len(pool.page_table(seq)), f"page table length of sequence {seq} ({n} tokens) {after}")
        held += table
    expect(all(isinstance(p, (int, np.integer)) and 0 <= p < num_pages for p in held),
           f"every page id must be an integer in 0..{num_pages - 1} {after}", f"held pages: {sorted(held)}")
    expect(len(set(held)) == len(held), f"a page is held twice {after}: two sequences would overwrite "
           "each other's K/V", f"held pages: {sorted(held)}")


def lockstep(ex: ModuleType, seed: int, num_pages: int = 12, page_size: int = 4, ops: int = 150) -> None:
    """Random starts, growths and frees, applied to your allocator and to the engine's pool."""
    rng = np.random.default_rng(seed)
    mine = ex.PageAllocator(num_pages, page_size)
    pool = PagePool(num_pages, page_size, enable_prefix_caching=False)
    lengths: dict[int, int] = {}
    next_id = 0
    for i in range(ops):
        r = rng.random()
        if r < 0.2 and lengths:
            seq = int(rng.choice(list(lengths)))
            mine.free(seq)
            pool.free(seq)
            del lengths[seq]
            check_tables(mine, pool, lengths, num_pages, f"after operation {i}: free sequence {seq}")
            continue
        if r < 0.45 or not lengths:
            seq, n, new = next_id, int(rng.integers(1, 11)), True
            next_id += 1
            pool.add_sequence(seq, [0])
        else:
            seq, new = int(rng.choice(list(lengths))), False
            n = lengths[seq] + int(rng.integers(1, 7))
        what = f"operation {i}: {'start' if new else 'grow'} sequence {seq} to {n} tokens"
        if not pool.can_allocate(pool.pages_needed(seq, n)):
            free_before = mine.num_free
            expect_raises(OutOfPagesError, lambda: mine.allocate(seq, n), f"{what} (too few free pages)")
            expect_equal(mine.num_free, free_before, f"num_free after the failed {what}: nothing may change")
            if new:
                pool.free(seq)
            continue
        got = mine.allocate(seq, n)
        want = pool.ensure_capacity(seq, n)
        if got is None or len(got) != len(want):
            raise CaseFailed(f"{what} should return the {len(want)} new page(s)",
                             f"{len(want)} new pages", f"{got!r}")
        lengths[seq] = n
        check_tables(mine, pool, lengths, num_pages, f"after {what}")


@checks.case("one sequence growing token by token", "PageAllocator",
             "pages needed = ceil(num_tokens / page_size) - pages already held; never fewer, never more")
def grow(ex: ModuleType) -> None:
    mine, pool = ex.PageAllocator(8, 4), PagePool(8, 4, enable_prefix_caching=False)
    pool.add_sequence(0, [0])
    for n in range(1, 30):
        got = mine.allocate(0, n)
        want = pool.ensure_capacity(0, n)
        expect_equal(len(got or []), len(want), f"allocate(0, {n}): number of new pages")
        check_tables(mine, pool, {0: n}, 8, f"after allocate(0, {n})")


@checks.case("slots follow the page table", "PageAllocator",
             "slot = page_table[position // page_size] * page_size + position % page_size")
def slots(ex: ModuleType) -> None:
    mine = ex.PageAllocator(10, 4)
    mine.allocate(1, 5)
    mine.allocate(2, 7)
    mine.allocate(1, 13)
    for seq, n in ((1, 13), (2, 7)):
        table = list(mine.page_table(seq))
        for pos in range(n):
            expect_equal(mine.slot(seq, pos), table[pos // 4] * 4 + pos % 4, f"slot({seq}, {pos})")


@checks.case("running out of pages changes nothing", "PageAllocator",
             "check there are enough free pages before taking any; raise OutOfPagesError otherwise")
def exhausted(ex: ModuleType) -> None:
    mine = ex.PageAllocator(3, 4)
    mine.allocate(0, 8)
    expect_raises(OutOfPagesError, lambda: mine.allocate(1, 9), "allocate(1, 9) with 1 page free")
    expect_equal(mine.num_free, 1, "num_free after the failed allocate")
    expect_raises(OutOfPagesError, lambda: mine.allocate(0, 13), "allocate(0, 13) with 1 page free")
    expect_equal(len(mine.page_table(0)), 2, "sequence 0's page table after its failed growth")


@checks.case("150 random starts, growths and frees, in lockstep with PagePool (seeds 1-3)", "PageAllocator",
             "free must return every page of the sequence; freed pages are handed out again later")
def random_ops(ex: ModuleType) -> None:
    for seed in (1, 2, 3):
        lockstep(ex, seed)


@checks.case("lengths 1, 16, 17, 40 in pages of 16", "paged_waste",
             "allocated slots = sum(ceil(n / page_size) * page_size); waste = 1 - tokens / allocated")
def waste_paged(ex: ModuleType) -> None:
    for lengths, bs in (([1, 16, 17, 40], 16), ([16, 32], 16), ([5], 4)):
        allocated = sum(-(-n // bs) * bs for n in lengths)
        expect_close(ex.paged_waste(lengths, bs), 1 - sum(lengths) / allocated, f"paged_waste({lengths}, {bs})")


@checks.case("the same lengths, each reserving 64 or 1024 slots", "contiguous_waste",
             "reserved slots = max_len per sequence; waste = 1 - tokens / reserved")
def waste_contiguous(ex: ModuleType) -> None:
    for lengths, max_len in (([1, 16, 17, 40], 64), ([300, 500], 1024), ([64], 64)):
        expect_close(ex.contiguous_waste(lengths, max_len), 1 - sum(lengths) / (max_len * len(lengths)),
                     f"contiguous_waste({lengths}, {max_len})")
