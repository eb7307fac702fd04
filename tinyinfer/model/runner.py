"""What every model runner takes and returns: one mixed batch per step.

A step may hold several sequences at once, some prefilling a chunk of their prompt and some
decoding one token. All their new tokens are packed into one flat list; ``query_starts``
says where each sequence's tokens begin. K and V of the new tokens are written to the paged
cache at ``slot_mapping`` (slot = page_id * block_size + offset); each sequence then attends
over its whole context, gathered through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tinyinfer.config import ModelConfig


@dataclass(frozen=True)
class Batch:
    """The tokens one forward pass computes, and where their K/V live."""

    token_ids: np.ndarray  # [T] int64, the new tokens of every sequence, packed
    positions: np.ndarray  # [T] int64, each token's position in its sequence
    query_starts: np.ndarray  # [B + 1] int64, sequence b owns token rows [qs[b], qs[b+1])
    context_lens: np.ndarray  # [B] int64, tokens in each sequence's KV after this step
    block_tables: tuple[tuple[int, ...], ...]  # [B][pages] page ids, in order
    slot_mapping: np.ndarray  # [T] int64, cache slot each new token's K/V is written to
    logits_rows: np.ndarray  # [R] int64, rows of T whose next-token logits are wanted

    @property
    def num_seqs(self) -> int:
        return len(self.block_tables)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def make_batch(
    seqs: list[tuple[list[int], int, list[int], bool]], block_size: int,
) -> Batch:
    """Pack sequences into a Batch.

    Each entry is ``(new_token_ids, start_position, block_table, all_logits)``: the tokens to
    compute, the position of the first one, the sequence's pages, and whether logits are wanted
    for every new token (verification, full-sequence scoring) or only the last.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens = []
    logits_rows: list[int] = []
    for new_tokens, start, table, all_logits in seqs:
        n = len(new_tokens)
        first_row = len(token_ids)
        token_ids.extend(new_tokens)
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts.append(len(token_ids))
        context_lens.append(start + n)
        logits_rows.extend(range(first_row, first_row + n) if all_logits else [first_row + n - 1])
    as_i64 = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return Batch(
        token_ids=as_i64(token_ids),
        positions=as_i64(positions),
        query_starts=as_i64(starts),
        context_lens=as_i64(context_lens),
        block_tables=tuple(tuple(t) for _, _, t, _ in seqs),
        slot_mapping=as_i64(slots),
        logits_rows=as_i64(logits_rows),
    )


@dataclass(frozen=True)
class TopLogits:
    """The k largest logits of each row and each row's log-sum-exp: all greedy decoding needs.

    A runner on a GPU can reduce [R, V] logits to this on the device, so that a large
    vocabulary never crosses to the host (see ``forward_top``).
    """

    ids: np.ndarray  # [R, k] int64, most likely first
    values: np.ndarray  # [R, k] float32 raw logits
    logsumexp: np.ndarray  # [R] float32


class ModelRunner(Protocol):
    """The interface both runners implement; the engine only ever talks to this."""

    config: ModelConfig
    name: str  # "numpy" or "torch"

    def new_kv_cache(self, num_pages: int, block_size: int) -> Any:
        """Allocate K/V storage for ``num_pages`` pages of ``block_size`` tokens each."""

    def forward(self, batch: Batch, kv_cache: Any) -> np.ndarray:
        """Run one batch; write its K/V into ``kv_cache``; return float32 logits [R, vocab]."""

    def copy_page(self, kv_cache: Any, src: int, dst: int) -> None:
        """Copy one page's K/V (all layers), for sequences forked from a shared prefix."""

    # Optional: ``forward_top(batch, kv_cache, k) -> TopLogits`` — the same forward pass, with
    # logits reduced to their top k per row. The engine uses it when every row is plain greedy.
