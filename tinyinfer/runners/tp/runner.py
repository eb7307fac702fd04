"""Driving a tensor-parallel model: the runner on rank 0, and the loop every other rank runs.

The engine, scheduler and page bookkeeping exist once, in the user's process (rank 0). Its
``TensorParallelRunner`` implements the ``ModelRunner`` protocol: for every call it first
sends a ``Command`` (the step's ``Batch``, a new KV cache, a page copy) down a pipe to each
worker, then does its own share. Workers wait in ``serve_worker`` and do the same share on
their shard, then send back their timing. Tensors — the all-reduces, the logits gather —
travel over the default group: NCCL on GPUs, gloo on CPU. (A pipe carries a small pickled
command in well under a millisecond; the gloo group used before cost about 2 ms per step on
the GPU host: a TP=2 step of the bundled model took 3.3 ms, of which each rank's own work ~1 ms.)
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.runners.runner import Batch, Feed, RankTiming, RunnerInfo, TopFuture, TopLogits, fed_batch
from tinyinfer.runners.torch_fast import TorchKVCache
from tinyinfer.runners.tp.shard import ShardRunner


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every worker; ``drop`` lists KV caches rank 0 no longer holds."""

    kind: str  # "new_kv", "copy_page", "forward" or "shutdown"
    kv_id: int = -1
    args: tuple[int, ...] = ()  # new_kv: (pages, page size); copy_page: (src, dst); forward: (top k,) or ()
    batch: Batch | None = None
    drop: tuple[int, ...] = ()


@dataclass
class TensorParallelKVCache:
    """Rank 0's handle on one KV cache: its own shard of the pages; each worker holds the rest."""

    kv_id: int
    local: TorchKVCache  # k, v: [L, P + 1, S, Hkv / N, hd], this rank's KV heads only
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.local.num_pages


def serve_worker(shard: ShardRunner, conn: Connection) -> bool:
    """A worker's life: run every command rank 0 sends, until "shutdown"; answer each step's
    timing. True after a shutdown, False if rank 0's end closed without one (it died)."""
    caches: dict[int, TorchKVCache] = {}
    while True:
        try:
            command: Command = conn.recv()
        except (EOFError, OSError):
            return False
        for kv_id in command.drop:
            _release(caches.pop(kv_id, None))
        if command.kind == "shutdown":
            for cache in caches.values():
                _release(cache)
            return True
        if command.kind == "new_kv":
            caches[command.kv_id] = shard.new_kv_cache(*command.args)
        elif command.kind == "copy_page":
            shard.copy_page(caches[command.kv_id], *command.args)
        elif command.kind == "forward" and command.batch is not None:
            top_k = command.args[0] if command.args else None
            _, timing = shard.run_step(command.batch, caches[command.kv_id], top_k)
            conn.send(timing)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command.kind!r}")


def _release(cache: TorchKVCache | None) -> None:
    """Free a cache's CUDA graphs now: NCCL cannot tear a communicator down under live graphs."""
    if cache is not None and cache.graphs is not None:
        for graphs in cache.graphs.values():  # one set per tokens per sequence
            graphs.release()
        cache.graphs = None


@dataclass
class TensorParallelRunner:
    """The ModelRunner the engine sees: rank 0's shard plus the workers it commands."""

    shard: ShardRunner
    conns: list[Connection]  # one pipe to each worker, rank 1 first
    workers_alive: Callable[[], bool]  # False once any worker process has died
    on_close: Callable[..., None]  # (abort=) stops the workers and tears the process group down
    name: str = "torch"
    last_timings: tuple[RankTiming, ...] = ()  # per rank, the last forward step
    capture_attention: bool = False  # the shards keep no attention weights: last_attention stays empty
    last_attention: list[list[np.ndarray]] = field(default_factory=list)
    _kv_ids: Any = field(default_factory=itertools.count, repr=False)
    _dropped: deque[tuple[int, TorchKVCache]] = field(default_factory=deque, repr=False)
    _closed: bool = False
    _broken: bool = False  # a step failed part-way: the ranks may be out of step

    @property
    def config(self) -> ModelConfig:
        return self.shard.full_config

    @property
    def info(self) -> RunnerInfo:
        """Rank 0's shard's: its dtype, device and weights, and every rank's share."""
        return self.shard.info

    def describe(self) -> dict[str, Any]:
        """The shard runner's choices, plus how many ranks share the model."""
        return {**self.shard.describe(), "tensor_parallel": self.shard.world}

    # ------------------------------------------------------------------ protocol

    def new_kv_cache(self, num_pages: int, page_size: int) -> TensorParallelKVCache:
        """Every rank allocates its KV heads' share of ``num_pages`` pages."""
        kv_id = next(self._kv_ids)
        self._send(Command("new_kv", kv_id, (num_pages, page_size)))
        local = self.shard.new_kv_cache(num_pages, page_size)
        handle = TensorParallelKVCache(kv_id, local, page_size)
        # Once the engine drops this handle, the next command frees our graphs of it (they and
        # the cache form a reference cycle) and tells the workers to free their shards.
        weakref.finalize(handle, self._dropped.append, (kv_id, local))
        return handle

    def copy_page(self, kv_cache: TensorParallelKVCache, src: int, dst: int) -> None:
        self._send(Command("copy_page", kv_cache.kv_id, (src, dst)))
        self.shard.copy_page(kv_cache.local, src, dst)

    def forward(self, batch: Batch, kv_cache: TensorParallelKVCache) -> np.ndarray:
        """Run one batch on every rank; return float32 logits [R, V] gathered on rank 0."""
        logits = self._step(batch, kv_cache, None)
        assert isinstance(logits, Tensor)
        return logits.cpu().numpy()

    def forward_top(self, batch: Batch, kv_cache: TensorParallelKVCache, k: int) -> TopLogits:
        """The same step, each rank reducing its vocabulary slice to top k before the gather."""
        top = self._step(batch, kv_cache, k)
        assert isinstance(top, TopLogits)
        return top

    def launch_top(self, batch: Batch, kv_cache: TensorParallelKVCache, k: int,
                   feed: Feed | None = None) -> TopFuture:
        """forward_top, computed now: every rank answers before the step returns."""
        return TopFuture.done(self.forward_top(fed_batch(batch, feed), kv_cache, k))

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Tell the workers to stop and release the process group; safe to call twice.

        Every rank frees its CUDA graphs first (they hold the communicator), then all leave the
        group at once; after a step cut short (an error, Ctrl-C) the group is aborted instead
        and workers that do not exit within seconds are killed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)  # the launcher registered it; nothing is left to do at exit
        self.shard.release_graphs()
        try:
            for conn in self.conns:
                try:
                    conn.send(Command("shutdown"))
                except OSError:  # that worker has died: the others still get theirs
                    pass
        finally:
            self.on_close(abort=self._broken, timeout=5.0 if self._broken else 30.0)

    # ------------------------------------------------------------------ inside

    def _step(self, batch: Batch, kv: TensorParallelKVCache, top_k: int | None) -> Tensor | TopLogits:
        self._send(Command("forward", kv.kv_id, () if top_k is None else (top_k,), batch))
        try:
            with torch.no_grad():
                result, timing = self.shard.run_step(batch, kv.local, top_k)
            self.last_timings = (timing, *(conn.recv() for conn in self.conns))
        except BaseException as exc:  # the ranks may now disagree on where they are
            self._broken = True
            if isinstance(exc, Exception):
                raise TinyInferError(f"a tensor-parallel step failed part-way ({type(exc).__name__}: "
                                     f"{exc}); close() this model and load it again") from exc
            raise
        assert result is not None
        return result

    def _send(self, command: Command) -> None:
        if self._closed:
            raise TinyInferError("this tensor-parallel model was closed: load it again")
        if self._broken:
            raise TinyInferError("an earlier tensor-parallel step failed part-way, so the ranks "
                                 "may be out of step: close() this model and load it again")
        if not self.workers_alive():
            raise TinyInferError("a tensor-parallel worker process has stopped (see its error "
                                 "above): close() this model and load it again")
        drop = []
        while self._dropped:  # popleft is atomic: a finalizer may append while we drain
            kv_id, local = self._dropped.popleft()
            _release(local)
            drop.append(kv_id)
        # Pickled once for all workers (what Connection.send does per call; a decode step's
        # command takes tens of microseconds to pickle, and the last worker starts that much later)
        data = ForkingPickler.dumps(Command(command.kind, command.kv_id, command.args, command.batch,
                                            tuple(drop)))
        for conn in self.conns:
            conn.send_bytes(data)
