"""The push all-reduce: a decode step's small partial sums added in one trip across NVLink.

torch's one-shot kernel (``all_reduce="symm_mem"``) copies a rank's partial sum into its own
symmetric buffer, signals every peer and waits for every peer's signal (a barrier across the
link), then reads every peer's buffer: two trips across the link before the sum can start,
about 9.5 us inside an 8B decode step on H100s, where the step makes 65 of them. Here
(``all_reduce="push"``) each rank writes its partial sum straight into a slot of every peer's
buffer, then polls its own buffer until every part has landed: the data is its own flag.

* **The flag.** An empty place holds a sentinel, the bit pattern of -0.0, which no pushed value
  carries: a rank adds +0.0 to its values before it pushes them, which turns -0.0 into +0.0 (the
  same number in any sum) and changes nothing else. Each element is checked on its own, so a
  store that lands in pieces is never read half done. The reader loads with ``volatile`` (no
  cached copy) until no place it needs holds the sentinel, adds the parts in float32 in the
  same order on every rank (every rank ends with the same bits), and puts the sentinel back.
* **Two slots, used in turn.** Rank r may start call e + 1 while a slower peer still reads call
  e's slot, so e + 1 pushes into the other slot. It cannot run two calls ahead: call e + 1 ends
  only once every peer has pushed its part of e + 1, which each does after finishing call e
  (clearing its slot included). And a slot a peer pushes into at call e + 2 was cleared here at
  call e, in a kernel that ended before this rank pushed call e + 1, which that peer had to read
  first. So a slot is always empty when a push arrives, without a barrier.
* **The call count lives on the GPU.** Each program keeps its own counter of the calls it took
  part in (its parity picks the slot), so CUDA graphs replay the kernel with fixed arguments.
  Every rank launches the same all-reduces in the same order (the tensor-parallel contract), so
  program p's counter agrees on every rank, whatever the message sizes.

Messages up to ``PUSH_MAX_BYTES`` take it (one program per ``BLOCK`` elements; decode steps of
up to a few sequences); larger ones go to torch's one-shot kernel or NCCL (``ShardRunner``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners.triton_env import INTERPRETED

BLOCK = 1024  # elements a program sums (an 8B-wide row: four programs, four SMs)
# How long a program waits for its peers' parts before it stops the kernel with an error, as
# NCCL's watchdog does after its timeout: a rank that died mid-step must not leave the others
# spinning in a kernel nothing can end. Long, since a peer may still be compiling its first step.
WAIT_LIMIT_NS = 600 * 10**9
PUSH_MAX_BYTES = 64 << 10  # the largest message pushed (bf16: 32768 elements, 32 programs)
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_TL_BITS = {torch.int16: tl.int16, torch.int32: tl.int32}


@triton.jit
def _nanoseconds(like):
    """The GPU's global timer (ns), shaped as ``like`` (an int32, unread)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _stop(like):
    """End the kernel with an error (``trap``; ``like``: an int32, unread): the launch fails and
    the process sees a CUDA error."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r,r", [like], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _push_all_reduce_kernel(x_ptr, out_ptr, buffers_ptr, counters_ptr, numel, capacity,
                            RANK: tl.constexpr, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                            BLOCK: tl.constexpr, SENTINEL: tl.constexpr, INT: tl.constexpr,
                            WAIT_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """out = the sum over ranks of x. ``buffers_ptr``: every rank's buffer address (int64
    [WORLD]); a buffer holds [2 slots, WORLD parts, capacity] elements as integers of the
    values' width (INT; SENTINEL the empty place's bits); ``counters_ptr``: this rank's
    per-program call counters (int32). A program that waits longer than WAIT_LIMIT ns for its
    peers stops the kernel."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    calls = tl.load(counters_ptr + pid)
    slot = calls & 1
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    bits = (x.to(tl.float32) + 0.0).to(x.dtype).to(INT, bitcast=True)  # -0.0 -> +0.0
    for peer in tl.static_range(WORLD):  # buffers and parts start on 16-byte boundaries (checked)
        theirs = tl.multiple_of(tl.load(buffers_ptr + peer).to(tl.pointer_type(INT)), 16)
        tl.store(theirs + (slot * WORLD + RANK) * capacity + offs, bits, mask=ok)
    mine = tl.multiple_of(tl.load(buffers_ptr + RANK).to(tl.pointer_type(INT)), 16)
    part = tl.arange(0, WORLD_P2)
    places = mine + (slot * WORLD + part[:, None]) * capacity + offs[None, :]
    needed = (part < WORLD)[:, None] & ok[None, :]
    got = tl.load(places, mask=needed, other=0, volatile=True)
    if not INTERPRETED:  # the interpreter runs no inline assembly
        began = _nanoseconds(calls)
    while tl.sum((got == SENTINEL).to(tl.int32)) > 0:
        got = tl.load(places, mask=needed, other=0, volatile=True)
        if not INTERPRETED:
            if _nanoseconds(calls) - began > WAIT_LIMIT:
                _stop(calls)
    total = tl.sum(got.to(x.dtype, bitcast=True).to(tl.float32), axis=0)
    tl.store(out_ptr + offs, total.to(x.dtype), mask=ok)
    tl.debug_barrier()  # every thread has read its parts before any place is emptied
    tl.store(places, tl.full([WORLD_P2, BLOCK], SENTINEL, INT), mask=needed)
    tl.store(counters_ptr + pid, calls + 1)


def sentinel(dtype: torch.dtype) -> int:
    """-0.0's bit pattern as a signed integer of ``dtype``'s width: an empty place."""
    return int(torch.tensor(-0.0, dtype=dtype).view(_BITS[dtype]).item())


class PushAllReduce:
    """This rank's side of the push all-reduce over ``buffers``: every rank's buffer of
    [2, world, capacity] integers of ``dtype``'s width, filled with ``sentinel(dtype)`` on every
    rank before any rank's first call (``ShardRunner.connect`` allocates them in symmetric
    memory; the tests, in one process's memory)."""

    def __init__(self, buffers: list[Tensor], rank: int, dtype: torch.dtype):
        self.rank, self.world, self.dtype = rank, len(buffers), dtype
        mine = buffers[rank]
        if mine.dtype != _BITS[dtype] or mine.dim() != 3 or mine.shape[:2] != (2, self.world):
            raise ValueError(f"a push buffer is [2, {self.world}, capacity] of {_BITS[dtype]}, "
                             f"got {tuple(mine.shape)} of {mine.dtype}")
        self.capacity = mine.shape[2]
        if (self.capacity * mine.element_size()) % 16 or any(b.data_ptr() % 16 for b in buffers):
            raise ValueError("push buffers and their parts start on 16-byte boundaries (the kernel "
                             "moves 16 bytes at a time)")
        self.max_numel = min(self.capacity, PUSH_MAX_BYTES // dtype.itemsize)
        self._buffers = buffers  # kept alive: the kernel reads them by address
        self._addresses = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                                       device=mine.device)
        self._counters = torch.zeros(triton.cdiv(self.capacity, BLOCK), dtype=torch.int32,
                                     device=mine.device)
        self._constants = dict(RANK=rank, WORLD=self.world, WORLD_P2=triton.next_power_of_2(self.world),
                               BLOCK=BLOCK, SENTINEL=sentinel(dtype), INT=_TL_BITS[_BITS[dtype]],
                               WAIT_LIMIT=WAIT_LIMIT_NS, INTERPRETED=INTERPRETED, num_warps=4)

    @classmethod
    def in_symmetric_memory(cls, group_name: str, rank: int, world: int, dtype: torch.dtype,
                            device: torch.device) -> PushAllReduce:
        """Every rank of the group calls this at once: its buffer in torch's symmetric memory,
        emptied, and the peers' buffers mapped; returns when every rank's buffer is empty."""
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(2, world, PUSH_MAX_BYTES // dtype.itemsize, dtype=_BITS[dtype], device=device)
        buffer.fill_(sentinel(dtype))
        handle = symm_mem.rendezvous(buffer, group_name)
        buffers = [buffer if r == rank else handle.get_buffer(r, tuple(buffer.shape), buffer.dtype)
                   for r in range(world)]
        torch.cuda.synchronize(device)
        dist.barrier()  # no rank pushes before every buffer is empty
        return cls(buffers, rank, dtype)

    def fits(self, x: Tensor) -> bool:
        """Whether ``x`` is a message this all-reduce takes: its dtype, at most max_numel."""
        return x.dtype == self.dtype and x.numel() <= self.max_numel

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """The sum of every rank's ``x`` (every rank calls this with the same shape), in ``out``
        if given (contiguous, x's shape and dtype)."""
        if not self.fits(x):
            raise ValueError(f"the push all-reduce takes {self.dtype} messages of at most "
                             f"{self.max_numel} elements, got {x.numel()} of {x.dtype}")
        x = x.contiguous()
        out = torch.empty_like(x) if out is None else out
        _push_all_reduce_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x, out, self._addresses, self._counters, x.numel(), self.capacity, **self._constants)
        return out
