"""KV page bookkeeping shared by both model runners: which pages each sequence holds.

A runner owns the KV storage, one array ``[num_pages, page_size, n_kv_heads, head_dim]``
per layer; this module only hands out page ids and remembers who holds them. A sequence's
*page table* lists its pages in order, so token position ``p`` lives in page
``table[p // page_size]`` at offset ``p % page_size``.

Prefix caching: every full page gets a chained hash (its tokens plus the hash of the page
before it), so a later prompt that starts with the same tokens reuses the page instead of
recomputing it. Pages nobody references but that still carry a hash stay "evictable": free
to hand out, yet reusable until evicted, least recently released first.

Every page is in exactly one state: free (no hash, nobody holds it), evictable (hash,
nobody holds it) or referenced (``ref_count`` sequences hold it).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tinyinfer.engine_config import DEFAULTS
from tinyinfer.errors import OutOfPagesError, PromptError, TinyInferError


# Plug points: functions this module calls by their global name, so that the course can put a
# student's version in their place (lessons/support.py: plugged). tests/test_lessons.py checks
# that the engine still reaches every one.
PLUG_POINTS = ("page_hash",)


def page_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash one full page from its tokens and the previous page's hash (None for the first page).

    Chaining makes the hash describe the whole prefix, so equal tokens after a different
    prefix (whose KV differs) do not match.
    """
    head = struct.pack("<?Q", parent is None, parent or 0)
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.blake2b(head + body, digest_size=8).digest(), "little")


@dataclass(frozen=True)
class PageState:
    """One page as the TUI draws it: which sequences hold it and whether it carries a prefix hash."""

    page_id: int
    owners: tuple[int, ...]
    ref_count: int
    cached: bool


@dataclass(frozen=True)
class PoolSnapshot:
    """The whole page pool at one moment, for the TUI and step traces."""

    page_size: int
    pages: tuple[PageState, ...]
    evictable: tuple[int, ...]  # cached pages nobody holds, next to be evicted first
    num_free: int
    num_used: int
    num_cached: int
    prefix_hits: int
    prefix_queries: int


@dataclass
class _Seq:
    """One sequence's pages, how many of its tokens have KV written, and its page hash chain."""

    table: tuple[int, ...]  # immutable, so pages() hands it out without a copy
    num_tokens: int
    hashes: list[int]  # chained hash of each full written page; empty without prefix caching


class PagePool:
    """Hands out KV pages to sequences, shares full prompt pages between them, and evicts LRU."""

    def __init__(self, num_pages: int, page_size: int = DEFAULTS.page_size,
                 enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching) -> None:
        if num_pages < 1:
            raise TinyInferError(f"num_pages must be at least 1, got {num_pages}; give the KV cache more memory")
        if page_size < 1:
            raise TinyInferError(f"page_size must be at least 1, got {page_size}; {DEFAULTS.page_size} is a good default")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_pages
        self._hash: list[int | None] = [None] * num_pages
        # (parent hash, tokens) each cached page was registered with, compared on every hit
        # so that a hash collision can never hand out the wrong KV.
        self._content: list[tuple[int | None, tuple[int, ...]] | None] = [None] * num_pages
        self._by_hash: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._seqs: dict[int, _Seq] = {}
        self._prefix_hits = 0
        self._prefix_queries = 0

    # ---- sequences -------------------------------------------------------------------

    def add_sequence(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Start a sequence, reusing cached pages of its prompt; returns how many prompt tokens are cached."""
        if seq_id in self._seqs:
            raise TinyInferError(f"sequence {seq_id} is already in the page pool; free it or use a new id")
        if len(token_ids) == 0:
            raise PromptError("cannot add a sequence with an empty prompt; give it at least one token")
        seq = _Seq(table=(), num_tokens=0, hashes=[])
        if self.enable_prefix_caching:
            hits = self._cached_prefix(token_ids)
            for page, h in hits:
                self._hold(page)
                seq.hashes.append(h)
            seq.table = tuple(page for page, _ in hits)
        seq.num_tokens = len(seq.table) * self.page_size
        self._seqs[seq_id] = seq
        self._prefix_queries += len(token_ids)
        self._prefix_hits += seq.num_tokens
        return seq.num_tokens

    def ensure_capacity(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the page table to cover num_tokens slots; returns the new pages (all or nothing)."""
        seq = self._seq(seq_id)
        needed = self.pages_needed(seq_id, num_tokens)
        if not self.can_allocate(needed):
            raise OutOfPagesError(
                f"sequence {seq_id} needs {needed} more KV pages for {num_tokens} tokens but only "
                f"{self.num_free_pages} of {self.num_pages} are free; finish or preempt other "
                "sequences, or give the KV cache more pages"
            )
        new = [self._allocate() for _ in range(needed)]
        seq.table += tuple(new)
        return new

    def commit(self, seq_id: int, token_ids: Sequence[int], length: int | None = None) -> list[int]:
        """Record that KV for the first ``length`` of token_ids (default: all) is written.

        Returns pages newly registered for prefix reuse. Passing the whole token list with a
        length spares the caller a copy of a long sequence on every step.
        """
        seq = self._seq(seq_id)
        n = len(token_ids) if length is None else length
        if n > len(token_ids):
            raise TinyInferError(f"commit of {n} tokens but only {len(token_ids)} token ids were given")
        if n < seq.num_tokens:
            raise TinyInferError(
                f"commit of {n} tokens would shrink sequence {seq_id} from {seq.num_tokens}; use truncate to roll back"
            )
        if n > len(seq.table) * self.page_size:
            raise TinyInferError(
                f"sequence {seq_id} has pages for {len(seq.table) * self.page_size} tokens, not {n}; "
                f"call ensure_capacity({seq_id}, {n}) before writing its KV"
            )
        seq.num_tokens = n
        if not self.enable_prefix_caching:
            return []
        registered = []
        bs = self.page_size
        for i in range(len(seq.hashes), n // bs):
            parent = seq.hashes[-1] if seq.hashes else None
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = page_hash(parent, tokens)
            seq.hashes.append(h)
            if h not in self._by_hash:  # an identical page registered earlier keeps its place
                page = seq.table[i]
                self._by_hash[h] = page
                self._hash[page] = h
                self._content[page] = (parent, tokens)
                registered.append(page)
        return registered

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Shrink a sequence to its first num_tokens tokens (speculative rollback); returns freed pages."""
        seq = self._seq(seq_id)
        bs = self.page_size
        if not 0 <= num_tokens <= len(seq.table) * bs:
            raise TinyInferError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens; "
                f"it has pages for 0..{len(seq.table) * bs} tokens"
            )
        keep = -(-num_tokens // bs)
        if num_tokens % bs:
            # The last kept page will be overwritten from offset num_tokens % bs on.
            edge = seq.table[keep - 1]
            if self._ref[edge] > 1:
                raise TinyInferError(
                    f"cannot truncate sequence {seq_id} to {num_tokens} tokens: page {edge} is shared with "
                    "another sequence and would be overwritten; roll back only tokens this sequence wrote"
                )
            if self._hash[edge] is not None:
                self._uncache(edge)
        dropped, seq.table = seq.table[keep:], seq.table[:keep]
        seq.num_tokens = min(seq.num_tokens, num_tokens)
        del seq.hashes[seq.num_tokens // bs :]
        return [page for page in reversed(dropped) if self._release(page)]

    def free(self, seq_id: int) -> list[int]:
        """Release a finished or preempted sequence; returns the pages nobody holds any more."""
        seq = self._seq(seq_id)
        del self._seqs[seq_id]
        # Tail pages first, so they are evicted before the widely shared head pages.
        return [page for page in reversed(seq.table) if self._release(page)]

    def fork(self, parent_id: int, child_id: int) -> tuple[int, int] | None:
        """Start child_id as a copy of parent_id sharing its full pages; returns (src, dst) to copy, if any.

        The partial last page cannot be shared because both sequences will write into it,
        so the child gets a fresh page and the runner must copy the parent's into it.
        """
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise TinyInferError(f"sequence {child_id} is already in the page pool; fork into a new id")
        full, partial = divmod(parent.num_tokens, self.page_size)
        if partial and not self.can_allocate(1):
            raise OutOfPagesError(
                f"forking sequence {parent_id} needs 1 free KV page and none is free; "
                "finish or preempt other sequences, or give the KV cache more pages"
            )
        shared = parent.table[:full]
        for page in shared:
            self._hold(page)
        child = _Seq(table=shared, num_tokens=parent.num_tokens, hashes=list(parent.hashes))
        self._seqs[child_id] = child
        if not partial:
            return None
        dst = self._allocate()
        child.table += (dst,)
        return parent.table[full], dst

    # ---- queries ---------------------------------------------------------------------

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """How many new pages ensure_capacity(seq_id, num_tokens) would allocate."""
        return max(0, -(-num_tokens // self.page_size) - len(self._seq(seq_id).table))

    def can_allocate(self, num_new_pages: int) -> bool:
        """Whether num_new_pages pages can be handed out now, evicting cached pages if needed."""
        return num_new_pages <= self.num_free_pages

    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's page ids in token order (a copy)."""
        return list(self._seq(seq_id).table)

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """page_table as an immutable tuple, the pool's own: no copy, for a batch built every step."""
        return self._seq(seq_id).table

    def num_tokens(self, seq_id: int) -> int:
        """How many of the sequence's tokens have KV written, as last committed or truncated."""
        return self._seq(seq_id).num_tokens

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV slot (page_id * page_size + offset) of a token position, for the runner's slot mapping."""
        table = self._seq(seq_id).table
        page_index, offset = divmod(position, self.page_size)
        if not 0 <= position < len(table) * self.page_size:
            raise TinyInferError(
                f"position {position} of sequence {seq_id} has no KV page (pages cover "
                f"0..{len(table) * self.page_size - 1}); call ensure_capacity first"
            )
        return table[page_index] * self.page_size + offset

    def slots(self, seq_id: int, positions: np.ndarray) -> np.ndarray:
        """``slot`` of every position in ``positions`` (any shape), -1 where a position is -1
        (a row that sits out); at once, for the tables a launch stages."""
        table = np.asarray(self._seq(seq_id).table, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        bad = positions[(positions < -1) | (positions >= len(table) * self.page_size)]
        if bad.size:
            self.slot(seq_id, int(bad.flat[0]))  # raises, with one position's message
        at = np.maximum(positions, 0)
        return np.where(positions >= 0, table[at // self.page_size] * self.page_size + at % self.page_size, -1)

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages carrying a prefix hash, held or not."""
        return len(self._by_hash)

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens served from cached pages so far."""
        return self._prefix_hits

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far."""
        return self._prefix_queries

    def snapshot(self) -> PoolSnapshot:
        """Every page's owners, references and cache state, plus summary counts."""
        owners: list[list[int]] = [[] for _ in range(self.num_pages)]
        for seq_id in sorted(self._seqs):
            for page in self._seqs[seq_id].table:
                owners[page].append(seq_id)
        pages = tuple(
            PageState(page, tuple(owners[page]), self._ref[page], self._hash[page] is not None)
            for page in range(self.num_pages)
        )
        return PoolSnapshot(
            page_size=self.page_size,
            pages=pages,
            evictable=tuple(self._evictable),
            num_free=self.num_free_pages,
            num_used=self.num_used_pages,
            num_cached=self.num_cached_pages,
            prefix_hits=self._prefix_hits,
            prefix_queries=self._prefix_queries,
        )

    def check(self) -> None:
        """Verify every bookkeeping invariant; raise AssertionError naming the first one broken."""
        free, evictable = list(self._free), set(self._evictable)
        _require(len(set(free)) == len(free), f"free list has duplicates: {free}")
        holders = [0] * self.num_pages
        for seq_id, seq in self._seqs.items():
            _require(len(set(seq.table)) == len(seq.table), f"sequence {seq_id} holds a page twice: {seq.table}")
            _require(
                seq.num_tokens <= len(seq.table) * self.page_size,
                f"sequence {seq_id} has {seq.num_tokens} tokens but only {len(seq.table)} pages",
            )
            want = seq.num_tokens // self.page_size if self.enable_prefix_caching else 0
            _require(len(seq.hashes) == want, f"sequence {seq_id} has {len(seq.hashes)} page hashes, expected {want}")
            for i, page in enumerate(seq.table):
                holders[page] += 1
                h = self._hash[page]
                _require(
                    h is None or (i < len(seq.hashes) and seq.hashes[i] == h),
                    f"page {page} at index {i} of sequence {seq_id} is cached under a hash the sequence does not have",
                )
        for page in range(self.num_pages):
            states = [page in evictable, page in free, self._ref[page] > 0]
            _require(sum(states) == 1, f"page {page} is not exactly one of evictable/free/held: {states}")
            _require(holders[page] == self._ref[page], f"page {page} ref_count {self._ref[page]} != {holders[page]} holders")
            h = self._hash[page]
            _require((h is None) == (self._content[page] is None), f"page {page} has a hash without content or back")
            _require(h is None or self._by_hash.get(h) == page, f"page {page} hash {h} is not mapped back to it")
            _require(
                h is None or page_hash(*self._content[page]) == h,
                f"page {page} hash {h} does not match its stored tokens {self._content[page]}",
            )
            _require(page not in free or h is None, f"free page {page} still carries hash {h}")
            _require(page not in evictable or h is not None, f"evictable page {page} carries no hash")
        for h, page in self._by_hash.items():
            _require(self._hash[page] == h, f"hash {h} maps to page {page} whose hash is {self._hash[page]}")

    # ---- internals -------------------------------------------------------------------

    def _seq(self, seq_id: int) -> _Seq:
        """The sequence's record, or a TinyInferError saying it is unknown."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise TinyInferError(f"sequence {seq_id} is not in the page pool; add_sequence it first")
        return seq

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(page, hash) of cached pages matching the prompt's leading full pages, never its last token."""
        bs = self.page_size
        hits: list[tuple[int, int]] = []
        parent: int | None = None
        # (len - 1) // bs full pages at most: the model must compute the last prompt position.
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = page_hash(parent, tokens)
            page = self._by_hash.get(h)
            if page is None or self._content[page] != (parent, tokens):
                break
            hits.append((page, h))
            parent = h
        return hits

    def _hold(self, page: int) -> None:
        """Add a reference; a cached page nobody held leaves the evictable set."""
        if self._ref[page] == 0:
            del self._evictable[page]
        self._ref[page] += 1

    def _release(self, page: int) -> bool:
        """Drop a reference; returns True when nobody holds the page any more."""
        self._ref[page] -= 1
        if self._ref[page] > 0:
            return False
        if self._hash[page] is None:
            self._free.append(page)
        else:
            self._evictable[page] = None
        return True

    def _allocate(self) -> int:
        """Take a never-cached free page, else evict the least recently released cached page."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            self._uncache(page)
        self._ref[page] = 1
        return page

    def _uncache(self, page: int) -> None:
        """Forget a page's prefix hash so it can no longer be hit."""
        del self._by_hash[self._hash[page]]
        self._hash[page] = None
        self._content[page] = None


def _require(condition: bool, message: str) -> None:
    """Raise AssertionError with message unless condition holds (unlike assert, survives python -O)."""
    if not condition:
        raise AssertionError(message)
