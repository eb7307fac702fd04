"""Starting a tensor-parallel model: N - 1 worker processes, one process group, rank 0 here.

    model = tinyinfer.load("bundled", runner="torch", tensor_parallel=2)   # calls start_ranks
    engine = tinyinfer.Engine(model)             # unchanged: rank 0 drives
    ...
    model.runner.close()                         # or let atexit do it

Workers are started with torch.multiprocessing's "spawn" (a fresh interpreter each, as CUDA
requires), so a script that loads a tensor-parallel model must guard its top level with
``if __name__ == "__main__":``. Each rank reads the checkpoint itself and keeps only its
shard. They meet at a TCP store on 127.0.0.1 and a free port: NCCL on GPUs (rank r on
cuda:r), gloo on CPU; commands travel down one pipe per worker.
"""

from __future__ import annotations

import atexit
import queue
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinyinfer.config import ModelConfig, load_config
from tinyinfer.display import progress
from tinyinfer.errors import TinyInferError
from tinyinfer.runners import threads
from tinyinfer.runners.torch_weights import pick_device
from tinyinfer.runners.tp.runner import TensorParallelRunner, serve_worker
from tinyinfer.runners.tp.shard import (
    ShardRunner,
    check_tensor_parallel,
    random_shard_weights,
)
from tinyinfer.weights import load_weights


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank needs to build its shard and join the group (pickled to workers)."""

    path: Path | None  # a checkpoint folder, or None for random weights of ``random_config``
    world: int
    port: int
    device_type: str  # "cpu" or "cuda"
    dtype: str | None
    options: dict[str, Any] = field(default_factory=dict)  # TorchRunner options (compile, ...)
    random_config: ModelConfig | None = None
    seed: int = 0
    threads: int | None = None  # CPU threads per rank on CPU (the host's share), None on GPUs

    def device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device_type == "cuda" else "cpu"


def start_ranks(config: ModelConfig, path: Path | None, tensor_parallel: int,
                device: str | None = None, dtype: str | None = None, seed: int = 0,
                startup_timeout: float = 600.0, **runner_options: Any) -> TensorParallelRunner:
    """Start ranks 1..N-1 as worker processes and build rank 0's shard here; the runner that
    drives them all. ``path`` is a checkpoint folder, or None for random weights of
    ``config``'s shape drawn by each rank on its own device (benchmarks: a shape too big for
    one GPU never has to fit anywhere whole).

    ``device`` is "cuda" (one GPU per rank, NCCL) or "cpu" (gloo); the default is CUDA when
    available. ``runner_options`` go to each rank's TorchRunner (e.g. ``compile``).
    """
    spec = _spec(config, path, tensor_parallel, device, dtype, runner_options, seed=seed)
    return _launch(spec, startup_timeout)


def _spec(config: ModelConfig, path: Path | None, world: int, device: str | None, dtype: str | None,
          options: dict[str, Any], seed: int = 0) -> LaunchSpec:
    """Check that ``world`` ranks fit this model and machine, and describe the launch."""
    if device is not None and ":" in device:
        raise TinyInferError(f"pass device cuda rather than {device}: rank r runs on cuda:r")
    device_type = pick_device(device).type
    gpu_count = torch.cuda.device_count() if device_type == "cuda" else 0
    check_tensor_parallel(config, world, device_type, gpu_count)
    if dist.is_initialized():
        raise TinyInferError("this process already runs a torch.distributed group (another "
                             "tensor-parallel model?): close() its runner before loading another")
    # On CPU every rank shares this host: each gets its share of the threads chosen here.
    per_rank = max(1, torch.get_num_threads() // world) if device_type == "cpu" else None
    return LaunchSpec(path, world, free_port(), device_type, dtype, dict(options),
                      random_config=config if path is None else None, seed=seed, threads=per_rank)


def _launch(spec: LaunchSpec, startup_timeout: float) -> TensorParallelRunner:
    """Start the workers, build rank 0's shard, join the group; rank 0's runner drives the rest."""
    workers = _Workers.start(spec)
    own_threads = torch.get_num_threads()
    if spec.threads is not None:  # on the CPU rank 0 takes its share too, until close()
        threads.use(spec.threads)

    def stop(timeout: float = 30.0) -> None:
        workers.stop(timeout)
        if spec.threads is not None:
            threads.use(own_threads)

    try:
        with progress.task(f"tensor parallel: ranks ready (of {spec.world})", total=spec.world) as advance:
            shard = _build_shard(spec, 0)
            advance()
            workers.wait_ready(startup_timeout, on_ready=advance)
        _join_group(spec, 0)
    except BaseException:
        stop(timeout=0.0)  # the start failed: end the workers now, whatever they wait for
        raise
    runner = TensorParallelRunner(shard, workers.conns, workers_alive=workers.alive, on_close=stop)
    atexit.register(runner.close)
    return runner


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_shard(spec: LaunchSpec, rank: int) -> ShardRunner:
    """Read the checkpoint and keep this rank's shard on its device."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    if spec.path is None:
        assert spec.random_config is not None
        config = spec.random_config
        weights = random_shard_weights(config, rank, spec.world, spec.device(rank), spec.dtype, spec.seed)
        return ShardRunner(config, weights, rank, spec.world, device=spec.device(rank),
                           dtype=spec.dtype, presharded=True, **spec.options)
    config = load_config(spec.path)
    # Lazy: bf16 stays in the memory-mapped file; this rank reads and converts only its shard.
    return ShardRunner(config, load_weights(spec.path, config, lazy=True), rank, spec.world,
                       device=spec.device(rank), dtype=spec.dtype, **spec.options)


def _join_group(spec: LaunchSpec, rank: int) -> None:
    """Join the default group the tensors travel over: NCCL on GPUs, gloo on CPU."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec.port}", rank=rank,
                            world_size=spec.world)


def _worker_main(spec: LaunchSpec, rank: int, ready: Any, conn: Connection) -> None:
    """A worker process: build the shard, say so, join the group, serve rank 0 until shutdown."""
    try:
        if spec.threads is not None:
            threads.use(spec.threads)
        shard = _build_shard(spec, rank)
    except BaseException as exc:  # reported to rank 0, which raises it as a TinyInferError
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, None))
    _join_group(spec, rank)
    try:
        with progress.hidden():  # rank 0 draws the bars; workers share its terminal
            serve_worker(shard, conn)
    finally:
        dist.destroy_process_group()


@dataclass
class _Workers:
    """The worker processes of one tensor-parallel model, seen from rank 0."""

    processes: list[BaseProcess]
    ready: Any  # a multiprocessing queue of (rank, error message or None)
    conns: list[Connection]  # rank 0's end of each worker's command pipe

    @classmethod
    def start(cls, spec: LaunchSpec) -> _Workers:
        context = mp.get_context("spawn")
        ready = context.Queue()
        pipes = [context.Pipe() for _ in range(1, spec.world)]
        processes = [context.Process(target=_worker_main, args=(spec, rank, ready, pipes[rank - 1][1]),
                                     daemon=True, name=f"tinyinfer-tp-rank{rank}")
                     for rank in range(1, spec.world)]
        for process in processes:
            process.start()
        return cls(processes, ready, [ours for ours, _ in pipes])

    def wait_ready(self, timeout: float, on_ready: Callable[[], Any] = lambda: None) -> None:
        """Block until every worker has built its shard (``on_ready()`` as each has); raise what a
        failed one reported."""
        waiting = {p.name: p for p in self.processes}
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                rank, error = self.ready.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in waiting.values() if p.exitcode is not None]
                if dead:
                    raise TinyInferError(f"tensor-parallel worker {dead[0].name} exited (code "
                                         f"{dead[0].exitcode}) before it was ready; see its error above")
                if time.monotonic() > deadline:
                    raise TinyInferError(f"tensor-parallel workers {sorted(waiting)} were not ready "
                                         f"after {timeout:.0f} s: raise startup_timeout for big models")
                continue
            if error is not None:
                raise TinyInferError(f"tensor-parallel worker rank {rank} could not load its shard: {error}")
            waiting.pop(f"tinyinfer-tp-rank{rank}")
            on_ready()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def stop(self, timeout: float = 30.0) -> None:
        """Wait briefly (one deadline for all) for workers to exit, end any that do not, and
        leave the process group."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
