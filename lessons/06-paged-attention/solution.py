"""Lesson 06 solution (for teachers): a KV page allocator and the two waste formulas."""

from __future__ import annotations

from collections import deque

from tinyinfer.errors import OutOfPagesError


class PageAllocator:
    """Hands out fixed-size KV pages; a sequence's page table lists its pages in token order."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        """A pool of num_pages pages of page_size token slots each, all free."""
        self.page_size = page_size
        self.free_pages: deque[int] = deque(range(num_pages))
        self.tables: dict[int, list[int]] = {}

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow seq_id's page table to cover num_tokens tokens; all or nothing."""
        table = self.tables.setdefault(seq_id, [])
        needed = max(0, -(-num_tokens // self.page_size) - len(table))
        if needed > len(self.free_pages):
            if not table:
                del self.tables[seq_id]
            raise OutOfPagesError(f"sequence {seq_id} needs {needed} pages, {len(self.free_pages)} are free")
        new = [self.free_pages.popleft() for _ in range(needed)]
        table.extend(new)
        return new

    def free(self, seq_id: int) -> None:
        """Give all of seq_id's pages back to the pool and forget the sequence."""
        self.free_pages.extend(self.tables.pop(seq_id))

    def page_table(self, seq_id: int) -> list[int]:
        """seq_id's pages, in token order."""
        return list(self.tables[seq_id])

    def slot(self, seq_id: int, position: int) -> int:
        """Flat KV slot of a token: page_id * page_size + offset."""
        page, offset = divmod(position, self.page_size)
        return self.tables[seq_id][page] * self.page_size + offset

    @property
    def num_free(self) -> int:
        """Pages no sequence holds."""
        return len(self.free_pages)


def paged_waste(lengths: list[int], page_size: int) -> float:
    """Share of allocated slots that hold no token when each sequence holds just enough pages."""
    allocated = sum(-(-n // page_size) * page_size for n in lengths)
    return 1 - sum(lengths) / allocated


def contiguous_waste(lengths: list[int], max_len: int) -> float:
    """Share of reserved slots that hold no token when each sequence reserves max_len slots."""
    return 1 - sum(lengths) / (max_len * len(lengths))
