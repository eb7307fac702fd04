"""Batch-invariant fused decode products for any number of rows, on the matrix units (GPU only).

Imported only where Triton is installed. A verification step scores k + 1 tokens of a sequence
at once; for speculative greedy decoding to give plain greedy decoding's tokens in bf16, every
row of that step must be computed exactly as the same token's plain one-row step computes it.
cuBLAS picks its kernel, its tiles and its split of the reduction by the number of rows, so a
row's rounding depends on how many rows share the step. Here nothing does:

* a program takes (a tile of outputs, a share of the inputs, a tile of 16 rows) and streams its
  weight tile once, multiplying it by all 16 rows on the matrix units with ``tl.dot``, swapped
  (out^T = W_tile @ x^T, so the weights fill the MMA's rows and the few token rows its columns);
  rows past the step's M are zeros that are never stored, and rows past 16 (a verification of
  16 drafted tokens has 17) are a second row tile running the same code;
* an MMA computes each output element from its own row and column alone, in an order fixed by
  the instruction, so a row's results do not depend on the other rows' values or on its place
  in the tile; tiles, splits, warps and pipeline depth depend on the product's shape only,
  never on M: one compiled kernel, one order of every sum, whatever M is;
* the epilogues are ``triton_common``'s (bias, residual add, SiLU·mul, float32 logits);
  the prologue adds the residual and applies RMSNorm, but as 1/rms times the product of the
  weights with round(x * g) rather than the product with round(x * g / rms): the sum of squares
  is taken in the product's own loop, so no program walks its rows' inputs twice (a separate
  pass cost up to 6 us per product at one row). A product may split K as ``torch_triton_gemv``
  does, adding float32 partials in a fixed order (a ``Config`` with split_k > 1), a product with
  a norm too: each split sums the squares of its share of the inputs, and the tile's last
  program adds them with the partials and scales the sums by 1/rms (``pick_config`` splits the
  q|k|v products, which have too few tiles of outputs to fill the card, and the down products).

The decode attention kernel already computes a row the same way whatever q is, and embedding,
RoPE and the greedy argmax are per row, so a verification step through these products gives
the logits of plain one-row steps through them bit for bit (``tests/test_rows_kernel.py``;
``scripts/gpu_rows_check.py`` on a GPU).

Why one-row steps keep ``torch_triton_gemv`` by default: at one row this kernel multiplies 15
rows of zeros besides the real one, which the matrix units make nearly free, but it normalises
a [BLOCK_K, 16] tile of x in every program (as much arithmetic as a 16-output weight tile, hence
64 outputs a program for products with a norm, and fewer programs) and its small products run
further from the copy bandwidth. Measured on an H100 (docs/fast-path.md), a one-row step takes
11-12 % (1B shape) and 5 % (8B) longer than through the matrix-vector kernels, far from the 2 %
that would have made it the one path; so the runner's ``batch_invariant`` option sends one-row
steps here too, for exactness, and by default only steps of 3..16 rows (one row tile) come here
(two rows run ``torch_triton_gemv``'s few-row program, which reads the weights once too).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners import torch_triton_gemv as gemv_kernels
from tinyinfer.runners.triton_common import (
    check_prologue,
    epilogue,
    load,
    release_next,
    split_buffers,
    trip_count,
    wait_for_previous,
    weight_tiles,
)
from tinyinfer.runners.triton_env import INTERPRETED, launches_dependent

ROWS = 16  # rows a program multiplies: tl.dot's smallest dimension


class Config(NamedTuple):
    """Tile sizes and launch options of one product (never chosen by the number of rows)."""

    block_n: int  # outputs per program (>= 16)
    block_k: int  # inputs per loop step (>= 16)
    split_k: int = 1  # programs sharing one tile's inputs
    num_warps: int = 4
    stages: int = 0  # 0: the next weight tile in registers; n: Triton's pipeline, n - 1 in flight


@triton.jit
def _accumulate(w, u, k, acc, acc_u, squares, r, r_ok, x_cols, res_cols, norm_ptr, sum_ptr, K, writer,
                dtype, NORM: tl.constexpr, ADD_RES: tl.constexpr, GATED: tl.constexpr,
                EVEN: tl.constexpr):
    """One loop step: this step's inputs k of the 16 rows (x^T, [BK, 16]) through the prologue,
    multiplied by the weight tiles w (and u, the up rows) on the matrix units."""
    k_ok = k < K
    ok = k_ok[:, None] & r_ok[None, :]
    xt = tl.load(x_cols + k[:, None], mask=ok, other=0.0)  # [BK, 16]
    if NORM:
        xf = xt.to(tl.float32)
        if ADD_RES:
            xf = (xf + tl.load(res_cols + k[:, None], mask=ok, other=0.0).to(tl.float32))
            xf = xf.to(dtype).to(tl.float32)
            tl.store(sum_ptr + r[None, :] * K + k[:, None], xf.to(dtype), mask=ok & writer)
        squares += tl.sum(xf * xf, 0)
        xt = xf * load(norm_ptr + k, k_ok, EVEN).to(tl.float32)[:, None]
    xt = xt.to(dtype)
    acc = tl.dot(w, xt, acc, input_precision="ieee")  # [BN, 16]
    if GATED:
        acc_u = tl.dot(u, xt, acc_u, input_precision="ieee")
    return acc, acc_u, squares


@triton.jit
def _rows_kernel(
    x_ptr, res_ptr, sum_ptr, norm_ptr, w_ptr, bias_ptr, add_ptr, out_ptr, partial_ptr, counters_ptr,
    M, N, K, steps, eps,
    NORM: tl.constexpr, ADD_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ADD_OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NORM_SPLIT: tl.constexpr, STAGES: tl.constexpr, INTERPRETED_STEPS: tl.constexpr,
    EVEN: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = epilogue(sum_k W[n, k] prologue(x[m])[k]) for the 16 rows m of this program's
    row tile. Programs: (N tiles, splits, row tiles). Epilogue as ``_gemv_kernel``'s; the
    prologue's RMSNorm (NORM) scales by each row's 1/rms after the product:
    sum_k W[n, k] round(x[k] g[k]) / rms, the sum of squares taken in the same loop (split K:
    each split's, added by the epilogue's last program with the partial sums, NORM_SPLIT)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    dtype = w_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    r = pid_m * 16 + tl.arange(0, 16)  # this tile's rows
    r_ok = r < M
    kk = tl.arange(0, BLOCK_K)
    first = pid_k * steps * BLOCK_K  # this program's inputs: first .. first + steps * BLOCK_K
    rows = w_ptr + n[:, None] * K  # [BN, 1]
    up_rows = rows + N * K
    x_cols = x_ptr + r[None, :] * K  # [1, 16]: x^T's columns are the rows
    res_cols = res_ptr + r[None, :] * K
    writer = pid_n == 0  # writes the rounded residual sum of its inputs (ADD_RES)
    # The first tile of weights, which no earlier kernel writes, before waiting for that kernel.
    k = first + kk
    w, u = weight_tiles(rows, up_rows, k, n_ok, K, EVEN, GATED)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    acc_u = tl.zeros([BLOCK_N, 16], tl.float32)
    squares = tl.zeros([16], tl.float32)
    total = trip_count(steps, INTERPRETED_STEPS)
    if STAGES == 0:
        # the next step's weights in registers while this step computes (the last step reads
        # its own tile again rather than test a mask)
        for step in range(total):
            k = first + step * BLOCK_K + kk
            ahead = k + BLOCK_K * (step + 1 < steps).to(tl.int32)
            w_next, u_next = weight_tiles(rows, up_rows, ahead, n_ok, K, EVEN, GATED)
            acc, acc_u, squares = _accumulate(w, u, k, acc, acc_u, squares, r, r_ok, x_cols,
                                              res_cols, norm_ptr, sum_ptr, K, writer, dtype,
                                              NORM, ADD_RES, GATED, EVEN)
            w = w_next
            u = u_next
    else:
        # the first step on the tile loaded above; the rest through Triton's software pipeline,
        # STAGES - 1 steps' tiles in flight into shared memory
        acc, acc_u, squares = _accumulate(w, u, k, acc, acc_u, squares, r, r_ok, x_cols, res_cols,
                                          norm_ptr, sum_ptr, K, writer, dtype, NORM, ADD_RES,
                                          GATED, EVEN)
        for step in tl.range(1, total, num_stages=STAGES):
            k = first + step * BLOCK_K + kk
            w, u = weight_tiles(rows, up_rows, k, n_ok, K, EVEN, GATED)
            acc, acc_u, squares = _accumulate(w, u, k, acc, acc_u, squares, r, r_ok, x_cols,
                                              res_cols, norm_ptr, sum_ptr, K, writer, dtype,
                                              NORM, ADD_RES, GATED, EVEN)
    release_next(PDL)  # the next kernel may launch now: its first tile of weights loads under this tail
    row_squares = squares[None, :]  # [1, 16]: of this program's inputs (NORM)
    if NORM and not NORM_SPLIT:
        rstd = tl.rsqrt(row_squares / K + eps)
        acc = acc * rstd
        acc_u = acc_u * rstd
    m = r[None, :]  # [1, 16] against n [BN, 1]: the elementwise epilogue on the tile
    nn = n[:, None]
    ok = n_ok[:, None] & r_ok[None, :]
    # partials of every row tile's 16 rows: [SPLIT_K, row tiles * 16, (2) N]; split under a norm,
    # the last program of a tile normalises the added sums
    epilogue(acc, acc_u, nn, ok, m, tl.num_programs(2) * 16, pid_m * tl.num_programs(0) + pid_n, N,
             bias_ptr, add_ptr, out_ptr, partial_ptr, counters_ptr, dtype, HAS_BIAS, GATED, ADD_OUT,
             SPLIT_K, row_squares, K, eps, NORM_SPLIT)


def pick_config(n: int, k: int, gated: bool, norm: bool = False) -> Config:
    """Tiles by the product's shape alone, never by its rows: among the fastest measured on an
    H100 at the 1B and 8B shapes, at 1 and 5 rows alike (docs/fast-path.md). A product with
    RMSNorm in its prologue normalises a [BLOCK_K, 16] tile of x per step, as much arithmetic as
    its weight tile at 16 outputs, so it takes 64 outputs a program and short steps. A q|k|v
    product has too few such tiles to fill the card (96 at 8B, 48 at 1B), so its inputs are split
    among up to 4 programs a tile (192 programs at both shapes); the long rows of a down product
    take 64 outputs split in 4 (faster at 1B, as fast at 8B); the rest take 16 x 512."""
    if norm and gated:
        return Config(64, 128) if k >= 4096 else Config(64, 64, stages=4)
    if norm and n > 32768:  # an LM head
        return Config(64, 128)
    if norm:  # q|k|v
        split = min(4, triton.cdiv(k, 64), max(1, 256 // triton.cdiv(n, 64)))
        return Config(64, 64, split, stages=4)
    return Config(64, 64, 4, stages=4) if k > 4096 else Config(16, 512)


def rows_product(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, norm: Tensor | None = None,
                 residual: Tensor | None = None, sum_out: Tensor | None = None, eps: float = 0.0,
                 gated: bool = False, add: Tensor | None = None, out_dtype: torch.dtype | None = None,
                 config: Config | None = None) -> Tensor:
    """``torch_triton_gemv.gemv``'s contract, batch-invariant: x [M, K] (any M; 16 rows a
    program), weight [N, K] ([2N, K] gated) -> [M, N]; a row's result does not depend on M."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if config is None:
        config = pick_config(n, k, gated, norm is not None)
    check_prologue(norm, residual, sum_out, config.split_k, norm_splits=True)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k, triton.cdiv(m, ROWS))
    partial, counters = split_buffers(config.split_k, grid[2] * ROWS, 2 * n if gated else n,
                                      grid[0] * grid[2], out, grid[0] if norm is not None else 0)
    blocks = triton.cdiv(k, config.block_k)
    steps = triton.cdiv(blocks, config.split_k)
    pdl = launches_dependent(x.device)
    unused = out
    _rows_kernel[grid](
        x, unused if residual is None else residual, unused if sum_out is None else sum_out,
        unused if norm is None else norm, weight, unused if bias is None else bias,
        unused if add is None else add, out, partial, counters, m, n, k, steps, eps,
        NORM=norm is not None, ADD_RES=residual is not None, HAS_BIAS=bias is not None,
        GATED=gated, ADD_OUT=add is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, NORM_SPLIT=norm is not None and config.split_k > 1,
        STAGES=config.stages, INTERPRETED_STEPS=steps if INTERPRETED else 0,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0 and blocks % config.split_k == 0,
        PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


# torch_layers' contracts, as torch_triton_gemv's layer functions, with every product batch-invariant.
attention_input = functools.partial(gemv_kernels.attention_input, product=rows_product)
mlp_block = functools.partial(gemv_kernels.mlp_block, product=rows_product)
mlp_after_attention = functools.partial(gemv_kernels.mlp_after_attention, product=rows_product)
final_logits = functools.partial(gemv_kernels.final_logits, product=rows_product)
