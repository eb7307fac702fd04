"""CUDA graphs of decode steps: one per padded batch size, over one KV cache.

At batch 1 a decode step is a few hundred small kernels; launching them one by one from
Python costs more than running them. A CUDA graph records the whole step once and replays it
with one launch. A graph replays fixed addresses, so every input lives in one static device
buffer: each step writes the batch into a pinned host copy, sends it in one transfer, replays
the graph for the next padded batch size (1, 2, 4, 8, ...) and reads the logits back.
Padding rows decode token 0 at position 0 into the cache's scratch page, so they disturb
nothing; their logits are dropped.

A step may feed q tokens per sequence, every sequence the same q: q = 1 is plain decoding,
q = k + 1 verifies k drafted tokens (or feeds a draft model the last accepted token and the
target's bonus token). Each q has its own ``DecodeGraphs``.

Greedy drafting captures more than a step: with ``rounds`` = n, the graph holds the step and
then n one-token rounds, each fed every sequence's argmax of the one before inside the graph
(the runner's ``launch_rounds``), so a draft model's k guesses cost one replay. Where each
round's token goes is known before the first runs (one more position a round), so the host
stages every round's positions and slots with the step's; only the tokens are the device's.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor

from tinyinfer.runners.runner import Batch, Rounds

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecodeGraphs:
    """Captured decode steps of q tokens per sequence for one KV cache, and the static buffers
    they read and write.

    ``step(token_ids, positions, slots, page_tables)`` must run a whole step on device tensors
    ([b q], [b q], [b q], [b, W]) and return float32 logits [b q, V]. With ``rounds`` = n > 0
    it takes each round's positions and slots too ([n, b], [n, b]) and returns the argmaxes
    [b, n + 1] of each sequence's last row and of every round.
    """

    def __init__(self, step: Callable[..., Tensor],
                 max_batch: int, table_width: int, scratch_page: int, page_size: int,
                 device: torch.device, tokens_per_seq: int = 1, rounds: int = 0):
        self.step = step
        self.q = tokens_per_seq
        self.rounds = rounds
        self.sizes = [s for s in GRAPH_BATCH_SIZES if s <= max_batch]
        self.max_batch = self.sizes[-1]
        self.table_width = table_width
        self.scratch_slot = scratch_page * page_size
        self.scratch_page = scratch_page
        # One int64 buffer: token ids, positions, slots (max_batch q each), the rounds' positions
        # and slots (rounds x max_batch each), then page tables.
        self.tables_at = 3 * self.max_batch * self.q + 2 * rounds * self.max_batch
        size = self.tables_at + self.max_batch * table_width
        # Two pinned staging buffers, used in turn: with steps queued ahead (asynchronous
        # scheduling) the host writes one while the other's copy may still wait on the device.
        # (Pinned on CUDA only: elsewhere the staging runs, for tests, but nothing captures.)
        pinned = device.type == "cuda"
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.copied: list[Any] = [None, None]  # per buffer, an event after its last copy
        self.host_views: dict[tuple[int, int], tuple[Any, ...]] = {}  # (buffer, size) -> _views
        self.turn = 0
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.timers: dict[int, Any] = {}  # per size, timers the runner recorded into the graph
        self.pool = None

    def release(self) -> None:
        """Free every captured graph and its memory pool now (they are captured again if run)."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.timers.clear()
        self.pool = None

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds the batch, or None if none does."""
        return next((s for s in self.sizes if s >= batch_size), None)

    def _views(self, buffer: Any, size: int) -> tuple[Any, ...]:
        """(token_ids [size q], positions [size q], slots [size q], page_tables [size, W]) of a
        buffer (the device tensor or the host array); with rounds, then (positions [n, size],
        slots [n, size]) of the rounds."""
        mb, rows = self.max_batch * self.q, size * self.q
        tables = buffer[self.tables_at:].reshape(self.max_batch, self.table_width)
        views = (buffer[:rows], buffer[mb:mb + rows], buffer[2 * mb:2 * mb + rows], tables[:size])
        if not self.rounds:
            return views
        ahead = buffer[3 * mb:self.tables_at].reshape(2, self.rounds, self.max_batch)
        return (*views, ahead[0, :, :size], ahead[1, :, :size])

    def _stage(self, batch: Batch, size: int, rounds: Rounds | None, turn: int) -> int:
        """Write the batch (and its rounds), padded to `size` rows, into pinned buffer ``turn``;
        return elements used. Padding rows, and rounds a sequence sits out, decode
        token 0 (or what the round before chose) at position 0 into the scratch page."""
        n = batch.num_tokens  # num_seqs q rows
        views = self.host_views.get((turn, size))
        if views is None:  # made once per buffer and size: slicing costs host time every step
            views = self.host_views[(turn, size)] = self._views(self.hosts[turn].numpy(), size)
        tokens, positions, slots, tables = views[:4]
        tokens[:n], positions[:n], slots[:n] = batch.token_ids, batch.positions, batch.slot_mapping
        tokens[n:], positions[n:], slots[n:] = 0, 0, self.scratch_slot
        for row, table in enumerate(batch.page_tables):
            tables[row, :len(table)] = table
        tables[batch.num_seqs:, 0] = self.scratch_page
        if rounds is not None:
            ahead_positions, ahead_slots = views[4:]
            staged = rounds.staged(self.scratch_slot)
            ahead_positions[:, :batch.num_seqs], ahead_slots[:, :batch.num_seqs] = staged
            ahead_positions[:, batch.num_seqs:], ahead_slots[:, batch.num_seqs:] = 0, self.scratch_slot
        return self.tables_at + size * self.table_width

    def run(self, batch: Batch, size: int, tokens: Tensor | None = None,
            rounds: Rounds | None = None, chosen: ChosenInputs | None = None) -> Tensor:
        """Decode one batch through the graph for `size` rows (captured first if new); ``tokens``
        [B q] on the device, if given, replace the batch's token ids; ``rounds`` (a graph with
        rounds) where each round's token goes; ``chosen`` (a graph with rounds), if given, the
        step's token ids, positions and slots [B q] and the rounds' positions and slots [n, B]
        as the device chose them (``launch_rounds_after``), in place of the staged ones.

        Returns the graph's own output buffer on the device, valid until the next replay: logits
        [B q, V], or with rounds the argmaxes [B, n + 1].
        """
        turn, self.turn = self.turn, self.turn ^ 1
        host = self.hosts[turn]
        copied = self.copied[turn]
        if copied is None:  # one event per buffer, recorded again at each use (no new one per step)
            copied = self.copied[turn] = torch.cuda.Event()
        else:
            copied.synchronize()  # its copy of two launches ago has long landed
        used = self._stage(batch, size, rounds, turn)
        self.inputs[:used].copy_(host[:used], non_blocking=True)
        copied.record()
        if tokens is not None:
            self._views(self.inputs, size)[0][:batch.num_tokens].copy_(tokens)
        if chosen is not None:
            assert self.rounds, "chosen inputs are a rounds graph's"
            tokens_in, positions_in, slots_in, _, round_positions_in, round_slots_in = self._views(self.inputs, size)
            rows, seqs, n = batch.num_tokens, batch.num_seqs, chosen.round_positions.shape[0]
            tokens_in[:rows].copy_(chosen.tokens)
            positions_in[:rows].copy_(chosen.positions)
            slots_in[:rows].copy_(chosen.slots)
            round_positions_in[:n, :seqs].copy_(chosen.round_positions)
            round_slots_in[:n, :seqs].copy_(chosen.round_slots)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:batch.num_seqs if self.rounds else batch.num_tokens]

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up (compiling if asked) on a side stream, then record the step for `size` rows.

        The warm-up runs on the staged real batch: a decode step rewrites its own token's K/V
        with the same values, so running it again changes nothing (greedy rounds too: each
        round's token is the same argmax again).
        """
        per_seq = "" if self.q == 1 else f" x {self.q} tokens"
        then = f", then {self.rounds} greedy rounds" if self.rounds else ""
        print(f"tinyinfer: capturing a CUDA graph for decode batches of {size}{per_seq}{then} "
              "(once per batch size)", file=sys.stderr, flush=True)
        views = self._views(self.inputs, size)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(*views)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(graph, pool=self.pool):
            out = self.step(*views)
        self.pool = graph.pool()
        return graph, out


class ChosenInputs(NamedTuple):
    """A rounds graph's inputs as the device chose them (``torch_fast.choose_after``): the
    step's token ids, positions and slots [B q], and the rounds' positions and slots [n, B]."""

    tokens: Tensor
    positions: Tensor
    slots: Tensor
    round_positions: Tensor
    round_slots: Tensor


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside: while a stream captures, CUDA refuses to destroy a graph, and
    a collection may destroy one (a dropped cache's graphs wait in a reference cycle: each
    graph's step refers to the cache that holds it), which fails the capture. torch collects
    before a capture only on request (torch.compiler.config.force_cudagraph_gc)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
