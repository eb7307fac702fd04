"""Lesson 06 exercise: a KV page allocator, and how much memory each way of reserving wastes.

Fill in every body, then run `tinyinfer lesson check 06`.
"""

from __future__ import annotations

from tinyinfer.errors import OutOfPagesError


class PageAllocator:
    """Hands out fixed-size KV pages; a sequence's page table lists its pages in token order.

    Token position p of a sequence lives in page page_table[p // page_size], at offset
    p % page_size. Pages need not be contiguous, or in any order.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        """A pool of num_pages pages of page_size token slots each, all free."""
        raise NotImplementedError

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq_id's page table (new sequences start empty) to cover num_tokens tokens.

        Returns the newly added pages (none if it already covers them). All or nothing: if
        too few pages are free, raise OutOfPagesError and change nothing.
        """
        raise NotImplementedError

    def free(self, seq_id: int) -> None:
        """Give all of seq_id's pages back to the pool and forget the sequence."""
        raise NotImplementedError

    def page_table(self, seq_id: int) -> list[int]:
        """seq_id's pages, in token order (a copy the caller may keep)."""
        raise NotImplementedError

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV slot of a token: page_id * page_size + offset. The runner writes K/V there."""
        raise NotImplementedError

    @property
    def num_free(self) -> int:
        """Pages no sequence holds."""
        raise NotImplementedError


def paged_waste(lengths: list[int], page_size: int) -> float:
    """Share of allocated slots that hold no token when each sequence holds just enough pages."""
    raise NotImplementedError


def contiguous_waste(lengths: list[int], max_len: int) -> float:
    """Share of reserved slots that hold no token when each sequence reserves max_len slots up front."""
    raise NotImplementedError
