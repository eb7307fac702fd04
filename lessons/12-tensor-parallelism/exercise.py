"""Lesson 12 exercise: split a layer over N ranks, add their partials, and price the communication.

Fill in every body, then run `tinyinfer lesson check 12`. Weights are [out, in] and a layer
computes y = x @ weight.T, as in the engine. `silu` is given (lesson 02).
"""

from __future__ import annotations

import numpy as np

from tinyinfer.runners.numpy_ref import (
    silu,  # silu(z) = z * sigmoid(z), lesson 02's; for mlp_partials
)


def column_parallel(weight: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s shard of a column-parallel weight [out, in]: its block of out / world output rows.

    With it a rank computes out / world of y's features, each one complete. Rank 0 takes the
    first block, rank 1 the next, and so on. Raise ValueError if world does not divide out.
    """
    raise NotImplementedError


def row_parallel(weight: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s shard of a row-parallel weight [out, in]: its block of in / world input columns.

    Fed the matching block of x's features, a rank's product is a partial sum of the whole y:
    the ranks' partials add up to x @ weight.T. Raise ValueError if world does not divide in.
    """
    raise NotImplementedError


def mlp_partials(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                 world: int) -> list[np.ndarray]:
    """Each rank's partial output of the SwiGLU MLP down(silu(gate(x)) * up(x)), split Megatron-style.

    x: [T, D], the same on every rank; gate, up: [F, D]; down: [D, F]. Rank r computes with its
    column-parallel shards of gate and up and its row-parallel shard of down, and nothing from
    the other ranks. Returns the world partial outputs, each [T, D]; their sum is the MLP's output.
    """
    raise NotImplementedError


def all_reduce_count(num_layers: int, world: int) -> int:
    """All-reduces in one forward step of a Llama split over world ranks (0 on one rank).

    The embedding is vocabulary-parallel; every layer has attention (o row-parallel) and an MLP
    (down row-parallel).
    """
    raise NotImplementedError


def ring_all_reduce(partials: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Sum the ranks' arrays as a ring all-reduce does; every rank ends with the whole sum.

    partials[r] is rank r's array; all have the same shape and dtype. Cut each (flattened) into
    N chunks with np.array_split. Reduce-scatter: N - 1 steps; in each, every rank sends one
    chunk to rank (r + 1) % N, which adds it to its own copy of that chunk; afterwards each rank
    holds one chunk summed over all ranks. All-gather: N - 1 more steps pass the summed chunks
    on around the ring. Returns each rank's result (the input's shape) and the bytes each rank sent.
    """
    raise NotImplementedError


def decode_step_time(bytes_per_step: float, bandwidth: float, world: int, num_layers: int,
                     message_bytes: float, latency: float, link_bandwidth: float) -> float:
    """Seconds for one memory-bound decode step of a model split over world GPUs.

    bytes_per_step: weights and KV cache read once per step, all GPUs together; each GPU reads
    its share at bandwidth (bytes/s). Every all-reduce of the step moves message_bytes: it costs
    latency plus the bytes a ring makes each GPU send, at link_bandwidth. No overlap: reads and
    all-reduces add up.
    """
    raise NotImplementedError


def best_gpu_count(step_seconds: dict[int, float], tolerance: float = 0.05) -> int:
    """The GPU count worth using: the fewest GPUs whose step is within `tolerance` of the fastest.

    step_seconds maps a GPU count to its decode step time; within tolerance means at most
    (1 + tolerance) times the fastest step. More GPUs than that buy too little to pay for.
    """
    raise NotImplementedError
