"""Tests for the KV page pool: allocation, prefix caching, eviction, fork, truncate, invariants."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tinyinfer.errors import OutOfPagesError, PromptError, TinyInferError
from tinyinfer.kv import PagePool, PageState, page_hash


def run_prompt(pool: PagePool, seq_id: int, tokens: list[int]) -> int:
    """Add a sequence, give it pages for its prompt and commit it, as the engine does after prefill."""
    cached = pool.add_sequence(seq_id, tokens)
    pool.ensure_capacity(seq_id, len(tokens))
    pool.commit(seq_id, tokens)
    pool.check()
    return cached


# ---- construction and plain allocation ---------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"num_pages": 0}, {"num_pages": 4, "page_size": 0}])
def test_bad_constructor_args_raise(kwargs):
    with pytest.raises(TinyInferError):
        PagePool(**kwargs)


def test_fresh_pool_is_all_free():
    pool = PagePool(num_pages=5, page_size=4)
    pool.check()
    assert (pool.num_free_pages, pool.num_used_pages, pool.num_cached_pages) == (5, 0, 0)


def test_ensure_capacity_allocates_only_missing_pages():
    pool = PagePool(num_pages=8, page_size=4)
    assert pool.add_sequence(1, [1, 2, 3]) == 0
    assert pool.pages_needed(1, 9) == 3
    assert pool.ensure_capacity(1, 9) == [0, 1, 2]
    assert pool.ensure_capacity(1, 12) == []
    assert pool.pages_needed(1, 12) == 0
    assert pool.ensure_capacity(1, 13) == [3]
    assert pool.page_table(1) == [0, 1, 2, 3]
    assert pool.num_used_pages == 4 and pool.num_free_pages == 4
    pool.check()


def test_pages_are_handed_out_as_a_tuple_that_later_growth_leaves_alone():
    pool = PagePool(num_pages=8, page_size=4)
    pool.add_sequence(1, [1, 2, 3])
    pool.ensure_capacity(1, 8)
    before = pool.pages(1)
    assert before == (0, 1) and pool.pages(1) is before  # no copy per call
    pool.ensure_capacity(1, 9)
    assert before == (0, 1) and pool.pages(1) == (0, 1, 2)
    pool.truncate(1, 4)
    assert pool.pages(1) == (0,)


def test_slot_maps_positions_through_the_block_table():
    pool = PagePool(num_pages=8, page_size=4)
    pool.add_sequence(7, [5])
    pool.add_sequence(8, [5])
    pool.ensure_capacity(7, 4)  # page 0
    pool.ensure_capacity(8, 4)  # page 1
    pool.ensure_capacity(7, 8)  # page 2
    assert [pool.slot(7, p) for p in range(8)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert pool.slot(8, 2) == 6
    with pytest.raises(TinyInferError, match="ensure_capacity"):
        pool.slot(7, 8)
    with pytest.raises(TinyInferError):
        pool.slot(7, -1)
    # every position at once, -1 (sits out) kept -1, in any shape
    positions = np.array([[0, 5, -1], [7, 3, 4]])
    assert pool.slots(7, positions).tolist() == [[0, 9, -1], [11, 3, 8]]
    for bad in (8, -2):
        with pytest.raises(TinyInferError):
            pool.slots(7, np.array([1, bad]))


def test_out_of_pages_changes_nothing():
    pool = PagePool(num_pages=3, page_size=4)
    run_prompt(pool, 1, [1, 2, 3, 4, 5])  # pages 0, 1; page 0 full and cached
    pool.add_sequence(2, [9])
    before = pool.snapshot()
    assert pool.pages_needed(2, 9) == 3 and not pool.can_allocate(3)
    with pytest.raises(OutOfPagesError, match="more pages"):
        pool.ensure_capacity(2, 9)
    assert pool.snapshot() == before
    assert pool.page_table(2) == []
    pool.check()


def test_unknown_and_duplicate_sequences_raise():
    pool = PagePool(num_pages=4, page_size=4)
    for call in (lambda: pool.free(3), lambda: pool.page_table(3), lambda: pool.ensure_capacity(3, 1)):
        with pytest.raises(TinyInferError, match="not in the page pool"):
            call()
    pool.add_sequence(3, [1])
    with pytest.raises(TinyInferError, match="already"):
        pool.add_sequence(3, [1])
    with pytest.raises(PromptError):
        pool.add_sequence(4, [])


def test_commit_needs_capacity_and_cannot_shrink():
    pool = PagePool(num_pages=4, page_size=4)
    pool.add_sequence(1, [1, 2, 3, 4, 5])
    with pytest.raises(TinyInferError, match="ensure_capacity"):
        pool.commit(1, [1, 2, 3, 4, 5])
    pool.ensure_capacity(1, 5)
    pool.commit(1, [1, 2, 3, 4, 5])
    assert pool.num_tokens(1) == 5
    with pytest.raises(TinyInferError, match="truncate"):
        pool.commit(1, [1, 2, 3])


def test_free_returns_pages_and_empties_the_pool():
    pool = PagePool(num_pages=4, page_size=4, enable_prefix_caching=False)
    run_prompt(pool, 1, list(range(10)))
    assert pool.free(1) == [2, 1, 0]
    assert pool.num_used_pages == 0 and pool.num_cached_pages == 0
    pool.check()


# ---- prefix caching ---------------------------------------------------------------------


def test_commit_of_a_prefix_by_length_equals_commit_of_a_copy():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    pools = [PagePool(num_pages=4, page_size=4) for _ in range(2)]
    for pool in pools:
        pool.add_sequence(1, tokens[:3])
        pool.ensure_capacity(1, 9)
    assert pools[0].commit(1, tokens, 6) == pools[1].commit(1, tokens[:6]) == [0]
    assert pools[0].commit(1, tokens, 9) == pools[1].commit(1, tokens) == [1]
    assert pools[0].snapshot() == pools[1].snapshot()


def test_commit_registers_only_full_pages():
    pool = PagePool(num_pages=4, page_size=4)
    pool.add_sequence(1, [1, 2, 3])
    pool.ensure_capacity(1, 6)
    assert pool.commit(1, [1, 2, 3]) == []
    assert pool.commit(1, [1, 2, 3, 4, 5, 6]) == [0]
    assert pool.num_cached_pages == 1
    assert pool.snapshot().pages[0] == PageState(0, (1,), 1, True)
    assert pool.snapshot().pages[1] == PageState(1, (1,), 1, False)


def test_prefix_hit_shares_full_pages_and_counts_tokens():
    pool = PagePool(num_pages=8, page_size=4)
    run_prompt(pool, 1, list(range(10)))  # pages 0, 1 full and cached; page 2 partial
    cached = pool.add_sequence(2, list(range(9)) + [99])
    assert cached == 8
    assert pool.page_table(2) == [0, 1]
    assert pool.num_tokens(2) == 8
    assert [p.ref_count for p in pool.snapshot().pages[:3]] == [2, 2, 1]
    assert pool.snapshot().pages[0].owners == (1, 2)
    assert (pool.prefix_hits, pool.prefix_queries) == (8, 20)
    pool.check()


def test_prefix_hit_never_covers_the_last_prompt_token():
    pool = PagePool(num_pages=8, page_size=4)
    run_prompt(pool, 1, list(range(8)))  # two full cached pages
    assert pool.add_sequence(2, list(range(8))) == 4  # second page dropped: position 7 must run
    assert pool.add_sequence(3, list(range(9))) == 8
    assert pool.add_sequence(4, list(range(4))) == 0
    pool.check()


def test_prefix_hash_is_chained_so_same_page_after_other_prefix_misses():
    pool = PagePool(num_pages=8, page_size=2)
    run_prompt(pool, 1, [1, 1, 2, 2, 3])
    assert pool.add_sequence(2, [9, 9, 2, 2, 3]) == 0  # page [2, 2] cached, but after [1, 1]
    assert pool.add_sequence(3, [1, 1, 2, 2, 4]) == 4
    assert page_hash(None, [2, 2]) != page_hash(page_hash(None, [1, 1]), [2, 2])


def test_prefix_hit_checks_stored_tokens_not_just_the_hash():
    pool = PagePool(num_pages=8, page_size=2)
    run_prompt(pool, 1, [1, 2, 3])
    # Forge a collision: point the hash of [5, 6] at the page holding [1, 2].
    pool._by_hash[page_hash(None, [5, 6])] = pool._by_hash.pop(page_hash(None, [1, 2]))
    pool._hash[0] = page_hash(None, [5, 6])
    assert pool.add_sequence(2, [5, 6, 7]) == 0


def test_identical_page_keeps_first_registration():
    pool = PagePool(num_pages=8, page_size=2)
    pool.add_sequence(1, [1, 2, 3])
    pool.add_sequence(2, [1, 2, 3])  # nothing cached yet: both compute page [1, 2]
    pool.ensure_capacity(1, 3)
    pool.ensure_capacity(2, 3)
    assert pool.commit(1, [1, 2, 3]) == [pool.page_table(1)[0]]
    assert pool.commit(2, [1, 2, 3]) == []
    assert pool.num_cached_pages == 1
    pool.free(1)
    pool.check()
    assert pool.add_sequence(3, [1, 2, 9]) == 2
    assert pool.page_table(3) == [0]
    assert not pool.snapshot().pages[pool.page_table(2)[0]].cached


def test_disabled_prefix_caching_never_hits():
    pool = PagePool(num_pages=8, page_size=2, enable_prefix_caching=False)
    run_prompt(pool, 1, [1, 2, 3, 4, 5])
    assert pool.add_sequence(2, [1, 2, 3, 4, 5]) == 0
    assert pool.num_cached_pages == 0
    assert (pool.prefix_hits, pool.prefix_queries) == (0, 10)


def test_freed_cached_pages_stay_reusable_until_evicted():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1, 2, 3])  # page 0 cached, page 1 partial
    assert pool.free(1) == [1, 0]
    assert pool.num_free_pages == 4 and pool.num_cached_pages == 1
    assert pool.snapshot().evictable == (0,)
    assert pool.add_sequence(2, [1, 2, 7]) == 2
    assert pool.page_table(2) == [0]
    assert pool.snapshot().evictable == ()
    pool.check()


# ---- eviction ---------------------------------------------------------------------------


def test_allocation_prefers_uncached_pages_then_evicts_lru():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1, 1])  # page 0
    run_prompt(pool, 2, [2, 2])  # page 1
    run_prompt(pool, 3, [3, 3])  # page 2
    pool.free(2)
    pool.free(1)
    pool.free(3)
    assert pool.snapshot().evictable == (1, 0, 2)
    pool.add_sequence(4, [9])
    assert pool.ensure_capacity(4, 2) == [3]  # never-cached page first
    assert pool.ensure_capacity(4, 4) == [1]  # then the page released longest ago
    assert pool.num_cached_pages == 2
    assert pool.add_sequence(5, [2, 2, 5]) == 0  # its cache entry went with it
    assert pool.add_sequence(6, [1, 1, 5]) == 2
    assert pool.ensure_capacity(4, 6) == [2]  # page 0 is held again, so page 2 goes
    with pytest.raises(OutOfPagesError):
        pool.ensure_capacity(4, 8)
    pool.check()


def test_free_releases_tail_pages_first_for_lru():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1, 2, 3, 4, 5])  # pages 0, 1 cached
    pool.free(1)
    assert pool.snapshot().evictable == (1, 0)


# ---- truncate ---------------------------------------------------------------------------


def test_truncate_frees_pages_beyond_and_uncaches_the_overwritten_page():
    pool = PagePool(num_pages=8, page_size=2)
    run_prompt(pool, 1, [1, 2, 3, 4, 5, 6, 7])  # pages 0..3, pages 0..2 cached
    assert pool.truncate(1, 3) == [3, 2]
    assert pool.page_table(1) == [0, 1]
    assert pool.num_tokens(1) == 3
    assert [p.cached for p in pool.snapshot().pages[:4]] == [True, False, True, False]
    assert pool.snapshot().evictable == (2,)  # full rolled-back page: its KV still matches its hash
    pool.check()
    pool.ensure_capacity(1, 4)
    assert pool.commit(1, [1, 2, 3, 9]) == [1]
    assert pool.add_sequence(2, [1, 2, 3, 4, 5]) == 2
    assert pool.add_sequence(3, [1, 2, 3, 9, 5]) == 4
    pool.check()


def test_truncate_keeps_num_tokens_when_cutting_only_unwritten_capacity():
    pool = PagePool(num_pages=8, page_size=2)
    pool.add_sequence(1, [1, 2, 3])
    pool.ensure_capacity(1, 8)
    pool.commit(1, [1, 2, 3])
    assert pool.truncate(1, 4) == [3, 2]
    assert pool.num_tokens(1) == 3
    with pytest.raises(TinyInferError):
        pool.truncate(1, 5)
    pool.check()


def test_truncate_into_a_shared_page_is_refused_unchanged():
    pool = PagePool(num_pages=8, page_size=2)
    run_prompt(pool, 1, [1, 2, 3, 4, 5])
    pool.add_sequence(2, [1, 2, 3, 4, 6])
    before = pool.snapshot()
    with pytest.raises(TinyInferError, match="shared"):
        pool.truncate(2, 3)
    assert pool.snapshot() == before
    assert pool.truncate(2, 2) == []  # drops a shared page whole: only a reference goes
    assert pool.snapshot().pages[1].ref_count == 1
    pool.check()


# ---- fork -------------------------------------------------------------------------------


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pool = PagePool(num_pages=8, page_size=2)
    run_prompt(pool, 1, [1, 2, 3, 4, 5])  # pages 0, 1 full, page 2 partial
    assert pool.fork(1, 2) == (2, 3)
    assert pool.page_table(2) == [0, 1, 3]
    assert pool.num_tokens(2) == 5
    assert [p.ref_count for p in pool.snapshot().pages[:4]] == [2, 2, 1, 1]
    pool.ensure_capacity(2, 6)
    assert pool.commit(2, [1, 2, 3, 4, 5, 7]) == [3]
    pool.check()


def test_fork_of_page_aligned_sequence_needs_no_copy():
    pool = PagePool(num_pages=2, page_size=2)
    run_prompt(pool, 1, [1, 2, 3, 4])
    assert pool.fork(1, 2) is None
    assert pool.page_table(2) == [0, 1]
    with pytest.raises(TinyInferError, match="already"):
        pool.fork(1, 2)
    pool.check()


def test_fork_without_a_free_page_changes_nothing():
    pool = PagePool(num_pages=2, page_size=2)
    run_prompt(pool, 1, [1, 2, 3])
    before = pool.snapshot()
    with pytest.raises(OutOfPagesError):
        pool.fork(1, 2)
    assert pool.snapshot() == before
    with pytest.raises(TinyInferError):
        pool.page_table(2)


# ---- check() catches broken bookkeeping --------------------------------------------------


def test_check_reports_a_wrong_ref_count():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1, 2, 3])
    pool._ref[0] = 2
    with pytest.raises(AssertionError, match="page 0 ref_count 2 != 1 holders"):
        pool.check()


def test_check_reports_a_page_both_free_and_held():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1])
    pool._free.append(0)
    with pytest.raises(AssertionError, match="page 0 is not exactly one"):
        pool.check()


def test_check_reports_a_dangling_hash():
    pool = PagePool(num_pages=4, page_size=2)
    run_prompt(pool, 1, [1, 2, 3])
    pool._by_hash[12345] = 1
    with pytest.raises(AssertionError, match="hash 12345 maps to page 1"):
        pool.check()


# ---- stateful: random workloads against a model ------------------------------------------

BLOCK = 2
PAGES = 8
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=7)


class PoolMachine(RuleBasedStateMachine):
    """Drives a small pool like an engine would, with a fake KV store holding token ids per slot.

    The model keeps each sequence's committed tokens and its page table as built from
    what the pool returned; expected ref counts come from those tables, and reading a
    sequence's tokens back out of the store proves no page was shared or reused wrongly.
    """

    caching = True

    def __init__(self):
        super().__init__()
        self.pool = PagePool(num_pages=PAGES, page_size=BLOCK, enable_prefix_caching=self.caching)
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.store: dict[int, int] = {}  # slot -> token id whose "KV" is written there
        self.next_id = 0

    def refs(self) -> list[int]:
        counts = [0] * PAGES
        for table in self.tables.values():
            for page in table:
                counts[page] += 1
        return counts

    def write(self, seq_id: int, tokens: list[int]) -> None:
        """Write KV for tokens past the committed ones, then commit, as a runner step would."""
        for pos in range(self.pool.num_tokens(seq_id), len(tokens)):
            self.store[self.pool.slot(seq_id, pos)] = tokens[pos]
        self.pool.commit(seq_id, tokens)
        self.tokens[seq_id] = list(tokens)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """ensure_capacity, checking it hands out unheld pages or changes nothing at all."""
        before = self.pool.snapshot()
        held = self.refs()
        try:
            new = self.pool.ensure_capacity(seq_id, num_tokens)
        except OutOfPagesError:
            assert self.pool.snapshot() == before
            return False
        assert all(held[page] == 0 for page in new)
        self.tables[seq_id] += new
        return True

    @rule(prompt=tokens_st)
    def add(self, prompt):
        seq_id = self.next_id
        self.next_id += 1
        cached = self.pool.add_sequence(seq_id, prompt)
        assert cached < len(prompt) and cached % BLOCK == 0
        self.tables[seq_id] = self.pool.page_table(seq_id)
        assert [self.store[self.pool.slot(seq_id, p)] for p in range(cached)] == prompt[:cached]
        self.tokens[seq_id] = prompt[:cached]
        if self.grow(seq_id, len(prompt)):
            self.write(seq_id, prompt)
        else:
            self.release(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=tokens_st)
    def append(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq_id] + extra
        if self.grow(seq_id, len(tokens)):
            self.write(seq_id, tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        before = self.pool.snapshot()
        try:
            copy = self.pool.fork(parent, child)
        except OutOfPagesError:
            assert self.pool.snapshot() == before
            return
        full = len(self.tokens[parent]) // BLOCK
        self.tables[child] = self.tables[parent][:full]
        if copy is not None:
            src, dst = copy
            assert src == self.tables[parent][full] and self.refs()[dst] == 0
            for offset in range(BLOCK):
                if src * BLOCK + offset in self.store:
                    self.store[dst * BLOCK + offset] = self.store[src * BLOCK + offset]
            self.tables[child].append(dst)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tables[seq_id]) * BLOCK))
        keep = -(-n // BLOCK)
        if n % BLOCK and self.refs()[self.tables[seq_id][keep - 1]] > 1:
            before = self.pool.snapshot()
            with pytest.raises(TinyInferError, match="shared"):
                self.pool.truncate(seq_id, n)
            assert self.pool.snapshot() == before
            return
        refs = self.refs()
        freed = self.pool.truncate(seq_id, n)
        assert sorted(freed) == sorted(p for p in self.tables[seq_id][keep:] if refs[p] == 1)
        del self.tables[seq_id][keep:]
        del self.tokens[seq_id][n:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.release(data.draw(st.sampled_from(sorted(self.tokens))))

    def release(self, seq_id: int) -> None:
        refs = self.refs()
        freed = self.pool.free(seq_id)
        assert sorted(freed) == sorted(p for p in self.tables[seq_id] if refs[p] == 1)
        del self.tables[seq_id], self.tokens[seq_id]

    @invariant()
    def bookkeeping_holds(self):
        self.pool.check()
        snap = self.pool.snapshot()
        assert [p.ref_count for p in snap.pages] == self.refs()
        assert snap.num_used == sum(1 for r in self.refs() if r)
        for seq_id, tokens in self.tokens.items():
            assert self.pool.page_table(seq_id) == self.tables[seq_id]
            assert self.pool.pages(seq_id) == tuple(self.tables[seq_id])
            assert self.pool.num_tokens(seq_id) == len(tokens)
            assert [self.store[self.pool.slot(seq_id, p)] for p in range(len(tokens))] == tokens

    def teardown(self):
        for seq_id in sorted(self.tokens):
            self.release(seq_id)
        self.pool.check()
        assert self.pool.num_used_pages == 0
        assert self.pool.num_free_pages == PAGES


class PoolMachineNoCaching(PoolMachine):
    caching = False


_settings = settings(max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestPoolStateful = PoolMachine.TestCase
TestPoolStateful.settings = _settings
TestPoolStatefulNoCaching = PoolMachineNoCaching.TestCase
TestPoolStatefulNoCaching.settings = _settings
