"""Driving a tensor-parallel model: the runner on rank 0, and the loop every other rank runs.

The engine, scheduler and page bookkeeping exist once, in the user's process (rank 0). Its
``TensorParallelRunner`` implements the ``ModelRunner`` protocol: for every call it first
sends a ``Command`` (the step's ``Batch``, a new KV cache, a page copy) down a pipe to each
worker, then does its own share. Workers wait in ``serve_worker`` and do the same share on
their shard, then send back their timing. Tensors — the all-reduces, the logits gather —
travel over the default group: NCCL on GPUs, gloo on CPU.

A greedy step (``launch_top``) is queued, not waited for: rank 0 reads its result, and the
workers' timings, when the engine asks. Every rank holds the whole step's logits after the
gather and reduces them as rank 0 does, so a step fed from the one before (asynchronous
scheduling) takes its input tokens on every rank's own device; on a GPU each worker reports
its timing from a thread, so that its next step queues behind the one still running. (A pipe carries a small pickled
command in well under a millisecond; the gloo group used before cost about 2 ms per step on
the GPU host: a TP=2 step of the bundled model took 3.3 ms, of which each rank's own work ~1 ms.)
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import threading
import time
import traceback
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from queue import Queue
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.runners.runner import (
    AfterVerification,
    Batch,
    Feed,
    RankTiming,
    Rounds,
    RunnerInfo,
    TokensFuture,
    TopFuture,
    TopLogits,
    fed_batch,
    launch_rounds_after_stepwise,
    launch_rounds_stepwise,
)
from tinyinfer.runners.torch_fast import TorchKVCache, argmax_rows
from tinyinfer.runners.tp.shard import ShardRunner


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every worker; ``drop`` lists KV caches rank 0 no longer holds."""

    kind: str  # "new_kv", "copy_page", "forward" or "shutdown"
    kv_id: int = -1
    args: tuple[int, ...] = ()  # new_kv: (pages, page size); copy_page: (src, dst); forward: (top k,) or ()
    batch: Batch | None = None
    drop: tuple[int, ...] = ()
    # forward: None, or the batch's token ids are placeholders and token i is row fed[i] of the
    # argmax of this rank's last top-k step (a Feed)
    fed: np.ndarray | None = None


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
    argmax: Tensor | None = None  # [R] of the last top-k step: where fed tokens come from
    reporter = _Reporter(shard, conn)
    try:
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
                started = time.perf_counter()
                tokens = None
                if command.fed is not None:
                    if argmax is None:
                        raise RuntimeError("a fed tensor-parallel step with no top-k step before it")
                    tokens = argmax_rows(argmax, command.fed)
                if shard.captures_graph(command.batch, caches[command.kv_id]):
                    reporter.drain()  # no CUDA call from another thread while a graph is captured
                with torch.no_grad():
                    logits = shard.launch_logits(command.batch, caches[command.kv_id], tokens)
                    if command.args:
                        argmax = shard.top_argmax(logits, command.args[0])
                reporter.after_step(shard.finish_timing(started))
            else:
                raise RuntimeError(f"unknown tensor-parallel command {command.kind!r}")
    finally:
        reporter.close()


class _Reporter:
    """Sends each step's RankTiming up the pipe once the step has finished on the device.

    On a GPU (collectives untimed) a thread waits for the step, so the worker meanwhile takes
    the next command and queues it behind; on the CPU, or when a replayed graph's timers must
    be read before the next replay records them again, the worker itself waits."""

    def __init__(self, shard: ShardRunner, conn: Connection):
        self.shard, self.conn = shard, conn
        self.queue: Queue[tuple[Any, Callable[[], RankTiming]] | None] | None = None
        if shard.device.type == "cuda" and not shard.clock.enabled:
            self.queue = Queue()
            self.thread = threading.Thread(target=self._run, name="tinyinfer-tp-timings", daemon=True)
            self.thread.start()

    def after_step(self, timing: Callable[[], RankTiming]) -> None:
        if self.queue is None:
            if self.shard.device.type == "cuda":
                torch.cuda.synchronize(self.shard.device)
            self.conn.send(timing())
            return
        done = torch.cuda.Event()
        done.record()
        self.queue.put((done, timing))

    def _run(self) -> None:
        assert self.queue is not None
        try:
            while (item := self.queue.get()) is not None:
                done, timing = item
                done.synchronize()
                self.conn.send(timing())
                self.queue.task_done()
        except OSError:  # rank 0's end has closed: the worker's loop sees it too
            return
        except Exception:  # the step failed on the device: end the worker, rank 0 sees EOF
            traceback.print_exc()
            os._exit(1)

    def drain(self) -> None:
        """Return once every step handed over so far has been reported."""
        if self.queue is None:
            return
        with self.queue.all_tasks_done:  # Queue.join, unless the thread has ended
            while self.queue.unfinished_tasks and self.thread.is_alive():
                self.queue.all_tasks_done.wait(0.1)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.put(None)
            self.thread.join()


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
    _last_top: TopFuture | None = field(default=None, repr=False)  # the last launch_top: what a Feed may name
    _launches: Any = field(default_factory=itertools.count, repr=False)
    _owed: deque[int] = field(default_factory=deque, repr=False)  # launches whose timings are unread

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
        self._send(Command("forward", kv_cache.kv_id, (), batch))
        self._last_top = None
        with self._step_guard():
            started = time.perf_counter()
            logits = self.shard.launch_logits(batch, kv_cache.local)
            timing = self.shard.finish_timing(started)
            host = logits.cpu().numpy()  # waits for the step
            self._collect(self._owe(), timing())
        return host

    def forward_top(self, batch: Batch, kv_cache: TensorParallelKVCache, k: int) -> TopLogits:
        """The same step reduced to top k on the device (``launch_top``, waited for)."""
        return self.launch_top(batch, kv_cache, k).result()

    def launch_top(self, batch: Batch, kv_cache: TensorParallelKVCache, k: int,
                   feed: Feed | None = None) -> TopFuture:
        """forward_top queued on every rank (CUDA: returns before the step has run). A Feed from
        this runner's last top-k launch stays on the devices: each rank takes the tokens from its
        own argmax of that step. With ``time_collectives`` the step is waited for at once (the
        timers a graph holds are recorded again by its next replay)."""
        if feed is not None and (feed.source is not self._last_top or (feed.rows < 0).any()):
            batch, feed = fed_batch(batch, feed), None  # another source, or own tokens too: via the host
        fed = None if feed is None else np.ascontiguousarray(feed.rows, dtype=np.int64)
        self._send(Command("forward", kv_cache.kv_id, (k,), batch, fed=fed))
        with self._step_guard():
            started = time.perf_counter()
            inner = self.shard.launch_top(batch, kv_cache.local, k, feed)
            timing = self.shard.finish_timing(started)
        launch = self._owe()

        def wait() -> TopLogits:
            with self._step_guard():
                top = inner.result()
                self._collect(launch, timing())
            return top

        future = TopFuture(inner.argmax, wait, lambda: inner.device_seconds)
        self._last_top = future
        if self.shard.clock.enabled:
            future.result()
        return future

    def launch_rounds(self, batch: Batch, kv_cache: TensorParallelKVCache, rounds: Rounds) -> TokensFuture:
        """One ``launch_top`` per round (each a command to every rank), fed from the one before."""
        return launch_rounds_stepwise(self, batch, kv_cache, rounds)

    def launch_rounds_after(self, kv_cache: TensorParallelKVCache, after: AfterVerification) -> TokensFuture:
        """The rule: a ``launch_rounds`` once the verification is read."""
        return launch_rounds_after_stepwise(self, kv_cache, after)

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

    @contextmanager
    def _step_guard(self) -> Iterator[None]:
        """A step that fails part-way leaves the ranks out of step: mark the runner broken."""
        try:
            yield
        except BaseException as exc:  # the ranks may now disagree on where they are
            self._broken = True
            if isinstance(exc, Exception):
                raise TinyInferError(f"a tensor-parallel step failed part-way ({type(exc).__name__}: "
                                     f"{exc}); close() this model and load it again") from exc
            raise

    def _owe(self) -> int:
        """Number a launched step whose workers' timings are still on their way up the pipes."""
        launch = next(self._launches)
        self._owed.append(launch)
        return launch

    def _collect(self, launch: int, own: RankTiming) -> None:
        """Read every worker's timings up to step ``launch`` (earlier ones no one waited for
        are dropped); ``last_timings`` = rank 0's and theirs of that step. Futures are waited
        for in launch order (the engine's overlap and the draft rounds do): one waited for after
        a later one finds its workers' timings read and dropped, and reports rank 0's only."""
        workers: tuple[RankTiming, ...] = ()
        while self._owed and self._owed[0] <= launch:
            self._owed.popleft()
            workers = tuple(conn.recv() for conn in self.conns)
        self.last_timings = (own, *workers)

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
        data = ForkingPickler.dumps(dataclasses.replace(command, drop=tuple(drop)))
        for conn in self.conns:
            conn.send_bytes(data)
