"""Triton kernels for weight-only int8 / int4 matrix products at decode sizes (GPU only).

Imported only where Triton is installed; ``torch_layers.kernel_weight`` imports it, which
registers the product as the operator ``torch.ops.tinyinfer.quant_matmul`` (opaque to
``torch.compile``, captured by CUDA graphs like any kernel).

A decode step multiplies a few rows of activations by every weight matrix once: its time is
the time to read the weights. These kernels read the stored codes and turn them into floats in
registers, so the weights cross memory at 4 or 8 bits and nothing is dequantized into a copy.
What they read (codes packed in 32-bit words, one formula for every format) and the float trick
that decodes a code are in ``quant_words``, with a NumPy twin of the arithmetic the tests pin
to ``tinyinfer.quant.dequantize``.

* **Two shapes of program.** One row of activations (batch-1 decode; two rows for int4, a
  program each) sums (BASE + code) * x per word in float32 and folds the scale and offset in
  per word; more rows dequantize a tile to the activations' dtype and run it through the
  matrix units (``tl.dot``), the rows padded to 16.
* **Columns by code.** A word's codes lie in one group (``quant_words``' layout: codes 2q and
  2q + 1 of a group's word i meet its inputs 2Wq + 2i and the next); the caller hands x over in
  float32 regrouped by code, the inputs that code j of every word meets side by side (one run
  of the row's words per code), plus each word's input sum (``torch_layers.kernel_inputs``,
  fused into the kernel that made x), so each of those loads is contiguous. The one-row int4
  program is bound by its instructions (a shift, a logic operation and a multiply-add per
  weight, 3.5-5 SASS instructions a weight all told): the glue kernel prepares x once, where a
  fused program would repeat that work in every thread holding another row
  (``torch_quant_gemv`` does, where it pays).
* **Tiles in flight.** A program's loop carries no loaded value over to the next step, and its
  ``tl.range`` names a pipeline depth, so Triton's software pipeliner issues the loads of the
  next two or three steps into shared memory while this one computes (it stages loads that feed
  no ``tl.dot`` only for a loop that names its depth). On cards of compute capability 9.0 on,
  the words come through a tensor descriptor: the copy engine moves whole tiles (TMA).
* **Split K.** A matrix with few output tiles (a small model's o projection) splits its inputs
  across programs; each writes a float32 partial sum, and the last program of a tile to finish
  (counted with an atomic) adds them up in a fixed order, writes the output and resets its
  counter.
* **Tiles** (``pick_config``) are the fastest measured on an H100: docs/quantization.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from tinyinfer.runners.quant_words import CODE_MASK, PER_WORD
from tinyinfer.runners.triton_common import (
    load,
    split_counters,
    split_fits,
    trip_count,
)
from tinyinfer.runners.triton_env import INTERPRETED

ELEMENTWISE_ROWS = {4: 2, 8: 1}  # up to this many rows of x: the elementwise program (a row each)
MAX_ROWS_PER_TILE = 64  # rows of activations one program multiplies (more rows: more programs)
MANY_OUTPUTS = 32768  # an int8 one-row product with this many outputs (an LM head; more than any
# layer product of the measured shapes, the 8B gate|up's 28,672) takes 16-row tiles


class Config(NamedTuple):
    """Tile sizes and launch options of one product."""

    block_n: int  # output rows (weight rows) per program
    block_k: int  # inputs per loop step
    split_k: int = 1  # programs sharing one tile's inputs
    num_warps: int = 4
    num_stages: int = 3  # tiles the loop keeps in flight (Triton's software pipeline)
    dot: bool = False  # the matrix-unit program (any number of rows) or the elementwise one (one row)
    tma: bool = False  # words through a tensor descriptor (the copy engine, compute capability 9.0 on)


@triton.jit
def decode_words(words, code_mask, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of every 32-bit word as float32 BASE + code: ``quant_words.decode`` in Triton.

    ``code_mask`` is CODE_MASK[BITS], passed at run time: with one of its two constants in a
    register, the mask and the exponent bits compile to one three-input logic instruction.
    """
    if BITS == 4:
        # nibble J -> mantissa bits 16..19 of 128.0, which count 1, 2, 4, 8
        if J < 4:
            shifted = words << (16 - 4 * J)
        elif J == 4:
            shifted = words
        else:
            shifted = words >> (4 * J - 16)  # arithmetic shift: the sign bits are masked off
        bits = (shifted & code_mask) | 0x43000000
    else:
        # byte J -> mantissa bits 15..22 of 256.0, its top (sign) bit flipped: 256 + (code + 128)
        if J < 2:
            shifted = words << (15 - 8 * J)
        else:
            shifted = words >> (8 * J - 15)
        bits = (shifted & code_mask) ^ 0x43C00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def word_tile(words_ptr, row_at, rows_ok, row0, block, kw, k_ok, BLOCK_N: tl.constexpr,
              GROUPS_PER_BLOCK: tl.constexpr, SPAN_WORDS: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr):
    """Loop step ``block``'s words of BLOCK_N rows as a [BLOCK_N, GROUPS_PER_BLOCK, SPAN_WORDS]
    tile: through the tensor descriptor ``words_ptr`` from row ``row0`` (TMA: rows and columns
    past the matrix read as zeros), else from the rows' pointers ``row_at`` [BN, 1, 1] at word
    columns ``kw`` [G, W]."""
    if TMA:
        words = tl.reshape(words_ptr.load([row0, block * GROUPS_PER_BLOCK * SPAN_WORDS]),
                           [BLOCK_N, GROUPS_PER_BLOCK, SPAN_WORDS])
    else:
        words = load(row_at + kw[None, :, :], rows_ok[:, None, None] & k_ok[None, :, :], EVEN)
    return words


@triton.jit
def scale_shift(scales_ptr, offsets_ptr, rows, rows_ok, block, g, num_groups, BLOCK_K: tl.constexpr,
                GROUP: tl.constexpr, BASE: tl.constexpr, ZERO: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                EVEN: tl.constexpr):
    """Each (row, group) of loop step ``block``: its scale and the shift that folds BASE, the zero
    point and the offset in (weight = (BASE + code) * scale + shift), float32 [BN, G]."""
    if GROUP > 0:
        group = block * BLOCK_K // GROUP + g  # [G]
    else:
        group = g  # [1], 0: one group per row (per-row int8)
    at = rows[:, None] * num_groups + group[None, :]  # [BN, G]
    ok = rows_ok[:, None] & (group < num_groups)[None, :]
    scale = load(scales_ptr + at, ok, EVEN).to(tl.float32)
    shift = -(BASE + ZERO) * scale
    if HAS_OFFSETS:
        shift += load(offsets_ptr + at, ok, EVEN).to(tl.float32)
    return scale, shift


@triton.jit
def group_words(block, g, w, BLOCK_WORDS: tl.constexpr, SPAN_WORDS: tl.constexpr, GROUP_WORDS: tl.constexpr,
                GROUP: tl.constexpr):
    """Where loop step ``block``'s [G, W] tile of words lies in its groups (``quant_words``'
    layout): each group's first input column [G, 1], and each word's place in its group [G, W]."""
    if GROUP == 0:  # one group per row, of GROUP_WORDS words
        return g[:, None] * 0, block * BLOCK_WORDS + w[None, :] + g[:, None] * 0
    elif SPAN_WORDS == GROUP_WORDS:  # whole groups in a step
        return (block * (BLOCK_WORDS // SPAN_WORDS) + g[:, None]) * GROUP, w[None, :] + g[:, None] * 0
    else:  # one group over several steps
        first = block * BLOCK_WORDS
        return (first // GROUP_WORDS) * GROUP + g[:, None] * 0, first % GROUP_WORDS + w[None, :] + g[:, None] * 0


@triton.jit
def _quant_matmul_kernel(
    x_ptr, xsum_ptr, words_ptr, scales_ptr, offsets_ptr, out_ptr, partial_ptr, counters_ptr,
    M, N, K, steps, code_mask, ROW_WORDS: tl.constexpr,
    INTERPRETED_STEPS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SPAN_WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, IEEE: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
):
    """out[M, N] = x @ W^T, W [N, K] from packed codes. Programs: (N tiles x M tiles, splits),
    the M tiles of one N tile side by side, so that they run together and the words the first
    reads from memory reach the others from L2.

    x comes in float32 as [M, PER, K / PER], x[m, j, i] the input code j of word i meets
    (``torch_layers.kernel_inputs``), so the inputs that meet code j of consecutive words lie
    together; xsum [M, K / PER] holds, per word, the sum of the inputs its codes meet, for the
    shift. A loop step reads BLOCK_K inputs of BLOCK_N rows as a [BLOCK_N, GROUPS_PER_BLOCK,
    SPAN_WORDS] tile of words: each (row, group) pair shares one scale and shift.
    """
    PER: tl.constexpr = 32 // BITS
    row_words = ROW_WORDS  # a constant: the inputs of code j sit at a fixed offset from code 0's
    BASE: tl.constexpr = 128 if BITS == 4 else 384
    BLOCK_WORDS: tl.constexpr = BLOCK_K // PER
    tile_id = tl.program_id(0)
    pid_k = tl.program_id(1)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n = tile_id // m_tiles
    pid_m = tile_id % m_tiles
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    g = tl.arange(0, GROUPS_PER_BLOCK)
    w = tl.arange(0, SPAN_WORDS)
    num_groups = K // GROUP if GROUP > 0 else 1  # GROUP 0: one group per row (per-row int8)
    first = pid_k * steps  # this program's loop steps: first .. first + steps
    row_at = words_ptr  # the words' descriptor (TMA), else the rows' pointers
    if not TMA:
        row_at = words_ptr + n[:, None, None] * row_words  # [BN, 1, 1]
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        flat = tl.arange(0, BLOCK_WORDS)  # the tile's words in (group, word) order
    else:
        acc = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, SPAN_WORDS], tl.float32)  # one row of x: pid_m
    # The loop carries no loaded value from one step to the next, so Triton's pipeliner can issue
    # the loads of STAGES - 1 steps ahead into shared memory (the num_stages of tl.range is what
    # makes it stage loads that feed no tl.dot).
    for step in tl.range(0, trip_count(steps, INTERPRETED_STEPS), num_stages=STAGES):
        block = first + step
        kw = block * BLOCK_WORDS + g[:, None] * SPAN_WORDS + w[None, :]  # [G, W] word columns
        k_ok = kw < row_words
        words = word_tile(words_ptr, row_at, n_ok, pid_n * BLOCK_N, block, kw, k_ok, BLOCK_N, GROUPS_PER_BLOCK,
                          SPAN_WORDS, EVEN, TMA)
        scale, shift = scale_shift(scales_ptr, offsets_ptr, n, n_ok, block, g, num_groups, BLOCK_K, GROUP, BASE,
                                   ZERO, HAS_OFFSETS, EVEN)
        if DOT:
            # weight = (BASE + code) * scale + shift, rounded to x's dtype, through the matrix units
            kx = block * BLOCK_WORDS + flat  # [BLOCK_WORDS] words, code j of each
            for j in tl.static_range(PER):
                weight = decode_words(words, code_mask, j, BITS) * scale[:, :, None] + shift[:, :, None]
                xt = tl.load(x_ptr + m[None, :] * K + j * row_words + kx[:, None],
                             mask=m_ok[None, :] & (kx < row_words)[:, None], other=0.0)  # [BW, BM]
                tile = tl.reshape(weight, [BLOCK_N, BLOCK_WORDS]).to(out_ptr.dtype.element_ty)
                if IEEE:
                    acc = tl.dot(tile, xt, acc, input_precision="ieee")
                else:
                    acc = tl.dot(tile, xt.to(out_ptr.dtype.element_ty), acc)
        else:
            # per word: (BASE + code) * x summed over its codes, then scale * that + shift * (its
            # inputs' sum): a shift, a logic operation and a multiply-add per weight
            row = x_ptr + pid_m * K + kw  # [G, W]: the input code 0 of each word meets
            part = decode_words(words, code_mask, 0, BITS) * load(row, k_ok, EVEN)[None, :, :]
            for j in tl.static_range(1, PER):
                xj = load(row + j * row_words, k_ok, EVEN)  # [G, W]
                part += decode_words(words, code_mask, j, BITS) * xj[None, :, :]
            xw = load(xsum_ptr + pid_m * row_words + kw, k_ok, EVEN)  # [G, W]
            acc += part * scale[:, :, None] + shift[:, :, None] * xw[None, :, :]
    if DOT:
        out_at = m[None, :] * N + n[:, None]  # [BN, BM]
        out_ok = n_ok[:, None] & m_ok[None, :]
        result = acc
    else:
        out_at = pid_m * N + n  # [BN]
        out_ok = n_ok
        result = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + out_at, result.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.store(partial_ptr + pid_k * M * N + out_at, result, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the count goes up
        done = tl.atomic_add(counters_ptr + tile_id, 1)  # acquire-release, GPU scope
        if done == SPLIT_K - 1:  # the last of the tile's programs adds the partials
            total = tl.zeros_like(result)
            for s in range(SPLIT_K):
                total += tl.load(partial_ptr + s * M * N + out_at, mask=out_ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(counters_ptr + tile_id, 0)  # ready for the next launch


def pick_config(m: int, n: int, k: int, bits: int, processors: int, tma: bool = False) -> Config:
    """Tiles for an [m, k] x [k, n] product, as measured fastest on an H100 (docs/quantization.md,
    ``scripts/gpu_quant_kernels.py --candidates``; ``tma``: the words may come through tensor
    descriptors). One row (two for int4): the elementwise program (``one_row_config``), K split
    only while the tiles leave multiprocessors idle. 3..16 rows: the matrix units, 64 weight rows by
    256 (int4) or 128 (int8) inputs, split K to about four programs per multiprocessor. More rows
    (prefill chunks): 64 x 128 tiles, whose float32 inputs fit shared memory three steps deep."""
    if m <= ELEMENTWISE_ROWS[bits]:
        return with_split(one_row_config(n, k, bits, tma), m, n, k, processors, programs_per_processor=1)
    if m <= 16:
        config = Config(64, 256 if bits == 4 else 128, num_stages=3, dot=True, tma=tma)
    else:
        config = Config(64, 128, num_stages=3, dot=True, tma=tma)
    return with_split(config, m, n, k, processors)


def one_row_config(n: int, k: int, bits: int, tma: bool) -> Config:
    """The elementwise program's tiles for an [n, k] weight, measured fastest on an H100 at the
    1B and 8B shapes (the int8 LM head: on an H200, and level on an H100; docs/quantization.md):
    two warps; int4 3 steps in flight, int8 4. For int4, 16 weight rows a program where there
    are many outputs (each program's per-step work, its loads and their waits, spread over more
    weights: inside the 8B int4 model's step, gate|up 26.3 against 28.0 us, the head 98.7
    against 111.3), else 8 rows by 512 inputs: the down products' long rows too (64 x 256 on
    four warps, split in four, was faster alone, 17.1 against 19.6 us, and slower inside the
    model's step, 17.6 against 17.1)."""
    if bits == 8:  # 16 x 512 for long rows (8B down 24.6 against 25.4 us) and a vocabulary's many
        # outputs (an H200's 8B LM head 122.0 against 140.8 us, 1B 68.3 against 79.9; level on an
        # H100), else 8 x 256 (the 1B gate|up 13.2 against 14.9 on the H200)
        wide = k >= 2 * n or n >= MANY_OUTPUTS
        return Config(16 if wide else 8, 512 if wide else 256, num_warps=2, num_stages=4, tma=tma)
    return Config(16 if n >= 8192 else 8, 512, num_warps=2, num_stages=3, tma=tma)


def with_split(config: Config, m: int, n: int, k: int, processors: int,
               programs_per_processor: int = 4) -> Config:
    """Split K in two, four, ... until there are about ``programs_per_processor`` programs per
    multiprocessor (while each split keeps two loop steps or more)."""
    tiles = triton.cdiv(n, config.block_n) * triton.cdiv(m, rows_per_tile(m, config))
    blocks = triton.cdiv(k, config.block_k)
    split = 1
    while tiles * split < programs_per_processor * processors and split * 2 <= blocks // 2 \
            and split_fits(tiles):
        split *= 2
    return config._replace(split_k=split)


def rows_per_tile(m: int, config: Config) -> int:
    """Rows of activations one program takes: one elementwise, else 16..64 (tl.dot's smallest
    tile is 16)."""
    if not config.dot:
        return 1
    return min(MAX_ROWS_PER_TILE, max(16, triton.next_power_of_2(m)))


_devices: dict[torch.device, tuple[int, bool]] = {}


def device_traits(device: torch.device) -> tuple[int, bool]:
    """(multiprocessors, whether its copy engine takes tensor descriptors: compute capability 9.0
    on). Off CUDA (Triton's CPU interpreter runs the kernels): one, and pointers."""
    if device.type != "cuda":
        return 1, False
    if device not in _devices:
        props = torch.cuda.get_device_properties(device)
        _devices[device] = (props.multi_processor_count, (props.major, props.minor) >= (9, 0))
    return _devices[device]


def tma_fits(words: Tensor) -> bool:
    """Whether a tensor descriptor can address the words: rows of whole 16 bytes, 16-byte aligned."""
    return words.is_contiguous() and words.shape[1] % 4 == 0 and words.data_ptr() % 16 == 0


def quant_matmul(x: Tensor, xsum: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None,
                 bits: int, group_size: int, zero: int, out_dtype: torch.dtype,
                 config: Config | None = None) -> Tensor:
    """x W^T for W packed as ``torch_layers.KernelWeight``, x and xsum as
    ``torch_layers.kernel_inputs`` gives them.

    x: float32 [M, 32 / bits, K bits / 32], xsum: float32 [M, K bits / 32]; words: int32 [N, K bits / 32];
    scales: float16 [N, groups]; offsets: None or [N, groups].  -> [M, N] in out_dtype.
    ``config`` overrides the tile choice (benchmarks sweep it).
    """
    m, k = x.shape[0], x.shape[1] * x.shape[2]
    n = words.shape[0]
    if config is None:
        processors, tma = device_traits(x.device)
        config = pick_config(m, n, k, bits, processors, tma and tma_fits(words))
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    block_m = rows_per_tile(m, config)
    grid = (triton.cdiv(n, config.block_n) * triton.cdiv(m, block_m), config.split_k)
    if config.split_k > 1:
        partial = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(grid[0], x.device)
    else:
        partial = counters = out  # unused
    # Inputs of one group inside a loop step; a row that is one group (per-row int8) is one
    # group in every step, whatever its width.
    span = config.block_k if group_size == k else min(group_size, config.block_k)
    blocks = triton.cdiv(k, config.block_k)
    steps = triton.cdiv(blocks, config.split_k)
    if config.tma:  # [BLOCK_N, BLOCK_WORDS] tiles of the words, loaded by the copy engine
        words = TensorDescriptor.from_tensor(words, [config.block_n, config.block_k // PER_WORD[bits]])
    _quant_matmul_kernel[grid](
        x.contiguous(), xsum.contiguous(), words, scales, scales if offsets is None else offsets, out,
        partial, counters, m, n, k, steps, CODE_MASK[bits], ROW_WORDS=k // PER_WORD[bits],
        INTERPRETED_STEPS=steps if INTERPRETED else 0, BITS=bits,
        GROUP=0 if group_size == k else group_size, ZERO=zero, HAS_OFFSETS=offsets is not None,
        SPAN_WORDS=span // PER_WORD[bits], GROUPS_PER_BLOCK=config.block_k // span,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, DOT=config.dot, IEEE=out_dtype == torch.float32,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0 and blocks % config.split_k == 0,
        STAGES=config.num_stages, TMA=config.tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


@torch.library.custom_op("tinyinfer::quant_matmul", mutates_args=())
def quant_matmul_op(x: Tensor, xsum: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None,
                    bits: int, group_size: int, zero: int, out_dtype: torch.dtype) -> Tensor:
    """``quant_matmul`` as an operator: torch.compile calls it as it is, without tracing into it."""
    return quant_matmul(x, xsum, words, scales, offsets, bits, group_size, zero, out_dtype)


@quant_matmul_op.register_fake
def _(x: Tensor, xsum: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None, bits: int,
      group_size: int, zero: int, out_dtype: torch.dtype) -> Tensor:
    return x.new_empty((x.shape[0], words.shape[0]), dtype=out_dtype)
