"""Triton matrix-vector products for batch-1 decoding, with each layer's glue fused in (GPU only).

Imported only where Triton is installed. At batch 1 a decode step is a chain of small kernels,
and a matrix of a 1B-parameter model (8-67 MB) is read in a few microseconds, so each kernel's
launch, ramp-up and tail cost as much as a third of its time. These kernels cut the chain to
four products per layer, each doing the work of the small kernels around it:

* ``attention_input``: the residual add and RMSNorm as the q|k|v product's prologue (every
  program recomputes the row's norm: a 2048-4096-vector, cheap next to its share of weights);
* ``mlp_block``: the o product adds its output to the residual stream (epilogue); gate|up
  normalises in its prologue and writes silu(gate) * up (each program reads the gate rows and
  the up rows of the same outputs); the down product is plain;
* ``final_logits``: the last residual add and norm before the LM head, float32 logits out;
* a tensor-parallel shard, whose o and down products end in an all-reduce, takes them plain
  (``gemv`` alone) and ``mlp_after_attention``: the all-reduced o output's residual add and the
  norm as the gate|up product's prologue.

Same contracts as ``torch_layers``' functions of those names, and the roundings they get
compiled (sums and norms in float32, each product's output rounded to the compute dtype before
it is used; silu(gate) * up rounded once, as inductor fuses it, where eager torch rounds
silu(gate) first), so the runner swaps one set for the other.

With programmatic dependent launch (the runner's ``pdl`` option, on by default on cards of
compute capability 9.0+; ``triton_common``) every kernel here, and the decode attention kernels
between them, are launched so that a kernel's programs start as the previous kernel's finish: a
product loads its first tile of weights, which no earlier kernel writes, before it waits for the
previous kernel's results (``gdc_wait``), so the launch gap and the ramp-up of the weight stream
overlap the previous kernel's tail (an H100: the 1B step 1.134 -> 1.072 ms, the 8B 5.705 -> 5.590).

Tiles (``pick_config``). A one-row product is a stream of weights with almost no arithmetic, so
what bounds it is the bytes in flight: HBM answers a load ~1 us after it is issued, and a
program issues its next tile only when the previous one has arrived. The small products -- a
tensor-parallel shard's (TP=4 of the 8B: q|k|v 1,536 x 4,096, o 4,096 x 1,024) and the 1B
model's, 8-13 MB each -- had few programs at 8 outputs each (192 for that q|k|v, on 132
multiprocessors), one 8 KB tile each in flight, and ran at 1.7-2.0 TB/s against 3.0 for a copy.
Measured on an H100 (``scripts/gpu_gemv_shapes.py``; docs/fast-path.md: each product 32 times
in a CUDA graph, ~1,000 tile choices over 20 products): 4 outputs a program (twice the
programs) and 1024 inputs a step (twice the bytes a load) did best for all but gate|up, which
reads two rows an output and takes 256 inputs a step with 4 warps (a TP=4 shard's gate|up
31.5 -> 22.0 us, the largest gain; a step's products at TP=4 1.72 -> 1.53 ms). A second tile in
flight (``ahead``, loaded before the wait for the previous kernel too) helped the products
without a norm; those with one gained as much from 8 warps instead (more programs fit beside
the row of inputs each holds for its norm) and the LM heads lost 1-5 % with it. The kind-based
tiles come within 3 % of the fastest tiles chosen per shape. The smallest products still run
near 2 TB/s: 1.5-2 us a kernel go to the wait, the norm, the last tile's latency and the final
sum, whatever the tiles. Splitting K across programs (``split_k``: the last program of a tile
to finish, counted with an atomic, adds the float32 partials in a fixed order) was slower at
every measured shape, the smallest included, so the runner never picks it; ``Config`` keeps it
for other shapes and the sweeps.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners.torch_layers import KernelWeight
from tinyinfer.runners.torch_quant_gemv import fused_gemv
from tinyinfer.runners.triton_common import (
    check_prologue,
    epilogue,
    finish,
    load,
    release_next,
    split_buffers,
    trip_count,
    wait_for_previous,
    weight_tiles,
)
from tinyinfer.runners.triton_env import INTERPRETED, launches_dependent, runs_kernels


# Steps of up to this many rows run a program per output tile that multiplies every row by the
# tile it reads (``_few_rows_kernel``); more rows, a program per row and tile (``_gemv_kernel``),
# though the runner sends 3..16 rows to the row kernel (torch_fast.FUSED_MAX_ROWS). Measured on an
# H100 (docs/fast-path.md): at 2 rows each product of the 8B shape 4-16 % faster than the row
# kernel (the largest as fast as at one row); from 3 rows on slower, whether the rows were one
# [rows, ...] tensor (5 or 8 rows up to twice as slow) or each row's sums a tensor of its own
# (the 8B verification of 4 drafted tokens 8.95 ms against 6.26); neither loop moves anything
# through shared memory (their compiled PTX), each issues one multiply-add per row and weight.
# Pairs of rows in programs side by side, each pair reading the tile again, did not find it in
# L2 often enough (5 rows: 19-856 us a product against 16-354).
FEW_ROWS = 2
FEW_ROWS_LANES = 8  # inputs a thread of the few-row program sums in registers a step (16 bytes of bf16)


class Config(NamedTuple):
    """Tile sizes and launch options of one product."""

    block_n: int  # outputs per program
    block_k: int  # inputs per loop step
    split_k: int = 1  # programs sharing one tile's inputs
    num_warps: int = 4
    ahead: int = 1  # weight tiles in flight while a step sums one (1 or 2; fewer if the steps are)


@triton.jit
def _accumulate(w, u, k, acc, acc_u, x_row, res_row, norm_ptr, rstd, K, dtype,
                NORM: tl.constexpr, ADD_RES: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr):
    """One loop step: inputs k of the row through the prologue, times the weight tiles w (and u,
    the up rows), summed into acc (acc_u) in float32."""
    k_ok = k < K
    xk = load(x_row + k, k_ok, EVEN).to(tl.float32)
    if NORM:
        if ADD_RES:
            xk = (xk + load(res_row + k, k_ok, EVEN).to(tl.float32)).to(dtype).to(tl.float32)
        xk = xk * rstd * load(norm_ptr + k, k_ok, EVEN).to(tl.float32)
        xk = xk.to(dtype).to(tl.float32)
    acc += w.to(tl.float32) * xk[None, :]
    if GATED:
        acc_u += u.to(tl.float32) * xk[None, :]
    return acc, acc_u


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, sum_ptr, norm_ptr, w_ptr, bias_ptr, add_ptr, out_ptr, partial_ptr, counters_ptr,
    N, K, steps, eps,
    NORM: tl.constexpr, ADD_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ADD_OUT: tl.constexpr, K_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, AHEAD: tl.constexpr, INTERPRETED_STEPS: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = epilogue(sum_k W[n, k] prologue(x[m])[k]). Programs: (N tiles, splits, rows).

    Prologue (NORM): x + res rounded (ADD_RES; the first program writes it to sum_ptr), then
    RMSNorm with weights norm_ptr, rounded. GATED: W has 2N rows, gate rows then up rows.
    AHEAD (1 or 2, at most ``steps``): weight tiles in flight while a step computes."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    dtype = w_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    first = pid_k * steps * BLOCK_K + kk  # this program's inputs: its first step's
    rows = w_ptr + n[:, None] * K  # [BN, 1]
    up_rows = rows + N * K
    # The first AHEAD tiles of weights, which no earlier kernel writes, before waiting for that kernel.
    w, u = weight_tiles(rows, up_rows, first, n_ok, K, EVEN, GATED)
    if AHEAD == 2:
        w1, u1 = weight_tiles(rows, up_rows, first + BLOCK_K, n_ok, K, EVEN, GATED)
    wait_for_previous(PDL)
    x_row = x_ptr + m * K
    res_row = res_ptr + m * K
    rstd = 0.0
    if NORM:
        full = tl.arange(0, K_P)
        xf = tl.load(x_row + full, mask=full < K, other=0.0).to(tl.float32)
        if ADD_RES:
            xf = (xf + tl.load(res_row + full, mask=full < K, other=0.0).to(tl.float32))
            xf = xf.to(dtype).to(tl.float32)
            writer = (pid_n == 0) & (pid_k == 0)
            tl.store(sum_ptr + m * K + full, xf.to(dtype), mask=(full < K) & writer)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    # Each step loads the tile AHEAD steps on, then sums the oldest one in flight; the last
    # AHEAD steps, whose tiles are all loaded, are peeled off the loop.
    for step in range(0, trip_count(steps, INTERPRETED_STEPS) - AHEAD):
        k = first + step * BLOCK_K
        w_next, u_next = weight_tiles(rows, up_rows, k + AHEAD * BLOCK_K, n_ok, K, EVEN, GATED)
        acc, acc_u = _accumulate(w, u, k, acc, acc_u, x_row, res_row, norm_ptr, rstd, K, dtype,
                                 NORM, ADD_RES, GATED, EVEN)
        if AHEAD == 2:
            w = w1
            u = u1
            w1 = w_next
            u1 = u_next
        else:
            w = w_next
            u = u_next
    last = first + (steps - AHEAD) * BLOCK_K
    acc, acc_u = _accumulate(w, u, last, acc, acc_u, x_row, res_row, norm_ptr, rstd, K, dtype,
                             NORM, ADD_RES, GATED, EVEN)
    if AHEAD == 2:
        acc, acc_u = _accumulate(w1, u1, last + BLOCK_K, acc, acc_u, x_row, res_row, norm_ptr, rstd,
                                 K, dtype, NORM, ADD_RES, GATED, EVEN)
    release_next(PDL)  # the next kernel may launch now: its first tiles of weights load under this tail
    gate = tl.sum(acc, 1)
    up = gate
    if GATED:
        up = tl.sum(acc_u, 1)
    epilogue(gate, up, n, n_ok, m, tl.num_programs(2), m * tl.num_programs(0) + pid_n, N,
             bias_ptr, add_ptr, out_ptr, partial_ptr, counters_ptr, dtype, HAS_BIAS, GATED, ADD_OUT,
             SPLIT_K)


@triton.jit
def _few_accumulate(w, u, k, acc, acc_u, x_rows, res_rows, r_ok, norm_ptr, rstd, K, dtype,
                    NORM: tl.constexpr, ADD_RES: tl.constexpr, GATED: tl.constexpr,
                    EVEN: tl.constexpr, EVEN_ROWS: tl.constexpr, LANES: tl.constexpr):
    """``_accumulate`` for the rows ``x_rows`` [R, 1] at once: inputs k [BK] of each row through
    the prologue (the same roundings), times the weight tiles w (and u) [BN, BK], summed into
    acc (acc_u) [R, BN, BK] in float32."""
    ok = r_ok[:, None] & (k < K)[None, :]
    xk = load(x_rows + k[None, :], ok, EVEN_ROWS).to(tl.float32)  # [R, BK]
    if NORM:
        if ADD_RES:
            xk = (xk + load(res_rows + k[None, :], ok, EVEN_ROWS).to(tl.float32)).to(dtype).to(tl.float32)
        xk = xk * rstd[:, None] * load(norm_ptr + k, k < K, EVEN).to(tl.float32)[None, :]
        xk = xk.to(dtype).to(tl.float32)
    # Each thread sums runs of LANES neighbouring inputs in its registers at once, so the float32
    # sums kept across steps are LANES times fewer than the products of a step.
    xs = tl.reshape(xk, [xk.shape[0], 1, xk.shape[1] // LANES, LANES])
    acc += tl.sum(tl.reshape(w.to(tl.float32), [1, w.shape[0], w.shape[1] // LANES, LANES]) * xs, 3)
    if GATED:
        acc_u += tl.sum(tl.reshape(u.to(tl.float32), [1, u.shape[0], u.shape[1] // LANES, LANES]) * xs, 3)
    return acc, acc_u


@triton.jit
def _few_rows_kernel(
    x_ptr, res_ptr, sum_ptr, norm_ptr, w_ptr, bias_ptr, add_ptr, out_ptr,
    M, N, K, steps, eps,
    NORM: tl.constexpr, ADD_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ADD_OUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRETED_STEPS: tl.constexpr, EVEN: tl.constexpr, EVEN_ROWS: tl.constexpr, LANES: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_gemv_kernel``'s product for M <= ROWS rows at once: each program reads its tile of
    weights once and multiplies it by every row (two sequences decoding, the verification of one
    drafted token), where ``_gemv_kernel`` runs a program per row, each reading the weights again.
    Programs: N tiles. A norm takes a pass of its own over the rows' inputs first (a program does
    not hold whole rows at once), the same sums as ``_gemv_kernel``'s; EVEN_ROWS: EVEN, and
    M == ROWS (no row to mask)."""
    pid_n = tl.program_id(0)
    dtype = w_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    r = tl.arange(0, ROWS)
    r_ok = r < M
    rows = w_ptr + n[:, None] * K  # [BN, 1]
    up_rows = rows + N * K
    # the first tile of weights, which no earlier kernel writes, before waiting for that kernel
    w, u = weight_tiles(rows, up_rows, kk, n_ok, K, EVEN, GATED)
    wait_for_previous(PDL)
    x_rows = x_ptr + r[:, None] * K  # [R, 1]
    res_rows = res_ptr + r[:, None] * K
    rstd = tl.zeros([ROWS], tl.float32)
    if NORM:
        squares = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for step in range(0, trip_count(steps, INTERPRETED_STEPS)):
            k = step * BLOCK_K + kk
            ok = r_ok[:, None] & (k < K)[None, :]
            xk = load(x_rows + k[None, :], ok, EVEN_ROWS).to(tl.float32)
            if ADD_RES:
                xk = (xk + load(res_rows + k[None, :], ok, EVEN_ROWS).to(tl.float32)).to(dtype).to(tl.float32)
                tl.store(sum_ptr + r[:, None] * K + k[None, :], xk.to(dtype), mask=ok & (pid_n == 0))
            squares += xk * xk
        rstd = tl.rsqrt(tl.sum(squares, 1) / K + eps)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // LANES], tl.float32)
    acc_u = tl.zeros([ROWS, BLOCK_N, BLOCK_K // LANES], tl.float32)
    # Each step loads the next tile, then sums this one; the last step is peeled off the loop.
    for step in range(0, trip_count(steps, INTERPRETED_STEPS) - 1):
        k = step * BLOCK_K + kk
        w_next, u_next = weight_tiles(rows, up_rows, k + BLOCK_K, n_ok, K, EVEN, GATED)
        acc, acc_u = _few_accumulate(w, u, k, acc, acc_u, x_rows, res_rows, r_ok, norm_ptr, rstd, K,
                                     dtype, NORM, ADD_RES, GATED, EVEN, EVEN_ROWS, LANES)
        w = w_next
        u = u_next
    acc, acc_u = _few_accumulate(w, u, (steps - 1) * BLOCK_K + kk, acc, acc_u, x_rows, res_rows, r_ok,
                                 norm_ptr, rstd, K, dtype, NORM, ADD_RES, GATED, EVEN, EVEN_ROWS, LANES)
    release_next(PDL)  # the next kernel may launch now: its first tiles of weights load under this tail
    gate = tl.sum(acc, 2)  # [R, BN]
    up = gate
    if GATED:
        up = tl.sum(acc_u, 2)
    finish(gate, up, n[None, :], r_ok[:, None] & n_ok[None, :], r[:, None], N, bias_ptr, add_ptr,
           out_ptr, dtype, HAS_BIAS, GATED, ADD_OUT)


def pick_config(gated: bool, norm: bool = False, rows: int = 1) -> Config:
    """The tiles by the product's kind and its rows, whatever its shape.

    One row: the fastest measured on an H100 at batch 1 over the 1B and 8B shapes and the 8B's
    TP=2 and TP=4 shards (module docstring). 4 outputs a program, so that even a TP=4 shard's
    1,536 q|k|v rows make 384 programs; gated products 256 inputs a step (each step reads a gate
    and an up tile); products with a norm in their prologue 1024 with 8 warps (their programs
    also hold a row's inputs for the norm); the others 1024 with two tiles in flight. Never split
    K (slower at every measured shape).

    2..FEW_ROWS rows (``_few_rows_kernel``): 1024 inputs a step, 4 outputs a program (gated
    products 2: each reads a gate and an up tile), the fastest of a sweep at 2 rows."""
    if rows > 1:
        return Config(2 if gated else 4, 1024)
    if gated:
        return Config(4, 256)
    if norm:
        return Config(4, 1024, num_warps=8)
    return Config(4, 1024, ahead=2)


def gemv(x: Tensor, weight: Tensor | KernelWeight, bias: Tensor | None = None, *, norm: Tensor | None = None,
         residual: Tensor | None = None, sum_out: Tensor | None = None, eps: float = 0.0,
         gated: bool = False, add: Tensor | None = None, out_dtype: torch.dtype | None = None,
         config: Config | None = None) -> Tensor:
    """One product with its prologue and epilogue.  x: [M, K], weight: [N, K] ([2N, K] when
    gated: gate rows, then up rows), bias: [N] ([2N]) -> [M, N] in out_dtype (x's by default).

    norm [K]: x is RMS-normalised (eps) with these weights first, after adding ``residual``
    [M, K], whose rounded sum with x is written to ``sum_out`` [M, K]. gated: silu(gate) * up.
    add [M, N]: added to the output (a residual add). ``config`` overrides the tile choice.
    A weight in the Triton kernels' int8 / int4 layout goes to ``torch_quant_gemv.fused_gemv``
    (same contract, the codes read as stored)."""
    if isinstance(weight, KernelWeight):
        if config is not None:
            raise ValueError("config holds a 16-bit product's tiles: a quantized weight's product "
                             "picks its own (torch_quant_gemv.pick_config)")
        return fused_gemv(x, weight, bias, norm=norm, residual=residual, sum_out=sum_out, eps=eps, gated=gated,
                          add=add, out_dtype=out_dtype)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if config is None:
        config = pick_config(gated, norm is not None, m if m <= FEW_ROWS else 1)
    check_prologue(norm, residual, sum_out, config.split_k, norm_splits=True)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if 1 < m <= FEW_ROWS and config.split_k == 1:
        return _few_rows(x, weight, bias, norm, residual, sum_out, eps, gated, add, out, config)
    grid = (triton.cdiv(n, config.block_n), config.split_k, m)
    partial, counters = split_buffers(config.split_k, m, 2 * n if gated else n, grid[0] * grid[2], out)
    blocks = triton.cdiv(k, config.block_k)
    steps = triton.cdiv(blocks, config.split_k)
    if config.ahead not in (1, 2):
        raise ValueError(f"ahead is 1 or 2 tiles, not {config.ahead}")
    pdl = launches_dependent(x.device)
    unused = out
    _gemv_kernel[grid](
        x, unused if residual is None else residual, unused if sum_out is None else sum_out,
        unused if norm is None else norm, weight, unused if bias is None else bias,
        unused if add is None else add, out, partial, counters, n, k, steps, eps,
        NORM=norm is not None, ADD_RES=residual is not None, HAS_BIAS=bias is not None,
        GATED=gated, ADD_OUT=add is not None, K_P=triton.next_power_of_2(k),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        AHEAD=min(config.ahead, steps), INTERPRETED_STEPS=steps if INTERPRETED else 0,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0 and blocks % config.split_k == 0,
        PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


def _few_rows(x: Tensor, weight: Tensor, bias: Tensor | None, norm: Tensor | None,
              residual: Tensor | None, sum_out: Tensor | None, eps: float, gated: bool,
              add: Tensor | None, out: Tensor, config: Config) -> Tensor:
    """``gemv`` of 2..FEW_ROWS rows through ``_few_rows_kernel`` (a program per output tile,
    every row), into ``out``."""
    (m, k), n = x.shape, out.shape[1]
    if config.block_k % FEW_ROWS_LANES:
        raise ValueError(f"the few-row program sums runs of {FEW_ROWS_LANES} inputs: block_k "
                         f"{config.block_k} must be a multiple of it")
    rows = triton.next_power_of_2(m)
    steps = triton.cdiv(k, config.block_k)
    even = n % config.block_n == 0 and k % config.block_k == 0
    pdl = launches_dependent(x.device)
    _few_rows_kernel[(triton.cdiv(n, config.block_n),)](
        x, out if residual is None else residual, out if sum_out is None else sum_out,
        out if norm is None else norm, weight, out if bias is None else bias,
        out if add is None else add, out, m, n, k, steps, eps,
        NORM=norm is not None, ADD_RES=residual is not None, HAS_BIAS=bias is not None,
        GATED=gated, ADD_OUT=add is not None, ROWS=rows, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, INTERPRETED_STEPS=steps if INTERPRETED else 0, EVEN=even,
        EVEN_ROWS=even and m == rows, LANES=FEW_ROWS_LANES, PDL=pdl, num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    return out


# The layer functions: torch_layers' contracts, for RMSNorm models with a gated MLP
# (``applies``). Biases are taken where they exist (q|k|v of Qwen2).


def applies(gated: bool, norm_biases: list[Tensor | None], weights: list[object]) -> bool:
    """Whether a model can run these kernels: a gated MLP, RMSNorm (no norm biases), and every
    product's weight where the kernels run (``triton_env.runs_kernels``), a plain tensor in
    float16 or bfloat16 or int8 / int4 in the Triton kernels' layout (``KernelWeight``). Under
    Triton's CPU interpreter float32 CPU tensors too: there the tests check the kernels'
    arithmetic against the torch path's float32."""
    def fits(w: object) -> bool:
        if isinstance(w, KernelWeight):
            return runs_kernels(w.words.device)
        if not isinstance(w, Tensor) or not runs_kernels(w.device):
            return False
        interpreted_cpu = INTERPRETED and w.device.type == "cpu"
        return w.dtype in (torch.float16, torch.bfloat16) or (interpreted_cpu and w.dtype == torch.float32)

    return gated and all(b is None for b in norm_biases) and all(fits(w) for w in weights)


def attention_input(x: Tensor, residual: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                    qkv_w: Tensor, qkv_b: Tensor | None, eps: float, *,
                    product: Callable[..., Tensor] = gemv) -> tuple[Tensor, Tensor]:
    """``torch_layers.attention_input`` in one kernel: x + residual, RMSNorm, q|k|v product.
    ``product``: gemv's contract (``torch_triton_rows.rows_product``: batch-invariant rows)."""
    total = torch.empty_like(x)
    qkv = product(x, qkv_w, qkv_b, norm=norm_w, residual=residual, sum_out=total, eps=eps)
    return total, qkv


def mlp_block(x: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, norm_w: Tensor,
              norm_b: Tensor | None, in_w: Tensor, in_b: Tensor | None, out_w: Tensor,
              out_b: Tensor | None, eps: float, gated: bool, *,
              product: Callable[..., Tensor] = gemv) -> tuple[Tensor, Tensor]:
    """``torch_layers.mlp_block`` (gated) in three kernels: o product + residual add; RMSNorm,
    gate|up product, silu(gate) * up; down product."""
    x = product(attn, o_w, o_b, add=x)
    h = product(x, in_w, in_b, norm=norm_w, eps=eps, gated=True)
    return x, product(h, out_w, out_b)


def mlp_after_attention(x: Tensor, attn_out: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                        in_w: Tensor, in_b: Tensor | None, out_w: Tensor, out_b: Tensor | None,
                        eps: float, gated: bool, *,
                        product: Callable[..., Tensor] = gemv) -> tuple[Tensor, Tensor]:
    """A tensor-parallel shard's MLP (``tp.shard.mlp_after_attention``: its o product ends in an
    all-reduce, not in the residual add) in two kernels: the all-reduced attention output added
    to the residual stream and RMSNorm as the gate|up product's prologue, silu(gate) * up; the
    down product, plain (its partial sum is all-reduced next)."""
    total = torch.empty_like(x)
    h = product(x, in_w, in_b, norm=norm_w, residual=attn_out, sum_out=total, eps=eps, gated=True)
    return total, product(h, out_w, out_b)


def final_logits(x: Tensor, residual: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                 head: Tensor, eps: float, *, product: Callable[..., Tensor] = gemv) -> Tensor:
    """``torch_layers.final_logits`` in one kernel: last residual add, RMSNorm, LM head, float32."""
    return product(x, head, norm=norm_w, residual=residual, sum_out=torch.empty_like(x), eps=eps,
                   out_dtype=torch.float32)
