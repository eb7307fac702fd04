"""Lesson 08 solution (for teachers): chained page keys and prefix reuse."""

from __future__ import annotations


def page_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """An integer key for one full page that also stands for every page before it."""
    return hash((parent, tuple(tokens)))


def prefix_keys(token_ids: list[int], page_size: int) -> list[int]:
    """Chained keys of the full pages of a sequence."""
    keys: list[int] = []
    for i in range(len(token_ids) // page_size):
        page = tuple(token_ids[i * page_size:(i + 1) * page_size])
        keys.append(page_key(keys[-1] if keys else None, page))
    return keys


def reusable_tokens(token_ids: list[int], cached: set[int], page_size: int) -> int:
    """How many leading tokens of a new prompt already have K/V in the cache."""
    usable = (len(token_ids) - 1) // page_size  # pages that end before the last token
    hits = 0
    for key in prefix_keys(token_ids, page_size)[:usable]:
        if key not in cached:
            break
        hits += 1
    return hits * page_size
