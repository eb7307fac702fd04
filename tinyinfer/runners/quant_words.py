"""The int8 / int4 layout the Triton kernels read, and their arithmetic in NumPy (no Triton).

``torch_quant_kernel`` multiplies by quantized weights without a dequantized copy; this module
says what it reads and what it computes, so tests run on any machine:

* **Words.** The stored codes of a row read as little-endian 32-bit words: eight int4 nibbles
  (column 8i + j at bits 4j of word i) or four int8 bytes (column 4i + j at bits 8j).
* **Every format as one formula.** ``weight = (code - zero) * scale + offset`` per (row, group):
  zero is 8 for symmetric int4 (nibbles hold code + 8), else 0; offsets exist only for the
  asymmetric and minimum formats (float16 where that is exact, else float32).
* **Codes to floats without a conversion instruction.** OR-ing a code's bits into the
  mantissa of a float32 power of two gives BASE + code exactly: an int4 nibble moved to bits
  16..19 of 128.0 reads 128 + code; an int8 byte moved to bits 15..22 of 256.0, its sign bit
  flipped, reads 384 + code. The kernel folds BASE into the offset:
  ``weight = (BASE + code) * scale + (offset - (BASE + zero) * scale)``, exact in float32
  (each product is an integer of at most 10 bits times a float16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyinfer.quant import QuantizedWeight, group_offsets

PER_WORD = {4: 8, 8: 4}  # codes in one 32-bit word
CODE_BASE = {4: 128, 8: 384}  # decode gives CODE_BASE + code
CODE_MASK = {4: 0x000F0000, 8: 0x007F8000}  # the mantissa bits a code is moved to
EXPONENT_BITS = {4: 0x43000000, 8: 0x43C00000}  # 128.0 (OR-ed); 384.0 (XOR-ed: flips the sign bit)


@dataclass(frozen=True)
class PackedWords:
    """A quantized weight in the kernels' layout, on the host."""

    words: np.ndarray  # int32 [out, in * bits / 32]
    scales: np.ndarray  # float16 [out, groups]
    offsets: np.ndarray | None  # float16 or float32 [out, groups]; None: no offset
    bits: int
    group_size: int  # the row's width for per-row int8
    zero: int


def fits(qw: QuantizedWeight) -> bool:
    """Whether the kernels take this weight: whole groups, rows of whole 32-bit words."""
    return qw.in_features % qw.group_size == 0 and qw.in_features * qw.config.bits % 32 == 0


def pack_words(qw: QuantizedWeight) -> PackedWords:
    """The stored codes as words, and the scales, offsets and zero of the one formula."""
    config = qw.config
    words = np.ascontiguousarray(qw.data).view("<i4").astype(np.int32)  # [out, in * bits / 32]
    offsets, zero = None, 0
    if config.bits == 4 and config.symmetric:
        zero = 8
    elif config.bits == 4:
        exact = group_offsets(qw)  # float32 [out, groups]
        half = exact.astype(np.float16)
        offsets = half if np.array_equal(half.astype(np.float32), exact) else exact
    return PackedWords(words, qw.scales, offsets, config.bits, qw.group_size, zero)


def decode(words: np.ndarray, j: int, bits: int) -> np.ndarray:
    """Code j of every word as float32 BASE + code: the kernel's ``decode_words``, step for step."""
    shift = 16 - 4 * j if bits == 4 else 15 - 8 * j
    w = words.astype(np.int32)
    moved = w << shift if shift >= 0 else w >> -shift  # arithmetic shift; the mask drops the sign
    if bits == 4:
        out = (moved & CODE_MASK[4]) | EXPONENT_BITS[4]
    else:
        out = (moved & CODE_MASK[8]) ^ EXPONENT_BITS[8]
    return out.astype(np.int32).view(np.float32)


def dequantize_words(packed: PackedWords) -> np.ndarray:
    """The weight as the kernel sees it, float32 [out, in]: decode, then one multiply-add per code."""
    per = PER_WORD[packed.bits]
    out, row_words = packed.words.shape
    scale = packed.scales.astype(np.float32)
    shift = -np.float32(CODE_BASE[packed.bits] + packed.zero) * scale  # [out, groups]
    if packed.offsets is not None:
        shift = shift + packed.offsets.astype(np.float32)
    columns = np.arange(row_words * per).reshape(row_words, per)  # column of code j of word i
    group = columns // packed.group_size
    weight = np.empty((out, row_words * per), np.float32)
    for j in range(per):
        g = group[:, j]
        weight[:, columns[:, j]] = decode(packed.words, j, packed.bits) * scale[:, g] + shift[:, g]
    return weight
