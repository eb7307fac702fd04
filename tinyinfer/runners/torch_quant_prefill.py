"""Quantized products with many rows (prefill chunks, large batches): dequantize, then cuBLAS.

At a row or a few, a product reads each weight once and does two flops with it: its time is the
bytes, and ``torch_quant_kernel`` reads them as codes. A prefill chunk of hundreds of rows does
hundreds of flops per weight: its time is the matrix units', and cuBLAS keeps them busier than a
kernel that decodes codes between its products. So from ``torch_layers.DEQUANT_ROWS`` rows on
(``INT4PACK_DEQUANT_ROWS`` for torch's int4 layout), a quantized weight is dequantized into a
bf16 buffer (one pass: the codes in, two bytes a weight out) and multiplied by ``F.linear``.

* **One buffer per device and dtype**, allocated on first use and never grown (a CUDA graph may
  hold its address): ``CHUNK`` elements, 128 MB in bf16. A larger weight (a gate|up projection,
  an LM head) goes through it in row chunks, one ``F.linear`` each; the chunks' outputs are
  joined. Kernels on one stream run in order, so a chunk is read before the next overwrites it.
* **Either layout.** Words (``torch_layers.KernelWeight``: int8, and int4 where torch's kernel
  does not take the shape) decode as ``quant_words`` says, ``(code - zero) * scale + offset`` in
  float32: the reference's ``dequantize`` bit for bit for the zero-point formats. torch's tiled
  int4 (``Int4Weight``, tinygemm's layout on CUDA) holds each 8 x (16 * inner_k_tiles) tile of
  nibbles in an order of its own, each row's nibbles in words of their own:
  ``int4pack_tile_map`` asks torch's packer which word and nibble of a row holds each column
  (three probes of one tile, once per device); the kernel gathers each column's nibble from its
  row's words and stores whole rows, computing ``(nibble - 8) * scale + zero`` as tinygemm does.
* Both are operators (``torch.ops.tinyinfer.dequant_matmul``, ``...dequant_matmul_int4pack``),
  opaque to ``torch.compile``; the buffer never leaves them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners.quant_words import PER_WORD

CHUNK = 1 << 26  # elements of the dequantize buffer: 128 MB in bf16
TILE_ROWS = 8  # rows of one tile of torch's CUDA int4 layout

_buffers: dict[tuple[torch.device, torch.dtype], Tensor] = {}
_tile_maps: dict[tuple[torch.device, int], Tensor] = {}


@triton.jit
def _dequantize_words_kernel(words_ptr, scales_ptr, offsets_ptr, out_ptr, first_row, rows,
                             ROW_WORDS: tl.constexpr, NUM_GROUPS: tl.constexpr, BITS: tl.constexpr,
                             GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[n, :] = weight row first_row + n, for n < rows: a [BLOCK_N, BLOCK_W words] tile each.

    Code j of word w is column (w // SPAN) GROUP + 2 SPAN (j // 2) + 2 (w % SPAN) + j % 2
    (``quant_words``' layout, SPAN words to a group); GROUP 0 means one group per row (per-row int8).
    """
    PER: tl.constexpr = 32 // BITS
    K: tl.constexpr = ROW_WORDS * PER
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row = first_row + n
    n_ok = n < rows
    words = tl.load(words_ptr + row[:, None] * ROW_WORDS + w[None, :],
                    mask=n_ok[:, None] & (w < ROW_WORDS)[None, :], other=0)  # [BN, BW]
    j = tl.arange(0, PER)
    if BITS == 8:  # byte j to the top, then an arithmetic shift back: the signed code
        codes = (words[:, :, None] << (24 - 8 * j)[None, None, :]) >> 24
    else:
        codes = (words[:, :, None] >> (4 * j)[None, None, :]) & 0xF
    if GROUP > 0:
        SPAN: tl.constexpr = GROUP // PER
        col = (w // SPAN * GROUP + 2 * (w % SPAN))[:, None] + (j // 2 * 2 * SPAN + j % 2)[None, :]  # [BW, PER]
        group = (w // SPAN)[:, None] + j[None, :] * 0
    else:
        col = (2 * w)[:, None] + (j // 2 * 2 * ROW_WORDS + j % 2)[None, :]
        group = col * 0
    at = row[:, None, None] * NUM_GROUPS + group[None, :, :]  # [BN, BW, PER]
    ok = n_ok[:, None, None] & (w < ROW_WORDS)[None, :, None]
    value = (codes - ZERO).to(tl.float32) * tl.load(scales_ptr + at, mask=ok, other=0).to(tl.float32)
    if HAS_OFFSETS:
        value += tl.load(offsets_ptr + at, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + n[:, None, None] * K + col[None, :, :], value.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequantize_int4pack_kernel(packed_ptr, sz_ptr, map_ptr, out_ptr, first_row, rows, N,
                                K_TILES: tl.constexpr, TILE_K: tl.constexpr, GROUP: tl.constexpr,
                                BLOCK_N: tl.constexpr):
    """out[n, :] = weight row first_row + n from torch's CUDA int4 layout: [N / 8, K_TILES,
    TILE_K words], a tile of 8 rows x TILE_K columns, each row's nibbles in TILE_K / 8 words of
    their own; column c of a tile row is nibble map[c] % 8 of the row's word map[c] // 8.
    scales_and_zeros: [groups, N, 2]. A program: BLOCK_N rows of one tile column; each load
    reads within one row's words (TILE_K / 2 bytes), each store writes whole rows."""
    ROW_WORDS: tl.constexpr = TILE_K // 8
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = first_row + n
    n_ok = n < rows
    src = tl.load(map_ptr + tl.arange(0, TILE_K))  # [TILE_K]
    at = ((row // 8) * K_TILES + tl.program_id(1)) * TILE_K + (row % 8) * ROW_WORDS  # [BN]
    word = tl.load(packed_ptr + at[:, None] + (src // 8)[None, :], mask=n_ok[:, None], other=0)  # [BN, TILE_K]
    nibbles = (word >> ((src % 8) * 4)[None, :]) & 0xF
    col = tl.program_id(1) * TILE_K + tl.arange(0, TILE_K)
    ok = n_ok[:, None] & (col < K_TILES * TILE_K)[None, :]
    if GROUP % TILE_K == 0:  # the tile column lies in one group: a scale and zero per row
        sz_row = ((tl.program_id(1) * TILE_K // GROUP) * N + row) * 2  # [BN]
        scale = tl.load(sz_ptr + sz_row, mask=n_ok, other=0).to(tl.float32)[:, None]
        zero = tl.load(sz_ptr + sz_row + 1, mask=n_ok, other=0).to(tl.float32)[:, None]
    else:
        sz_at = ((col // GROUP)[None, :] * N + row[:, None]) * 2
        scale = tl.load(sz_ptr + sz_at, mask=ok, other=0).to(tl.float32)
        zero = tl.load(sz_ptr + sz_at + 1, mask=ok, other=0).to(tl.float32)
    tl.store(out_ptr + n[:, None] * (K_TILES * TILE_K) + col[None, :],
             ((nibbles - 8).to(tl.float32) * scale + zero).to(out_ptr.dtype.element_ty), mask=ok)


def _buffer(device: torch.device, dtype: torch.dtype) -> Tensor:
    key = (device, dtype)
    if key not in _buffers:
        _buffers[key] = torch.empty(CHUNK, dtype=dtype, device=device)
    return _buffers[key]


def _chunked(x: Tensor, n: int, k: int, row_multiple: int, fill: Callable[[Tensor, int], None]) -> Tensor:
    """x W^T with W [n, k] dequantized by ``fill(buffer [rows, k], first_row)`` in chunks of rows
    that fit the buffer (a multiple of ``row_multiple``)."""
    buffer = _buffer(x.device, x.dtype)
    step = max(row_multiple, CHUNK // k // row_multiple * row_multiple)
    outs = []
    for first in range(0, n, step):
        rows = min(step, n - first)
        w = buffer[:rows * k].view(rows, k)
        fill(w, first)
        outs.append(F.linear(x, w))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def dequantize_words_into(out: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None, bits: int,
                          group_size: int, zero: int, first_row: int = 0) -> None:
    """Rows first_row .. first_row + len(out) of a ``KernelWeight`` dequantized into out [rows, K]."""
    per = PER_WORD[bits]
    row_words = words.shape[1]
    block_n, block_w = 16, 256 // per
    grid = (triton.cdiv(out.shape[0], block_n), triton.cdiv(row_words, block_w))
    _dequantize_words_kernel[grid](
        words, scales, scales if offsets is None else offsets, out, first_row, out.shape[0],
        ROW_WORDS=row_words, NUM_GROUPS=scales.shape[1], BITS=bits,
        GROUP=0 if group_size == row_words * per else group_size, ZERO=zero,
        HAS_OFFSETS=offsets is not None, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4)


def dequantize_int4pack_into(out: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int,
                             tile_map: Tensor, first_row: int = 0) -> None:
    """Rows first_row .. first_row + len(out) of torch's CUDA int4 layout dequantized into out;
    ``tile_map`` from ``int4pack_tile_map``."""
    n, k_tiles, tile_k = packed.shape[0] * TILE_ROWS, packed.shape[1], tile_map.shape[0]
    block_n = 32
    grid = (triton.cdiv(out.shape[0], block_n), k_tiles)
    _dequantize_int4pack_kernel[grid](packed, scales_and_zeros, tile_map, out, first_row, out.shape[0], n,
                                      K_TILES=k_tiles, TILE_K=tile_k, GROUP=group_size, BLOCK_N=block_n,
                                      num_warps=4)


def int4pack_tile_map(device: torch.device, inner_k_tiles: int) -> Tensor:
    """Where torch's CUDA int4 packer puts the weights of a tile row: int32 [16 * inner_k_tiles],
    column c at nibble map[c] % 8 of the row's word map[c] // 8. Found by packing one tile three
    times, its nibbles spelling out each weight's position in base 16; cached per device. Refused
    (a RuntimeError) unless each row's nibbles fill words of their own, in one order for every row."""
    key = (device, inner_k_tiles)
    if key not in _tile_maps:
        tile_k = 16 * inner_k_tiles
        position = np.arange(TILE_ROWS * tile_k).reshape(TILE_ROWS, tile_k)
        found = np.zeros(TILE_ROWS * tile_k, np.int64)  # per (word * 8 + nibble): the position it holds
        for digit in range(3):  # 16^3 > 8 * 128 positions
            v = (position >> (4 * digit)) & 0xF
            stored = ((v[:, 0::2] << 4) | v[:, 1::2]).astype(np.uint8)  # even column high, as device_weight packs
            packed = torch._convert_weight_to_int4pack(torch.from_numpy(stored).to(device), inner_k_tiles)
            words = packed.flatten().cpu().numpy().astype(np.int64) & 0xFFFFFFFF
            found |= (((words[:, None] >> (4 * np.arange(8))) & 0xF) << (4 * digit)).reshape(-1)
        rows, columns = (found // tile_k).reshape(TILE_ROWS, tile_k), (found % tile_k).reshape(TILE_ROWS, tile_k)
        if not (np.array_equal(rows, np.repeat(np.arange(TILE_ROWS)[:, None], tile_k, 1))
                and (columns == columns[0]).all() and np.array_equal(np.sort(columns[0]), np.arange(tile_k))):
            raise RuntimeError("torch's int4 packer lays its tiles out differently than it did: "
                               "use quant_kernel='triton'")
        _tile_maps[key] = torch.from_numpy(np.argsort(columns[0]).astype(np.int32)).to(device)
    return _tile_maps[key]


@torch.library.custom_op("tinyinfer::dequant_matmul", mutates_args=())
def dequant_matmul(x: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None, bits: int,
                   group_size: int, zero: int) -> Tensor:
    """x W^T, W a ``KernelWeight`` dequantized to x's dtype in the buffer.  x: [M, K] -> [M, N]."""
    n, k = words.shape[0], words.shape[1] * PER_WORD[bits]
    return _chunked(x, n, k, 16, lambda out, first: dequantize_words_into(
        out, words, scales, offsets, bits, group_size, zero, first))


@dequant_matmul.register_fake
def _(x: Tensor, words: Tensor, scales: Tensor, offsets: Tensor | None, bits: int, group_size: int,
      zero: int) -> Tensor:
    return x.new_empty((x.shape[0], words.shape[0]))


@torch.library.custom_op("tinyinfer::dequant_matmul_int4pack", mutates_args=())
def dequant_matmul_int4pack(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int,
                            tile_map: Tensor) -> Tensor:
    """x W^T, W in torch's CUDA int4 layout, dequantized to x's dtype in the buffer."""
    n, k = packed.shape[0] * TILE_ROWS, packed.shape[1] * tile_map.shape[0]
    return _chunked(x, n, k, 32, lambda out, first: dequantize_int4pack_into(
        out, packed, scales_and_zeros, group_size, tile_map, first))


@dequant_matmul_int4pack.register_fake
def _(x: Tensor, packed: Tensor, scales_and_zeros: Tensor, group_size: int, tile_map: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], packed.shape[0] * TILE_ROWS))
