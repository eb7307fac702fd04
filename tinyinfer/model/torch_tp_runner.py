"""Driving a tensor-parallel model: the runner on rank 0, and the loop every other rank runs.

The engine, scheduler and page bookkeeping exist once, in the user's process (rank 0). Its
``TensorParallelRunner`` implements the ``ModelRunner`` protocol: for every call it first
broadcasts a ``Command`` (the step's ``Batch``, a new KV cache, a page copy) to the workers
over a CPU (gloo) group, then does its own share. Workers wait in ``serve_worker`` and do the
same share on their shard. Tensors — the all-reduces, the logits gather — travel over the
default group: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.model.runner import Batch, TopLogits
from tinyinfer.model.torch_fast import TorchKVCache
from tinyinfer.model.torch_tp import RankTiming, ShardRunner


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every worker; ``drop`` lists KV caches rank 0 no longer holds."""

    kind: str  # "new_kv", "copy_page", "forward" or "shutdown"
    kv_id: int = -1
    args: tuple[int, ...] = ()  # new_kv: (pages, block size); copy_page: (src, dst); forward: (top k,) or ()
    batch: Batch | None = None
    drop: tuple[int, ...] = ()


@dataclass
class TensorParallelKVCache:
    """Rank 0's handle on one KV cache: its own shard of the pages; each worker holds the rest."""

    kv_id: int
    local: TorchKVCache  # k, v: [L, P + 1, S, Hkv / N, hd], this rank's KV heads only
    block_size: int

    @property
    def num_pages(self) -> int:
        return self.local.num_pages


def broadcast_command(command: Command | None, group: Any) -> Command:
    """Rank 0 sends a command (pickled, over the CPU group); workers pass None and receive it."""
    box = [command]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def exchange_timings(timing: RankTiming, world: int, group: Any) -> tuple[RankTiming, ...] | None:
    """Every rank's timing of the step, collected on rank 0 (None elsewhere)."""
    mine = torch.tensor([timing.compute_s, timing.all_reduce_s, timing.gather_s,
                         timing.num_all_reduces], dtype=torch.float64)
    if world == 1:
        return (timing,)
    parts = [torch.empty_like(mine) for _ in range(world)] if timing.rank == 0 else None
    dist.gather(mine, parts, dst=0, group=group)
    if parts is None:
        return None
    return tuple(RankTiming(r, float(p[0]), float(p[1]), float(p[2]), int(p[3]))
                 for r, p in enumerate(parts))


def serve_worker(shard: ShardRunner, group: Any) -> None:
    """A worker's life: run every command rank 0 broadcasts, until "shutdown"."""
    caches: dict[int, TorchKVCache] = {}
    while True:
        command = broadcast_command(None, group)
        for kv_id in command.drop:
            caches.pop(kv_id, None)
        if command.kind == "shutdown":
            return
        if command.kind == "new_kv":
            caches[command.kv_id] = shard.new_kv_cache(*command.args)
        elif command.kind == "copy_page":
            shard.copy_page(caches[command.kv_id], *command.args)
        elif command.kind == "forward" and command.batch is not None:
            top_k = command.args[0] if command.args else None
            _, timing = shard.run_step(command.batch, caches[command.kv_id], top_k)
            exchange_timings(timing, shard.world, group)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command.kind!r}")


@dataclass
class TensorParallelRunner:
    """The ModelRunner the engine sees: rank 0's shard plus the workers it commands."""

    shard: ShardRunner
    group: Any  # the CPU (gloo) group commands travel over
    workers_alive: Callable[[], bool]  # False once any worker process has died
    on_close: Callable[[], None]  # stops the workers and tears the process groups down
    name: str = "torch"
    last_timings: tuple[RankTiming, ...] = ()  # per rank, the last forward step
    _kv_ids: Any = field(default_factory=itertools.count, repr=False)
    _dropped: deque[int] = field(default_factory=deque, repr=False)
    _closed: bool = False

    @property
    def config(self) -> ModelConfig:
        return self.shard.full_config

    @property
    def tensor_parallel(self) -> int:
        return self.shard.world

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def describe(self) -> dict[str, Any]:
        """The shard runner's choices, plus how many ranks share the model."""
        return {**self.shard.describe(), "tensor_parallel": self.tensor_parallel}

    # ------------------------------------------------------------------ protocol

    def new_kv_cache(self, num_pages: int, block_size: int) -> TensorParallelKVCache:
        """Every rank allocates its KV heads' share of ``num_pages`` pages."""
        kv_id = next(self._kv_ids)
        self._send(Command("new_kv", kv_id, (num_pages, block_size)))
        handle = TensorParallelKVCache(kv_id, self.shard.new_kv_cache(num_pages, block_size), block_size)
        # Workers free their shard at the next command after the engine drops this handle.
        weakref.finalize(handle, self._dropped.append, kv_id)
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

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Tell the workers to stop and release the process groups; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)  # the launcher registered it; nothing is left to do at exit
        try:
            if self.workers_alive():
                broadcast_command(Command("shutdown"), self.group)
        finally:
            self.on_close()

    # ------------------------------------------------------------------ inside

    def _step(self, batch: Batch, kv: TensorParallelKVCache, top_k: int | None) -> Tensor | TopLogits:
        self._send(Command("forward", kv.kv_id, () if top_k is None else (top_k,), batch))
        with torch.no_grad():
            result, timing = self.shard.run_step(batch, kv.local, top_k)
        timings = exchange_timings(timing, self.tensor_parallel, self.group)
        self.last_timings = timings or ()
        assert result is not None
        return result

    def _send(self, command: Command) -> None:
        if self._closed:
            raise TinyInferError("this tensor-parallel model was closed: load it again")
        if not self.workers_alive():
            raise TinyInferError("a tensor-parallel worker process has stopped (see its error "
                                 "above): close() this model and load it again")
        drop = []
        while self._dropped:  # popleft is atomic: a finalizer may append while we drain
            drop.append(self._dropped.popleft())
        broadcast_command(Command(command.kind, command.kv_id, command.args, command.batch, tuple(drop)),
                          self.group)
