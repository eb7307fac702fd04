"""The int8 / int4 layout the Triton kernels read, and their arithmetic in NumPy (no Triton).

``torch_quant_kernel`` multiplies by quantized weights without a dequantized copy; this module
says what it reads and what it computes, so tests run on any machine:

* **Words, one group at a time.** A row's codes are packed into little-endian 32-bit words of
  eight int4 nibbles or four int8 bytes, group by group: a group of G inputs is W = G / PER
  words, and codes 2q and 2q + 1 of its word i (bits 4j or 8j for code j) are the group's
  columns 2W q + 2i and 2W q + 2i + 1 (per-row int8: the row is one group). So every code of a
  word shares one scale and offset, and the pairs q of a group's consecutive words meet a
  *contiguous* run of inputs: a 16-bit x is read as it is, one 32-bit load per word and pair
  (two inputs), which Triton's pipeliner stages ahead of use (it stages no 2-byte loads); a
  float32 x regrouped by code along the row (``torch_layers.kernel_inputs``) is read in
  contiguous runs. The stored checkpoint keeps the usual order, even column first; ``pack_words``
  reorders at load and ``columns`` says where each code went.
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
    """Whether the kernels take this weight: whole groups of whole 32-bit words."""
    return qw.in_features % qw.group_size == 0 and qw.group_size * qw.config.bits % 32 == 0


def columns(in_features: int, bits: int, group_size: int) -> np.ndarray:
    """The input column each code of a packed row holds, in packed order (code j of word i at
    place PER i + j): int64 [in_features]."""
    per = PER_WORD[bits]
    span = group_size // per  # W: words in a group
    place = np.arange(in_features)
    word, j = place // per, place % per
    return (word // span) * group_size + (j // 2) * 2 * span + 2 * (word % span) + j % 2


def pack_words(qw: QuantizedWeight) -> PackedWords:
    """The stored codes as words, and the scales, offsets and zero of the one formula."""
    config = qw.config
    out, span = qw.shape[0], qw.group_size // PER_WORD[config.bits]  # span: W, words in a group
    # Code pairs are stored units (int4: a byte holds columns 2c and 2c + 1, the even one low; int8:
    # two bytes), so the layout is a permutation of the stored pairs: a group's pair q of word i is
    # its pair W q + i, [out, groups, pairs a word, W] -> [.., W, pairs a word]. Moving whole pairs
    # (uint16 for int8) rather than bytes packs an 8B shape's int8 layers about 5x faster.
    pair = np.uint8 if config.bits == 4 else np.dtype("<u2")
    data = np.ascontiguousarray(qw.data).view(pair).reshape(out, qw.num_groups, PER_WORD[config.bits] // 2, span)
    words = np.ascontiguousarray(data.transpose(0, 1, 3, 2)).reshape(out, -1).view("<i4")
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
    held = columns(row_words * per, packed.bits, packed.group_size).reshape(row_words, per)  # code j of word i
    group = held // packed.group_size
    weight = np.empty((out, row_words * per), np.float32)
    for j in range(per):
        g = group[:, j]
        weight[:, held[:, j]] = decode(packed.words, j, packed.bits) * scale[:, g] + shift[:, g]
    return weight
