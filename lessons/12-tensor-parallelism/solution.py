"""Lesson 12 solution (for teachers): Megatron splits, a ring all-reduce, the cost of a sharded step."""

from __future__ import annotations

import numpy as np

from tinyinfer.runners.numpy_ref import silu


def column_parallel(weight: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s block of out / world output rows of weight [out, in]."""
    out = weight.shape[0]
    if out % world:
        raise ValueError(f"{world} ranks cannot share {out} output rows evenly")
    share = out // world
    return weight[rank * share:(rank + 1) * share]


def row_parallel(weight: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s block of in / world input columns of weight [out, in]."""
    size = weight.shape[1]
    if size % world:
        raise ValueError(f"{world} ranks cannot share {size} input columns evenly")
    share = size // world
    return weight[:, rank * share:(rank + 1) * share]


def mlp_partials(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                 world: int) -> list[np.ndarray]:
    """Each rank's partial [T, D] of down(silu(gate(x)) * up(x)); no communication inside."""
    partials = []
    for rank in range(world):
        g = x @ column_parallel(gate, rank, world).T  # [T, F / N]: complete units
        u = x @ column_parallel(up, rank, world).T
        partials.append((silu(g) * u) @ row_parallel(down, rank, world).T)  # [T, D]: a partial sum
    return partials


def all_reduce_count(num_layers: int, world: int) -> int:
    """The embedding's all-reduce, then attention's and the MLP's in every layer."""
    return 0 if world == 1 else 2 * num_layers + 1


def ring_all_reduce(partials: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Reduce-scatter then all-gather around a ring; each rank's result and bytes sent."""
    n = len(partials)
    chunks = [np.array_split(p.reshape(-1).copy(), n) for p in partials]  # chunks[rank][chunk]
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter: pass chunk (r - step) on, the next rank adds it
        outgoing = [(r, (r - step) % n, chunks[r][(r - step) % n].copy()) for r in range(n)]
        for r, c, data in outgoing:
            chunks[(r + 1) % n][c] += data
            sent[r] += data.nbytes
    for step in range(n - 1):  # all-gather: rank r starts with chunk (r + 1) summed; pass it on
        outgoing = [(r, (r + 1 - step) % n, chunks[r][(r + 1 - step) % n].copy()) for r in range(n)]
        for r, c, data in outgoing:
            chunks[(r + 1) % n][c] = data
            sent[r] += data.nbytes
    return [np.concatenate(c).reshape(partials[0].shape) for c in chunks], sent


def decode_step_time(bytes_per_step: float, bandwidth: float, world: int, num_layers: int,
                     message_bytes: float, latency: float, link_bandwidth: float) -> float:
    """Each GPU's share of the reads, plus every all-reduce's latency and ring traffic."""
    reads = bytes_per_step / world / bandwidth
    one_all_reduce = latency + 2 * (world - 1) / world * message_bytes / link_bandwidth
    return reads + all_reduce_count(num_layers, world) * one_all_reduce


def best_gpu_count(step_seconds: dict[int, float], tolerance: float = 0.05) -> int:
    """The fewest GPUs whose step is within tolerance of the fastest."""
    fastest = min(step_seconds.values())
    return min(n for n, t in step_seconds.items() if t <= fastest * (1 + tolerance))
