"""The fused batch-1 decode products with int8 / int4 weights (GPU only).

``torch_triton_gemv``'s products, prologue and epilogue included, for a weight stored as
``torch_layers.KernelWeight``: ``torch_triton_gemv.gemv`` hands such a weight here, so its layer
functions (q|k|v with the residual add and RMSNorm before it, o with the residual add after it,
gate|up with RMSNorm before and silu(gate) * up after, down, the LM head) serve bf16 and
quantized models alike. The product is ``torch_quant_kernel``'s one-row program (codes read as
32-bit words and turned into floats by ``decode_words``, a scale and a shift per word), with
what the runner otherwise runs as kernels of its own moved inside:

* **Inputs straight from x.** ``quant_words``' layout puts a word's codes in one group, codes
  2q and 2q + 1 of a group's word i on its inputs 2Wq + 2i and the next, so a program reads the
  inputs its words meet from x as the previous kernel wrote it: per group and pair, a contiguous
  run of 32-bit words of two 16-bit inputs (Triton's pipeliner copies 4-byte loads into shared
  memory ahead of use, 2-byte ones not). It adds the residual, multiplies by the norm's weights
  and sums each group's inputs itself (the shift, BASE and offsets folded in once per group).
* **The norm after the sums.** Each product is linear in its inputs, so 1 / RMS multiplies the
  finished sums: a program sums the squares of the inputs it loads, over the whole row (a
  product with a norm is never split along K). The normalised input is not rounded to the
  compute dtype first, as the compiled path rounds it; the residual sum is, as there.
* **The epilogue** (bias, silu(gate) * up, the residual add, the split-K reduction) is
  ``triton_common.epilogue``, the bf16 kernel's.
* **Programmatic dependent launch**, as in the bf16 kernels: a program loads its first step of
  words and scales, which no earlier kernel writes, before it waits for the previous kernel
  (``gdc_wait``); the loop that follows keeps its next steps in flight (Triton's pipeliner, TMA
  on compute capability 9.0 on), and lets the next kernel launch once it is done.

Why they are the default only for some quantized models (measured on an H100,
docs/quantization.md): a fused program does, for every input its words meet, what the glue
kernel does once (load, add, round, square, normalise, sum), repeated by every thread that holds
another row of its tile, against a glue kernel of about 3 us before each unfused product. int8
products, bound by bandwidth rather than instructions, absorb that work (an 8B layer 94.3 against
100.6 us unfused); so do small int4 layers, where the glue kernels weigh most (a 1B layer 33.4
against 34.5 us). Large int4 layers do not (8B: 73.5 against 70.9 us): the one-row int4
program is bound by its instructions. ``torch_fast.quantized_fusion_pays`` says which.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from tinyinfer.runners.quant_words import CODE_MASK, PER_WORD
from tinyinfer.runners.torch_layers import KernelWeight
from tinyinfer.runners.torch_quant_kernel import (
    Config,
    decode_words,
    device_traits,
    group_words,
    scale_shift,
    tma_fits,
    with_split,
    word_tile,
)
from tinyinfer.runners.triton_common import (
    check_prologue,
    epilogue,
    load,
    release_next,
    split_buffers,
    trip_count,
    wait_for_previous,
)
from tinyinfer.runners.triton_env import INTERPRETED, launches_dependent

BLOCK_N = 16  # weight rows a program reads: each thread holds four, so an input it loads serves four
SHORT_ROWS, LONG_ROWS = 2048, 8192  # products of up to / from this many inputs: 8 rows by 1024 a step
SHORT_ROWS_OUTPUTS = 16384  # ... the short ones up to this many outputs (an LM head keeps 16 rows)


@triton.jit
def _input(x_row, res_row, sum_row, norm_ptr, k, k_ok, writer, dtype, NORM: tl.constexpr, ADD_RES: tl.constexpr,
           EVEN: tl.constexpr):
    """Inputs k of one row as the product multiplies them before 1 / RMS, float32, and their
    squares (NORM; else 0): x, or x (+ the residual, rounded, which the program that is
    ``writer`` stores at sum_row) times the norm's weights."""
    xk = load(x_row + k, k_ok, EVEN).to(tl.float32)
    if ADD_RES:
        xk = (xk + load(res_row + k, k_ok, EVEN).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(sum_row + k, xk.to(dtype), mask=k_ok & writer)
    squares = 0.0
    if NORM:
        squares = xk * xk
        xk = xk * load(norm_ptr + k, k_ok, EVEN).to(tl.float32)
    return xk, squares


@triton.jit
def _halves(pair, dtype):
    """The two 16-bit floats of 32-bit words (the even input low), as float32."""
    if dtype == tl.bfloat16:  # a bf16 is the top half of the float32 it stands for
        low = (pair << 16).to(tl.float32, bitcast=True)
        high = (pair & -65536).to(tl.float32, bitcast=True)
    else:
        low = (pair & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        high = (pair >> 16).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _input_pair(x_row, res_row, sum_row, norm_ptr, k2, k_ok, writer, dtype, NORM: tl.constexpr,
                ADD_RES: tl.constexpr, EVEN: tl.constexpr):
    """``_input`` for inputs 2 k2 and 2 k2 + 1 of a row in a 16-bit dtype, the row's pointers
    taken as 32-bit words: one 4-byte load a pair, which Triton's pipeliner can copy into shared
    memory ahead of use (it copies no 2-byte loads)."""
    low, high = _halves(load(x_row + k2, k_ok, EVEN), dtype)
    if ADD_RES:
        res_low, res_high = _halves(load(res_row + k2, k_ok, EVEN), dtype)
        low = (low + res_low).to(dtype)
        high = (high + res_high).to(dtype)
        both = ((low.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                | (high.to(tl.int16, bitcast=True).to(tl.int32) << 16))
        tl.store(sum_row + k2, both, mask=k_ok & writer)
        low = low.to(tl.float32)
        high = high.to(tl.float32)
    squares = 0.0
    if NORM:
        squares = low * low + high * high
        norm_low, norm_high = _halves(load(norm_ptr + k2, k_ok, EVEN), dtype)
        low *= norm_low
        high *= norm_high
    return low, high, squares


@triton.jit
def _step(acc, acc_u, acc_shift, acc_shift_u, squares, words, words_u, scale, shift, scale_u, shift_u, x_row,
          res_row, sum_row, norm_ptr, base, place, k_ok, writer, code_mask, dtype, BITS: tl.constexpr,
          GROUP_WORDS: tl.constexpr, NORM: tl.constexpr, ADD_RES: tl.constexpr, GATED: tl.constexpr,
          EVEN: tl.constexpr, PAIRS: tl.constexpr):
    """One loop step: per word, sum (BASE + code) * input over its codes and add scale * that to
    the word's accumulator; per group, shift * (the step's inputs' sum) (gate and up rows:
    GATED); and the inputs' squares (NORM). Codes 2q and 2q + 1 of the word at ``place`` [G, W]
    in a group whose first input is ``base`` [G, 1] meet inputs base + 2 GROUP_WORDS q + 2 place
    and the next (``quant_words``' layout); PAIRS: the row pointers are 32-bit words of two
    16-bit inputs, so a pair is one load."""
    PER: tl.constexpr = 32 // BITS
    part = tl.zeros_like(acc)
    part_u = part
    xw = tl.zeros_like(squares)
    for q in tl.static_range(PER // 2):
        if PAIRS:
            low, high, sq = _input_pair(x_row, res_row, sum_row, norm_ptr, base // 2 + q * GROUP_WORDS + place,
                                        k_ok, writer, dtype, NORM, ADD_RES, EVEN)
        else:
            at = base + 2 * q * GROUP_WORDS + 2 * place
            low, sq_low = _input(x_row, res_row, sum_row, norm_ptr, at, k_ok, writer, dtype, NORM, ADD_RES, EVEN)
            high, sq = _input(x_row, res_row, sum_row, norm_ptr, at + 1, k_ok, writer, dtype, NORM, ADD_RES, EVEN)
            sq += sq_low
        xw += low + high
        squares += sq
        part += decode_words(words, code_mask, 2 * q, BITS) * low[None, :, :]
        part += decode_words(words, code_mask, 2 * q + 1, BITS) * high[None, :, :]
        if GATED:
            part_u += decode_words(words_u, code_mask, 2 * q, BITS) * low[None, :, :]
            part_u += decode_words(words_u, code_mask, 2 * q + 1, BITS) * high[None, :, :]
    xs = tl.sum(xw, axis=1)  # [G] each group's inputs in this step
    acc += part * scale[:, :, None]
    acc_shift += shift * xs[None, :]
    if GATED:
        acc_u += part_u * scale_u[:, :, None]
        acc_shift_u += shift_u * xs[None, :]
    return acc, acc_u, acc_shift, acc_shift_u, squares


@triton.jit
def _tiles(words_ptr, scales_ptr, offsets_ptr, row_at, up_at, row0, n, n_ok, N, block, g, kw, k_ok, num_groups,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, SPAN_WORDS: tl.constexpr,
           GROUP: tl.constexpr, BASE: tl.constexpr, ZERO: tl.constexpr, HAS_OFFSETS: tl.constexpr,
           GATED: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr):
    """Loop step ``block``'s words, scales and shifts of rows n, the first row0 (and of up rows
    N + n: GATED)."""
    words = word_tile(words_ptr, row_at, n_ok, row0, block, kw, k_ok, BLOCK_N, GROUPS_PER_BLOCK, SPAN_WORDS,
                      EVEN, TMA)
    scale, shift = scale_shift(scales_ptr, offsets_ptr, n, n_ok, block, g, num_groups, BLOCK_K, GROUP, BASE, ZERO,
                               HAS_OFFSETS, EVEN)
    words_u, scale_u, shift_u = words, scale, shift
    if GATED:
        words_u = word_tile(words_ptr, up_at, n_ok, N + row0, block, kw, k_ok, BLOCK_N, GROUPS_PER_BLOCK,
                            SPAN_WORDS, EVEN, TMA)
        scale_u, shift_u = scale_shift(scales_ptr, offsets_ptr, N + n, n_ok, block, g, num_groups, BLOCK_K, GROUP,
                                       BASE, ZERO, HAS_OFFSETS, EVEN)
    return words, words_u, scale, shift, scale_u, shift_u


@triton.jit
def _fused_quant_kernel(
    x_ptr, res_ptr, sum_ptr, norm_ptr, words_ptr, scales_ptr, offsets_ptr, bias_ptr, add_ptr, out_ptr,
    partial_ptr, counters_ptr, N, K, steps, eps, code_mask,
    ROW_WORDS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, SPAN_WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr,
    NORM: tl.constexpr, ADD_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    ADD_OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, INTERPRETED_STEPS: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
    TMA: tl.constexpr, PDL: tl.constexpr, PAIRS: tl.constexpr,
):
    """out[m, n] = epilogue(sum_k W[n, k] prologue(x[m])[k]), W [N (2N: GATED), K] from packed
    codes. Programs: (N tiles x rows, splits), the rows of one tile side by side, so that they
    run together and the words the first reads from memory reach the others from L2. Prologue
    and epilogue as ``torch_triton_gemv``'s."""
    PER: tl.constexpr = 32 // BITS
    BASE: tl.constexpr = 128 if BITS == 4 else 384
    BLOCK_WORDS: tl.constexpr = BLOCK_K // PER
    GROUP_WORDS: tl.constexpr = GROUP // PER if GROUP > 0 else ROW_WORDS
    row_words = ROW_WORDS
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    pid_n = tile // rows
    m = tile % rows
    dtype = x_ptr.dtype.element_ty
    row0 = pid_n * BLOCK_N
    n = row0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    g = tl.arange(0, GROUPS_PER_BLOCK)
    w = tl.arange(0, SPAN_WORDS)
    num_groups = K // GROUP if GROUP > 0 else 1
    first = pid_k * steps  # this program's loop steps: first .. first + steps
    row_at = words_ptr  # the words' descriptor (TMA), else the rows' pointers [BN, 1, 1]
    up_at = words_ptr
    if not TMA:
        row_at = words_ptr + n[:, None, None] * row_words
        up_at = row_at + N * row_words
    # The first step's words and scales, which no earlier kernel writes, before waiting for it.
    kw = first * BLOCK_WORDS + g[:, None] * SPAN_WORDS + w[None, :]  # [G, W] word columns
    k_ok = kw < row_words
    words, words_u, scale, shift, scale_u, shift_u = _tiles(
        words_ptr, scales_ptr, offsets_ptr, row_at, up_at, row0, n, n_ok, N, first, g, kw, k_ok, num_groups, BLOCK_N,
        BLOCK_K, GROUPS_PER_BLOCK, SPAN_WORDS, GROUP, BASE, ZERO, HAS_OFFSETS, GATED, EVEN, TMA)
    wait_for_previous(PDL)
    if PAIRS:  # the rows read and written as 32-bit words, two inputs each
        width = K // 2
        x_row = x_ptr.to(tl.pointer_type(tl.int32)) + m * width
        res_row = res_ptr.to(tl.pointer_type(tl.int32)) + m * width
        sum_row = sum_ptr.to(tl.pointer_type(tl.int32)) + m * width
        norm_row = norm_ptr.to(tl.pointer_type(tl.int32))
    else:
        x_row = x_ptr + m * K
        res_row = res_ptr + m * K
        sum_row = sum_ptr + m * K
        norm_row = norm_ptr
    writer = pid_n == 0  # the program that stores the residual sum
    acc = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, SPAN_WORDS], tl.float32)
    acc_u = acc
    acc_shift = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK], tl.float32)
    acc_shift_u = acc_shift
    squares = tl.zeros([GROUPS_PER_BLOCK, SPAN_WORDS], tl.float32)
    base, place = group_words(first, g, w, BLOCK_WORDS, SPAN_WORDS, GROUP_WORDS, GROUP)
    acc, acc_u, acc_shift, acc_shift_u, squares = _step(
        acc, acc_u, acc_shift, acc_shift_u, squares, words, words_u, scale, shift, scale_u, shift_u, x_row, res_row,
        sum_row, norm_row, base, place, k_ok, writer, code_mask, dtype, BITS, GROUP_WORDS, NORM, ADD_RES, GATED,
        EVEN, PAIRS)
    # The loop carries no loaded value from one step to the next: Triton's pipeliner issues the
    # loads of the next STAGES - 1 steps while this one computes.
    for step in tl.range(1, trip_count(steps, INTERPRETED_STEPS), num_stages=STAGES):
        block = first + step
        kw = block * BLOCK_WORDS + g[:, None] * SPAN_WORDS + w[None, :]
        k_ok = kw < row_words
        words, words_u, scale, shift, scale_u, shift_u = _tiles(
            words_ptr, scales_ptr, offsets_ptr, row_at, up_at, row0, n, n_ok, N, block, g, kw, k_ok, num_groups,
            BLOCK_N, BLOCK_K, GROUPS_PER_BLOCK, SPAN_WORDS, GROUP, BASE, ZERO, HAS_OFFSETS, GATED, EVEN, TMA)
        base, place = group_words(block, g, w, BLOCK_WORDS, SPAN_WORDS, GROUP_WORDS, GROUP)
        acc, acc_u, acc_shift, acc_shift_u, squares = _step(
            acc, acc_u, acc_shift, acc_shift_u, squares, words, words_u, scale, shift, scale_u, shift_u, x_row,
            res_row, sum_row, norm_row, base, place, k_ok, writer, code_mask, dtype, BITS, GROUP_WORDS, NORM,
            ADD_RES, GATED, EVEN, PAIRS)
    release_next(PDL)  # the next kernel may launch now: its first words load under this tail
    gate = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_shift, axis=1)
    up = gate
    if GATED:
        up = tl.sum(tl.sum(acc_u, axis=2), axis=1) + tl.sum(acc_shift_u, axis=1)
    if NORM:  # every product above is linear in the inputs: 1 / RMS multiplies the sums
        rstd = tl.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / K + eps)
        gate *= rstd
        up *= rstd
    epilogue(gate, up, n, n_ok, m, rows, tile, N,
             bias_ptr, add_ptr, out_ptr, partial_ptr, counters_ptr, dtype, HAS_BIAS, GATED, ADD_OUT,
             SPLIT_K)


def pick_config(n: int, k: int, bits: int, processors: int, tma: bool = False, *, norm: bool,
                gated: bool) -> Config:
    """The one-row program's tiles, measured fastest on an H100 at the 1B and 8B shapes (the int8
    o: on an H200, and level on an H100; docs/quantization.md). Products other than gate|up over
    short rows (K up to SHORT_ROWS, not an LM head's many outputs: the 1B q|k|v and o) or long
    ones (K from LONG_ROWS: the down products): 8 rows by 1024 inputs a step on two warps, 3
    steps in flight for int4, 4 for int8
    (int8: 1B q|k|v 6.0 against 7.1 us, o 4.4 against 5.7, down 9.5 against 11.4, 8B down 24.4
    against 24.8; int4: 1B q|k|v 6.1 against 6.7, o 4.2 against 4.8, down 8.3 against 9.4, 8B
    down 17.5 against 19.4 in an earlier call; the 1B int8 head 117.3 against 97.1). The
    others without a norm (the 8B o; the layer functions give every gated product a norm): int4
    64 rows by 256 on four warps (1B o 4.8 against 5.4 us before the short-row tiles), int8 8
    rows by 512 on two warps, 4 steps in flight (8B o on an H200 8.8 against 9.3 us with 16
    rows, on an H100 9.3-9.6 against 9.5-9.6). With a norm: BLOCK_N rows by 512 on two warps, 3
    steps in flight (8B int8 q|k|v 13.7 against 14.9 us with 4, gate|up 46.6 against 49.0). K
    split only while the output tiles leave multiprocessors idle, and never under a norm (each
    program sums the whole row's squares). n: outputs (a gated product's programs read a gate
    and an up row of each); norm, gated: what the choice depends on, given by every caller."""
    if not gated and ((k <= SHORT_ROWS and n <= SHORT_ROWS_OUTPUTS) or k >= LONG_ROWS):
        config = Config(8, 1024, num_warps=2, num_stages=3 if bits == 4 else 4, tma=tma)
    elif not norm:
        config = (Config(64, 256, num_warps=4, num_stages=4, tma=tma) if bits == 4
                  else Config(8, 512, num_warps=2, num_stages=4, tma=tma))
    else:
        config = Config(BLOCK_N, 512, num_warps=2, num_stages=3, tma=tma)
    return config if norm else with_split(config, 1, n, k, processors, programs_per_processor=1)


def fused_gemv(x: Tensor, weight: KernelWeight, bias: Tensor | None = None, *, norm: Tensor | None = None,
               residual: Tensor | None = None, sum_out: Tensor | None = None, eps: float = 0.0,
               gated: bool = False, add: Tensor | None = None, out_dtype: torch.dtype | None = None,
               config: Config | None = None) -> Tensor:
    """``torch_triton_gemv.gemv``'s contract for a weight in the Triton kernels' int8 / int4
    layout.  x: [M, K] in the compute dtype, weight: [N, K] ([2N, K] when gated: gate rows, then
    up rows) -> [M, N] in out_dtype (x's by default). ``config`` overrides the tile choice."""
    m, k = x.shape
    rows, row_words = weight.words.shape
    bits = weight.bits
    if row_words * PER_WORD[bits] != k:
        raise ValueError(f"x has {k} inputs, the weight's rows {row_words * PER_WORD[bits]}")
    n = rows // 2 if gated else rows
    if config is None:
        processors, tma = device_traits(x.device)
        config = pick_config(n, k, bits, processors, tma and tma_fits(weight.words), norm=norm is not None,
                             gated=gated)
    check_prologue(norm, residual, sum_out, config.split_k)
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n) * m, config.split_k)  # a tile's rows side by side
    partial, counters = split_buffers(config.split_k, m, 2 * n if gated else n, grid[0], out)
    group = weight.group_size
    span = config.block_k if group == k else min(group, config.block_k)  # inputs of one group in a step
    blocks = triton.cdiv(k, config.block_k)
    steps = triton.cdiv(blocks, config.split_k)
    words: Tensor | TensorDescriptor = weight.words
    if config.tma:  # [BLOCK_N, BLOCK_WORDS] tiles of the words, loaded by the copy engine
        words = TensorDescriptor.from_tensor(weight.words, [config.block_n, config.block_k // PER_WORD[bits]])
    pdl = launches_dependent(x.device)
    unused = out
    _fused_quant_kernel[grid](
        x, unused if residual is None else residual, unused if sum_out is None else sum_out,
        unused if norm is None else norm, words, weight.scales,
        weight.scales if weight.offsets is None else weight.offsets, unused if bias is None else bias,
        unused if add is None else add, out, partial, counters, n, k, steps, eps, CODE_MASK[bits],
        ROW_WORDS=row_words, BITS=bits, GROUP=0 if group == k else group, ZERO=weight.zero,
        HAS_OFFSETS=weight.offsets is not None, SPAN_WORDS=span // PER_WORD[bits],
        GROUPS_PER_BLOCK=config.block_k // span, NORM=norm is not None, ADD_RES=residual is not None,
        HAS_BIAS=bias is not None, GATED=gated, ADD_OUT=add is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        INTERPRETED_STEPS=steps if INTERPRETED else 0,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0 and blocks % config.split_k == 0,
        STAGES=config.num_stages, TMA=config.tma, PDL=pdl, PAIRS=x.element_size() == 2,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    return out

