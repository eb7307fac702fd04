"""Lesson 08 exercise: chained page keys, and how much of a new prompt the cache already holds.

Fill in every body, then run `tinyinfer lesson check 08`.
"""

from __future__ import annotations


def page_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """An integer key for one full page that also stands for every page before it.

    parent is the previous page's key (None for the first page). Equal (parent, tokens) must
    give equal keys, and a different parent or different tokens a different key:
    Python's hash() of a tuple of the two does this (for ints it is the same in every run).
    """
    raise NotImplementedError


def prefix_keys(token_ids: list[int], page_size: int) -> list[int]:
    """Chained keys of the full pages of a sequence: key i = page_key(key i-1, tokens of page i).

    Page i holds token_ids[i * page_size:(i + 1) * page_size]; a partly filled last page
    gets no key (its tokens are still changing).
    """
    raise NotImplementedError


def reusable_tokens(token_ids: list[int], cached: set[int], page_size: int) -> int:
    """How many leading tokens of a new prompt already have K/V in the cache.

    Walk the prompt's chained page keys from the first page; stop at the first key not in
    cached. Only pages that end before the prompt's last token count: the engine must still
    compute the last token to get the logits of the first output token.
    """
    raise NotImplementedError
