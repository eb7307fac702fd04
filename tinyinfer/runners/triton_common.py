"""Pieces the Triton kernels share (``torch_triton_gemv``, ``torch_triton_rows``,
``torch_quant_kernel``, ``torch_quant_gemv``, the decode attention of ``torch_triton``):
programmatic dependent launch, loop trip counts, masked loads, the split-K tile counters, and
the fused products' epilogue (bias, silu(gate) * up, residual add, split-K reduction).

Programmatic dependent launch (compute capability 9.0 on): a kernel launched with
``launch_pdl=True`` may start while the kernel before it on the stream is still running, once
every program of that one has called ``gdc_launch_dependents`` (or ended). It must call
``gdc_wait`` -- which returns when the previous kernel has finished and its writes are visible
-- before it reads anything an earlier kernel wrote or writes anything one reads; what no
kernel writes (the weights) it may load before. A kernel that waits finishes only after the one
before it, so the waits chain back through the step. Launchers ask
``triton_env.launches_dependent`` (inside the runner's ``dependent_launch(pdl)``, on a card that
has it) and pass the answer as the kernel's PDL constexpr and as ``launch_pdl``; CUDA graphs keep
the launches' programmatic edges when they capture them. The fused decode products and the
attention between them use it; torch's own kernels (cuBLAS, copies, collectives), Inductor's and
the unfused int8 / int4 products (``torch_quant_kernel``) launch without it, so the next kernel
simply follows them (docs/fast-path.md says why: no faster there, and Inductor's own PDL, on
torch 2.11, changed the logits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Output tiles a split-K launch may count (the size of its counter buffer: 1 MiB a device). The
# row kernel's tiles multiply with the step's row tiles and it splits whatever the rows (batch
# invariance): a prefill chunk of 16384 tokens through the 8B q|k|v product counts 98,304.
MAX_TILES = 1 << 18


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible (``gdc_wait``):
    before reading anything an earlier kernel wrote or writing anything one reads. Nothing
    without PDL (a plain launch already follows the previous kernel)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel launch (``gdc_launch_dependents``): its programs start as this one's
    finish, and it waits for this one's results before using them. Nothing without PDL."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def trip_count(steps, INTERPRETED_STEPS: tl.constexpr):
    """A loop's trip count: the run-time ``steps`` on the GPU (one compiled kernel serves every
    width); Triton's CPU interpreter, which the tests use, takes only a constant bound, so there
    the launcher passes it as INTERPRETED_STEPS too."""
    if INTERPRETED_STEPS > 0:
        return INTERPRETED_STEPS
    return steps


@triton.jit
def load(pointers, mask, EVEN: tl.constexpr):
    """Load, masked unless EVEN (every tile whole: no mask to test, no zeros to fill)."""
    if EVEN:
        return tl.load(pointers)
    return tl.load(pointers, mask=mask, other=0)


_counters: dict[torch.device, Tensor] = {}


def split_counters(tiles: int, device: torch.device) -> Tensor:
    """Zeroed tile counters for a split-K launch of ``tiles`` output tiles, one buffer per
    device: the last program of a tile to finish adds the partial sums and sets its counter
    back to zero, so every launch leaves them zero."""
    if not split_fits(tiles):
        raise ValueError(f"split K counts at most {MAX_TILES} output tiles, this product has {tiles}")
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def split_fits(tiles: int) -> bool:
    """Whether a launch of this many output tiles may split K (one counter per tile)."""
    return tiles <= MAX_TILES


def split_buffers(split_k: int, rows: int, width: int, tiles: int, out: Tensor,
                  norm_tiles: int = 0) -> tuple[Tensor, Tensor]:
    """Split K's float32 partials (``epilogue``'s layout: [split_k, rows, width], then, for a
    norm summed in the splits, [split_k, norm_tiles, rows] partial sums of squares) and a counter
    per output tile; without a split, ``out`` stands in for both (the kernel never reads them)."""
    if split_k == 1:
        return out, out
    size = split_k * rows * (width + norm_tiles)
    return (torch.empty(size, dtype=torch.float32, device=out.device),
            split_counters(tiles, out.device))


def check_prologue(norm: object, residual: object, sum_out: object, split_k: int,
                   norm_splits: bool = False) -> None:
    """The fused products' prologue takes a residual only before a norm, writing the rounded sum
    to sum_out. A product whose norm comes from its own loop needs whole rows of inputs (no split
    K) unless ``norm_splits``: the kernel normalises each row in a pass of its own
    (``torch_triton_gemv``), or adds each split's sum of squares in the epilogue
    (``torch_triton_rows``, ``epilogue``'s NORM_SPLIT), so it may split."""
    if residual is not None and (sum_out is None or norm is None):
        raise ValueError("a residual added in the prologue needs a norm, and sum_out for the sum")
    if norm is not None and split_k > 1 and not norm_splits:
        raise ValueError("a product with a norm in its prologue takes whole rows: split_k 1")


# The fused products' epilogue (``torch_triton_gemv`` and ``torch_quant_gemv``), with the roundings
# of the compiled layer functions (sums in float32, each product's output rounded to the compute
# dtype before it is used).


@triton.jit
def weight_tiles(rows, up_rows, k, n_ok, K, EVEN: tl.constexpr, GATED: tl.constexpr):
    """A product's tile of weights at inputs k of ``rows`` [BN, 1] pointers, and of ``up_rows``
    (GATED; else the same tile twice), masked to outputs n_ok and inputs below K."""
    ok = n_ok[:, None] & (k < K)[None, :]
    w = load(rows + k[None, :], ok, EVEN)
    u = w
    if GATED:
        u = load(up_rows + k[None, :], ok, EVEN)
    return w, u


@triton.jit
def finish(gate, up, n, n_ok, m, N, bias_ptr, add_ptr, out_ptr, dtype,
           HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ADD_OUT: tl.constexpr):
    """The epilogue of outputs n of row m: bias, rounding to the compute dtype, silu(gate) * up,
    the residual add; stored in the output's dtype."""
    if HAS_BIAS:
        gate += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
    y = gate.to(dtype).to(tl.float32)
    if GATED:
        u = up.to(dtype).to(tl.float32)
        y = (y * tl.sigmoid(y) * u).to(dtype).to(tl.float32)
    if ADD_OUT:
        y = (y + tl.load(add_ptr + m * N + n, mask=n_ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + m * N + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def epilogue(gate, up, n, n_ok, m, rows, tile, N, bias_ptr, add_ptr, out_ptr, partial_ptr,
             counters_ptr, dtype, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
             ADD_OUT: tl.constexpr, SPLIT_K: tl.constexpr, squares=0.0, K=1, eps=0.0,
             NORM_SPLIT: tl.constexpr = False):
    """``finish`` for a program of a grid (its tiles, splits, ...) holding the float32 sums (gate
    and up: GATED) of outputs n of rows m, one of ``rows`` rows the partials hold; ``tile``
    numbers its outputs-and-rows tile. Split K: partials [SPLIT_K, rows, (2) N] in float32; the
    tile's last program to finish (counted with an atomic) adds them in order and finishes.
    NORM_SPLIT: the sums are not yet normalised, and ``squares`` (shaped as m) holds the sum of
    squares of this split's inputs of each row; the partials keep them too, after the sums, per
    split and tile of outputs: [SPLIT_K, tiles of outputs, rows], so program axis 0 must number
    the tiles of outputs alone (as in ``torch_triton_rows``; ``split_buffers``' norm_tiles is
    that axis' size); the last program scales the added sums by each row's 1/rms over all K
    inputs."""
    pid_k = tl.program_id(1)
    if SPLIT_K == 1:
        finish(gate, up, n, n_ok, m, N, bias_ptr, add_ptr, out_ptr, dtype, HAS_BIAS, GATED, ADD_OUT)
    else:
        width = 2 * N if GATED else N
        part = partial_ptr + (pid_k * rows + m) * width + n
        tl.store(part, gate, mask=n_ok)
        if GATED:
            tl.store(part + N, up, mask=n_ok)
        if NORM_SPLIT:
            square_parts = partial_ptr + SPLIT_K * rows * width + tl.program_id(0) * rows + m
            n_tiles = tl.num_programs(0)
            tl.store(square_parts + pid_k * n_tiles * rows, squares)
        tl.debug_barrier()  # every thread's partial is issued before the count goes up
        done = tl.atomic_add(counters_ptr + tile, 1)  # acquire-release, GPU scope
        if done == SPLIT_K - 1:
            gate = tl.zeros_like(gate)
            up = tl.zeros_like(gate)
            for s in range(SPLIT_K):
                at = partial_ptr + (s * rows + m) * width + n
                gate += tl.load(at, mask=n_ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    up += tl.load(at + N, mask=n_ok, other=0.0, cache_modifier=".cg")
            if NORM_SPLIT:
                total = tl.zeros_like(squares)
                for s in range(SPLIT_K):
                    total += tl.load(square_parts + s * n_tiles * rows, cache_modifier=".cg")
                rstd = tl.rsqrt(total / K + eps)
                gate = gate * rstd
                up = up * rstd
            finish(gate, up, n, n_ok, m, N, bias_ptr, add_ptr, out_ptr, dtype, HAS_BIAS, GATED, ADD_OUT)
            tl.atomic_xchg(counters_ptr + tile, 0)  # ready for the next launch
