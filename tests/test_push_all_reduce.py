"""The push all-reduce (runners/tp/push_all_reduce.py) under Triton's CPU interpreter.

Each rank is a process of its own, as on GPUs: its kernel pushes into the other ranks' buffers
(shared memory here, NVLink peers' memory there) and polls its own until every part has come.
The same ranks make calls of several sizes in turn, so the two slots and every program's call
counter are used more than once; scripts/tp_gpu_check.py checks the kernel itself on GPUs.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.interpreted import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed; scripts/tp_gpu_check.py runs "
                                         "the push all-reduce on GPUs")

RANKS = """
import numpy as np
import torch
import torch.multiprocessing as mp
from tinyinfer.runners.tp.push_all_reduce import BLOCK, PushAllReduce, sentinel

SIZES = (5, BLOCK + 7, 300, 2 * BLOCK, 1, BLOCK + 7)  # programs: 1, 2, 1, 2, 1, 2


def partial(call, rank, n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(100 * call + rank)).to(dtype)
    x[0] = -0.0 if rank % 2 else x[0]  # a pushed -0.0 must not read as an empty place
    if call == 4:
        x[0] = -0.0  # every rank: the sum of -0.0s is zero
    return x


def rank_main(rank, buffers, dtype, results):
    reduce = PushAllReduce(list(buffers), rank, dtype)
    sums = [reduce(partial(call, rank, n, dtype)) for call, n in enumerate(SIZES)]
    results.put((rank, [s.float().numpy() for s in sums], reduce._counters.tolist()))


def check(world, dtype):
    buffers = [torch.full((2, world, 3 * BLOCK), sentinel(dtype),
                          dtype=torch.int16 if dtype.itemsize == 2 else torch.int32).share_memory_()
               for _ in range(world)]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=rank_main, args=(r, buffers, dtype, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict((r, (sums, counters)) for r, sums, counters in (results.get(timeout=120) for _ in range(world)))
    for p in procs:
        p.join(timeout=60)
    for call, n in enumerate(SIZES):
        want = sum(partial(call, r, n, dtype).double() for r in range(world)).numpy()
        first = got[0][0][call]
        for r in range(1, world):  # every rank holds the same bits
            assert np.array_equal(got[r][0][call], first), (world, call, r)
        tolerance = 2.0 ** -7 if dtype.itemsize == 2 else 1e-6
        assert np.allclose(first, want, rtol=tolerance, atol=tolerance * world), (world, call)
    assert all(counters == [len(SIZES), 3, 0] for _, counters in got.values())  # calls each program took
    assert all(bool((b == sentinel(dtype)).all()) for b in buffers)  # every place empty again


if __name__ == "__main__":
    for world, dtype in ((2, torch.bfloat16), (4, torch.bfloat16), (3, torch.float32)):
        check(world, dtype)
    print("ok")
"""


@needs_triton
def test_push_all_reduce_sums_every_ranks_part_alike_on_every_rank(tmp_path):
    script = tmp_path / "ranks.py"  # spawned processes import the script's functions by path
    script.write_text(RANKS)
    run_interpreted(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")


@needs_triton
def test_push_all_reduce_refuses_what_it_cannot_take(tmp_path):
    run_interpreted("""
import torch
from tinyinfer.runners.tp.push_all_reduce import BLOCK, PushAllReduce, sentinel
buffers = [torch.full((2, 2, BLOCK), sentinel(torch.bfloat16), dtype=torch.int16) for _ in range(2)]
reduce = PushAllReduce(buffers, 0, torch.bfloat16)
assert reduce.fits(torch.zeros(BLOCK, dtype=torch.bfloat16))
for x in (torch.zeros(BLOCK + 1, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.float32)):
    assert not reduce.fits(x)
    try:
        reduce(x)
    except ValueError as e:
        assert "push all-reduce takes" in str(e), e
    else:
        raise AssertionError("took a message it does not fit")
for buffer, message in ((torch.zeros(2, 3, 8, dtype=torch.int16), "push buffer is [2, 2, capacity]"),
                        (torch.zeros(2, 2, 12, dtype=torch.int16), "16-byte boundaries")):
    try:
        PushAllReduce([buffer] * 2, 0, torch.bfloat16)
    except ValueError as e:
        assert message in str(e), e
    else:
        raise AssertionError("took a buffer it cannot use")
print("ok")
""")
