"""Starting a tensor-parallel model: N - 1 worker processes, one process group, rank 0 here.

    model = tinyinfer.load("bundled", runner="torch", tensor_parallel=2)   # calls start_ranks
    engine = tinyinfer.Engine(model)             # unchanged: rank 0 drives
    ...
    model.runner.close()                         # or let atexit do it

Two ways to get the processes:

* built in: workers are started with torch.multiprocessing's "spawn" (a fresh interpreter
  each, as CUDA requires), so a script that loads a tensor-parallel model must guard its top
  level with ``if __name__ == "__main__":``. They meet at a TCP store on 127.0.0.1 and a free
  port; commands travel down one pipe per worker.
* ``torchrun --nproc-per-node N script.py`` (or ``-m tinyinfer ...``): torchrun starts all N
  processes and its rendezvous store joins them. Rank 0 runs the program; every other rank
  becomes a worker inside ``start_ranks`` (the CLI sends it there before parsing anything),
  connects to rank 0 over TCP and exits when rank 0 shuts the model down.

Each rank reads the checkpoint itself and keeps only its shard; NCCL on GPUs (rank r on
cuda:r, or cuda:LOCAL_RANK under torchrun), gloo on CPU. Workers ignore Ctrl-C: rank 0 gets
it and shuts them down.
"""

from __future__ import annotations

import atexit
import os
import pickle
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
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
    pick_all_reduce,
    random_shard_weights,
)
from tinyinfer.weights import load_weights

_COMMANDS_KEY = "tinyinfer/tp_commands"  # torchrun's store: where rank 0 listens for its workers


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank needs to build its shard and join the group (pickled to workers)."""

    path: Path | None  # a checkpoint folder, or None for random weights of ``random_config``
    world: int
    init_method: str  # "tcp://127.0.0.1:PORT" (spawned workers) or "env://" (torchrun)
    device_type: str  # "cpu" or "cuda"
    dtype: str | None
    options: dict[str, Any] = field(default_factory=dict)  # TorchRunner options (compile, ...)
    random_config: ModelConfig | None = None
    seed: int = 0
    threads: int | None = None  # CPU threads per rank on CPU (the host's share), None on GPUs

    def device(self, rank: int) -> str:
        """Rank r's device: cuda:r, or cuda:LOCAL_RANK where torchrun spreads ranks over hosts."""
        if self.device_type != "cuda":
            return "cpu"
        return f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) if self.init_method == 'env://' else rank}"


def torchrun_rank() -> int | None:
    """This process's rank if torchrun started it, else None."""
    return int(os.environ["RANK"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def start_ranks(config: ModelConfig, path: Path | None, tensor_parallel: int,
                device: str | None = None, dtype: str | None = None, seed: int = 0,
                startup_timeout: float = 600.0, **runner_options: Any) -> TensorParallelRunner:
    """Start ranks 1..N-1 as worker processes and build rank 0's shard here; the runner that
    drives them all. ``path`` is a checkpoint folder, or None for random weights of
    ``config``'s shape drawn by each rank on its own device (benchmarks: a shape too big for
    one GPU never has to fit anywhere whole).

    ``device`` is "cuda" (one GPU per rank, NCCL) or "cpu" (gloo); the default is CUDA when
    available. ``runner_options`` go to each rank's ShardRunner (``compile``, ``all_reduce``,
    ``time_collectives``, ...).

    Under torchrun the processes exist already: rank 0 connects to the others and returns the
    runner; any other rank serves rank 0 here until it shuts down, then exits the process.
    """
    rank = torchrun_rank()
    if rank is not None and rank > 0:
        serve_torchrun_rank(startup_timeout)
        raise SystemExit(0)
    if rank == 0:
        store = _torchrun_store(startup_timeout)
        try:
            world = int(os.environ["WORLD_SIZE"])
            if world != tensor_parallel:
                raise TinyInferError(f"torchrun started {world} processes but tensor_parallel is "
                                     f"{tensor_parallel}: pass --nproc-per-node {tensor_parallel} "
                                     "(times the number of nodes) or change tensor_parallel")
            spec = _spec(config, path, world, device, dtype, runner_options, seed, "env://")
        except BaseException:
            store.set(_COMMANDS_KEY, pickle.dumps(None))  # the other ranks exit instead of waiting
            raise
        return _launch(spec, startup_timeout, lambda: _Workers.accept(spec, store, startup_timeout))
    spec = _spec(config, path, tensor_parallel, device, dtype, runner_options, seed,
                 f"tcp://127.0.0.1:{free_port()}")
    return _launch(spec, startup_timeout, lambda: _Workers.spawn(spec))


def _spec(config: ModelConfig, path: Path | None, world: int, device: str | None, dtype: str | None,
          options: dict[str, Any], seed: int, init_method: str) -> LaunchSpec:
    """Check that ``world`` ranks fit this model and machine, and describe the launch."""
    if device is not None and ":" in device:
        raise TinyInferError(f"pass device cuda rather than {device}: rank r runs on cuda:r")
    device_type = pick_device(device).type
    gpu_count = torch.cuda.device_count() if device_type == "cuda" else 0
    if init_method == "env://":  # torchrun: this host holds LOCAL_WORLD_SIZE of the ranks
        gpu_count *= world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_tensor_parallel(config, world, device_type, gpu_count)
    one_host = init_method != "env://" or int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    options = {**options, "all_reduce": pick_all_reduce(
        options.get("all_reduce", "auto"), device_type, list(range(world)) if one_host else None)}
    if dist.is_initialized():
        raise TinyInferError("this process already runs a torch.distributed group (another "
                             "tensor-parallel model?): close() its runner before loading another")
    # On CPU every rank shares this host: each gets its share of the threads chosen here.
    per_rank = max(1, torch.get_num_threads() // world) if device_type == "cpu" else None
    return LaunchSpec(path, world, init_method, device_type, dtype, dict(options),
                      random_config=config if path is None else None, seed=seed, threads=per_rank)


def _launch(spec: LaunchSpec, startup_timeout: float, start: Callable[[], _Workers]) -> TensorParallelRunner:
    """Start the workers, build rank 0's shard, join the group; rank 0's runner drives the rest."""
    workers = start()
    own_threads = torch.get_num_threads()
    if spec.threads is not None:  # on the CPU rank 0 takes its share too, until close()
        threads.use(spec.threads)

    def stop(abort: bool = False, timeout: float = 30.0) -> None:
        _leave_group(abort)  # every rank leaves at once: NCCL's teardown may wait for the peers
        workers.stop(timeout)
        if spec.threads is not None:
            threads.use(own_threads)

    try:
        with progress.task(f"tensor parallel: ranks ready (of {spec.world})", total=spec.world) as advance:
            shard = _build_shard(spec, 0)
            advance()
            workers.wait_ready(startup_timeout, on_ready=advance)
        _join_group(spec, 0)
        shard.connect()
    except BaseException:
        stop(abort=True, timeout=0.0)  # the start failed: end the workers now, whatever they wait for
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
    device = spec.device(rank)
    if spec.device_type == "cuda":
        torch.cuda.set_device(device)
    if spec.path is None:
        assert spec.random_config is not None
        config = spec.random_config
        weights = random_shard_weights(config, rank, spec.world, device, spec.dtype, spec.seed)
        return ShardRunner(config, weights, rank, spec.world, device=device,
                           dtype=spec.dtype, presharded=True, **spec.options)
    config = load_config(spec.path)
    # Lazy: bf16 stays in the memory-mapped file; this rank reads and converts only its shard.
    return ShardRunner(config, load_weights(spec.path, config, lazy=True), rank, spec.world,
                       device=device, dtype=spec.dtype, **spec.options)


def _join_group(spec: LaunchSpec, rank: int) -> None:
    """Join the default group the tensors travel over: NCCL on GPUs, gloo on CPU."""
    backend = "nccl" if spec.device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.world)


def _leave_group(abort: bool) -> None:
    """Tear this rank's process group down; ``abort`` when a collective may still be pending
    (a step cut short), which a plain destroy would wait on forever."""
    if not dist.is_initialized():
        return
    if abort:
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def _serve_rank(spec: LaunchSpec, rank: int, conn: Connection) -> None:
    """A worker's life: build the shard, say so, join the group, serve rank 0 until shutdown."""
    # Ctrl-C reaches every process of the terminal's group: rank 0 alone handles it, then
    # shuts the workers down (no worker traceback, no rank left behind).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if spec.threads is not None:
            threads.use(spec.threads)
        shard = _build_shard(spec, rank)
    except BaseException as exc:  # reported to rank 0, which raises it as a TinyInferError
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(None)  # ready
    _join_group(spec, rank)
    clean = False
    try:
        shard.connect()
        with progress.hidden():  # rank 0 draws the bars; workers share its terminal
            clean = serve_worker(shard, conn)
    finally:
        shard.release_graphs()
        _leave_group(abort=not clean)


def serve_torchrun_rank(startup_timeout: float = 600.0) -> int:
    """Be one of torchrun's ranks other than 0: connect to rank 0, take its launch description,
    serve it until it shuts down. Returns the process's exit code."""
    rank = torchrun_rank()
    assert rank is not None and rank > 0
    address = pickle.loads(_torchrun_store(startup_timeout).get(_COMMANDS_KEY))
    if address is None:  # rank 0 refused the launch and said why
        return 1
    host, port, token = address
    sock = socket.create_connection((host, port), timeout=startup_timeout)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = Connection(sock.detach())
    conn.send_bytes(token)
    conn.send_bytes(str(rank).encode())
    spec: LaunchSpec = conn.recv()
    _serve_rank(spec, rank, conn)
    return 0


def _torchrun_store(timeout: float) -> dist.Store:
    """A client of the rendezvous store torchrun started (MASTER_ADDR:MASTER_PORT)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=timeout))


@dataclass
class _Workers:
    """The other ranks of one tensor-parallel model, seen from rank 0: a connection to each
    (rank 1 first), and their processes where rank 0 started them."""

    conns: list[Connection]
    processes: list[BaseProcess] = field(default_factory=list)

    @classmethod
    def spawn(cls, spec: LaunchSpec) -> _Workers:
        context = mp.get_context("spawn")
        pipes = [context.Pipe() for _ in range(1, spec.world)]
        processes = [context.Process(target=_serve_rank, args=(spec, rank, pipes[rank - 1][1]),
                                     daemon=True, name=f"tinyinfer-tp-rank{rank}")
                     for rank in range(1, spec.world)]
        for process in processes:
            process.start()
        for _, theirs in pipes:
            theirs.close()  # theirs now lives in the worker: its death ends our end with EOF
        return cls([ours for ours, _ in pipes], processes)

    @classmethod
    def accept(cls, spec: LaunchSpec, store: dist.Store, timeout: float) -> _Workers:
        """torchrun's other ranks: listen, publish where in the store, accept each one, send it
        the launch description."""
        multi_host = int(os.environ.get("LOCAL_WORLD_SIZE", spec.world)) < spec.world
        host = socket.getfqdn() if multi_host else "127.0.0.1"
        token = secrets.token_bytes(32)  # only a process that read the store may connect
        conns: dict[int, Connection] = {}
        with socket.create_server(("" if multi_host else "127.0.0.1", 0)) as server:
            store.set(_COMMANDS_KEY, pickle.dumps((host, server.getsockname()[1], token)))
            server.settimeout(timeout)
            while len(conns) < spec.world - 1:
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    raise TinyInferError(f"only {len(conns)} of torchrun's {spec.world - 1} other "
                                         f"ranks connected within {timeout:.0f} s") from None
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn = Connection(sock.detach())
                # the token before anything is unpickled: nothing else may speak to rank 0
                if not conn.poll(timeout) or not secrets.compare_digest(conn.recv_bytes(64), token):
                    conn.close()
                    continue
                conns[int(conn.recv_bytes(16))] = conn
        for conn in conns.values():
            conn.send(spec)
        return cls([conns[rank] for rank in range(1, spec.world)])

    def wait_ready(self, timeout: float, on_ready: Callable[[], Any] = lambda: None) -> None:
        """Block until every worker has built its shard (``on_ready()`` as each has); raise what a
        failed one reported."""
        waiting = {conn: rank for rank, conn in enumerate(self.conns, start=1)}
        deadline = time.monotonic() + timeout
        while waiting:
            for conn in wait(list(waiting), timeout=0.5):
                rank = waiting.pop(conn)  # type: ignore[call-overload]
                try:
                    error = conn.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    code = self.processes[rank - 1].exitcode if self.processes else None
                    raise TinyInferError(f"tensor-parallel worker rank {rank} exited (code {code}) "
                                         "before it was ready; see its error above") from None
                if error is not None:
                    raise TinyInferError(f"tensor-parallel worker rank {rank} could not load its "
                                         f"shard: {error}")
                on_ready()
            if waiting and time.monotonic() > deadline:
                raise TinyInferError(f"tensor-parallel workers of ranks {sorted(waiting.values())} "
                                     f"were not ready after {timeout:.0f} s: raise startup_timeout "
                                     "for big models")

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def stop(self, timeout: float = 30.0) -> None:
        """Wait briefly (one deadline for all) for the worker processes to exit, end any that
        do not, and close the connections."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
