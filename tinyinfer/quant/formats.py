"""Quantization formats: how a float weight becomes small integers and back (lesson 10).

Start here. A quantized weight keeps small integer *codes* and, per group of inputs of one
output row, a float16 *scale* (and for asymmetric int4 an integer *zero point*):

    weight ≈ (code - zero) * scale

* int8: one group per output row (per-output-channel) or groups of 32 / 64 / 128 inputs
  (GGUF's Q8_0 is int8-g32), codes in [-128, 127], zero 0.
* int4: groups of 32 / 64 / 128 inputs (the last group of a row may be shorter), two codes
  packed per byte. Symmetric: codes in [-8, 7], stored as nibbles code + 8 (zero 8).
  Asymmetric: codes in [0, 15] with a zero point per group, itself packed as a nibble.
  With a minimum ("-min", GGUF's Q4_1): codes in [0, 15] and a float16 *minimum* per group
  in place of the zero point, so weight = code * scale + minimum (zero need not be on the grid).

Every scale is the smallest float16 whose grid covers the group's range, so each weight is
off by at most half a scale step. By default only the transformer blocks' linear layers are
quantized (`is_quantized_name`); the token embedding and the LM head (its errors land straight
on the logits) join them on request (``QuantConfig.head``, ``--quantize-head``): a [vocab, hidden]
table in the same format, its groups along the hidden axis, so an embedding lookup dequantizes
only the rows it gathers (`dequantize_rows`) and a tied model quantizes its one table once.
Norms, biases and GPT-2's position table stay in floating point. The K/V cache has its own int8
format: one scale per token and head (`quantize_kv`).

`QuantConfig.stored_bytes` says how many bytes a format stores: the weight-memory table
(`tinyinfer.quant.report`) counts with it, and the simulator (`tinyinfer.simulate.memory`,
config only) takes the same scale and zero-point sizes. Whole checkpoints are in
`tinyinfer.quant.checkpoint`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tinyinfer.errors import TinyInferError

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "fc", "proj")
HEAD_NAMES = ("embed", "lm_head")  # the token embedding and the LM head (absent when tied)
HEAD_SUFFIX = "+head"  # a format's name with the head quantized too: int8+head, int4-g128+head
SCALE_BYTES = 2  # one float16 scale per group
ZERO_POINT_BYTES = 0.5  # asymmetric int4: one 4-bit zero point per group, two to a byte
MIN_BYTES = 2  # int4 with a minimum: one float16 minimum per group


class QuantizationError(TinyInferError):
    """A quantization format is asked for that does not exist, or a weight cannot be stored in it."""


def is_quantized_name(name: str) -> bool:
    """Whether a runner weight name is a block's linear layer: what every quantized format stores
    quantized (``QuantConfig.applies_to`` adds the embedding and LM head with ``head``)."""
    parts = name.split(".")
    return parts[0] == "layers" and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


# ---------------------------------------------------------------- formats


@dataclass(frozen=True)
class QuantConfig:
    """A weight format: bits, group size, whether int4 groups carry zero points or minimums;
    and whether the token embedding and LM head are stored in it too (``head``)."""

    bits: int
    group_size: int | None = None  # None: one group per output row (int8 only)
    symmetric: bool = True
    minimum: bool = False  # asymmetric int4 storing a float16 minimum per group (GGUF's Q4_1)
    head: bool = False  # the embedding and LM head quantized as well as the blocks' linear layers

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise QuantizationError(f"bits must be 8 or 4, got {self.bits}")
        if self.minimum and (self.symmetric or self.bits == 8):
            raise QuantizationError("a per-group minimum belongs to asymmetric int4 only")
        if self.bits == 8 and not self.symmetric:
            raise QuantizationError("int8 is symmetric: drop --asymmetric, or use --bits 4")
        if self.group_size not in GROUP_SIZES and (self.bits == 4 or self.group_size is not None):
            raise QuantizationError(f"the group size must be one of {GROUP_SIZES}"
                                    f"{' (or none: per row)' if self.bits == 8 else ''}, "
                                    f"got {self.group_size}")

    @property
    def name(self) -> str:
        """Short name: int8, int8-g32, int4-g128, int4-g64-asym, int4-g32-min; +head when the
        embedding and LM head are quantized too (int8+head)."""
        group = "" if self.group_size is None else f"-g{self.group_size}"
        offset = "-min" if self.minimum else "" if self.symmetric else "-asym"
        return f"int{self.bits}{group}{offset}{HEAD_SUFFIX if self.head else ''}"

    @property
    def weight_format(self) -> QuantConfig:
        """The format alone, without the choice of which weights it applies to (what one
        QuantizedWeight records)."""
        return replace(self, head=False)

    def applies_to(self, name: str) -> bool:
        """Whether a runner weight of this name is quantized: the blocks' linear layers, and with
        ``head`` the embedding and LM head."""
        return is_quantized_name(name) or (self.head and name in HEAD_NAMES)

    @classmethod
    def parse(cls, name: str) -> QuantConfig:
        """Read a short name back: 'int8', 'int8-g32', 'int4' (= int4-g128), 'int4-g64',
        'int4-g32-asym', 'int4-g32-min', any of them with '+head'."""
        text = name.strip().lower()
        head = text.endswith(HEAD_SUFFIX)
        parts = text.removesuffix(HEAD_SUFFIX).split("-")
        try:
            if parts[0] == "int8" and len(parts) <= 2:
                return cls(bits=8, group_size=int(parts[1].removeprefix("g")) if len(parts) > 1 else None,
                           head=head)
            if parts[0] == "int4" and len(parts) <= 3:
                group = int(parts[1].removeprefix("g")) if len(parts) > 1 else 128
                offset = parts[2] if len(parts) == 3 else ""
                if offset not in ("", "asym", "min"):
                    raise ValueError(offset)
                return cls(bits=4, group_size=group, symmetric=not offset, minimum=offset == "min",
                           head=head)
        except ValueError:
            pass
        raise QuantizationError(f"unknown quantization {name}: use int8, int8-g32, int4, int4-g32, "
                                "int4-g64, int4-g128, optionally with -asym or -min for int4 "
                                "(e.g. int4-g64-asym); +head quantizes the embedding and LM head too")

    @property
    def code_range(self) -> tuple[int, int]:
        """Smallest and largest code: signed when symmetric, unsigned with a zero point otherwise."""
        if self.symmetric:
            return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        return 0, 2 ** self.bits - 1

    def stored_bytes(self, out: int, in_features: int) -> tuple[int, int]:
        """Bytes of an [out, in] weight in this format: (codes, scales + zero points)."""
        groups = math.ceil(in_features / (self.group_size or in_features))
        codes = out * (in_features if self.bits == 8 else math.ceil(in_features / 2))
        if self.minimum:
            zeros = out * groups * MIN_BYTES
        else:
            zeros = 0 if self.symmetric else out * math.ceil(groups * ZERO_POINT_BYTES)
        return codes, out * groups * SCALE_BYTES + zeros


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's [out, in] weight as integer codes plus float16 scales (and zero points
    or minimums)."""

    data: np.ndarray  # int8 [out, in], or uint8 [out, ceil(in / 2)]: two int4 nibbles per byte
    scales: np.ndarray  # float16 [out, groups]; per-row int8 has one group per row
    zeros: np.ndarray | None  # uint8 [out, ceil(groups / 2)] packed zero points (asymmetric int4)
    in_features: int
    config: QuantConfig
    mins: np.ndarray | None = None  # float16 [out, groups] minimums (int4 "-min" only)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def group_size(self) -> int:
        return self.config.group_size or self.in_features

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and zero points."""
        return sum(a.nbytes for a in (self.data, self.scales, self.zeros, self.mins) if a is not None)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Two 4-bit codes per byte, the even column in the low nibble.  [..., n] in 0..15 -> uint8 [..., ceil(n / 2)]."""
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("int4 codes must lie in 0..15")
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), codes.dtype)], axis=-1)
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Undo pack_int4.  uint8 [..., ceil(n / 2)] -> uint8 [..., n] in 0..15.

    Each byte becomes a little-endian 16-bit word whose low byte is the low nibble and whose high
    byte is the high nibble, so the words read as bytes are the codes in column order: a few
    whole-array operations, where writing every other column would be a slow strided copy.
    """
    v = packed.astype("<u2", order="C")  # C order whatever the stored layout, for the view below
    words = (v | (v << 4)) & 0x0F0F  # nibble bits 0..3 stay, bits 4..7 move to 8..11
    return words.view(np.uint8).reshape(*packed.shape[:-1], -1)[..., :n]


def _float16_scale(scale: np.ndarray) -> np.ndarray:
    """Round scales *up* to float16, so the rounded grid still covers the range it was sized for."""
    with np.errstate(over="ignore"):
        half = scale.astype(np.float16)
    low = half.astype(np.float32) < scale
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    if not np.isfinite(half).all():
        raise QuantizationError("a weight is too large for a float16 scale (|w| > 1e6): "
                                "this checkpoint cannot be quantized")
    return half


def _per_element(per_group: np.ndarray, group_size: int, in_features: int) -> np.ndarray:
    """Repeat each group's value over its inputs.  [out, groups] -> [out, in] (ragged last group cut)."""
    return np.repeat(per_group, group_size, axis=1)[:, :in_features]


def quantize(weight: np.ndarray, config: QuantConfig) -> QuantizedWeight:
    """Quantize one [out, in] weight to the format `config` names."""
    config = config.weight_format
    w = np.asarray(weight, dtype=np.float32)  # [out, in]
    if w.ndim != 2 or 0 in w.shape:
        raise QuantizationError(f"only non-empty 2-D weights can be quantized, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise QuantizationError("the weight holds NaN or infinity: the checkpoint is corrupt")
    out, n = w.shape
    group = config.group_size or n
    starts = np.arange(0, n, group)  # first input of each group
    if config.minimum:
        return _quantize_with_minimum(w, config, starts)
    # The grid must hold zero exactly (padding, ReLU-like zeros), so each range includes it.
    lo = np.minimum(np.minimum.reduceat(w, starts, axis=1), 0.0)  # [out, groups]
    hi = np.maximum(np.maximum.reduceat(w, starts, axis=1), 0.0)
    qmin, qmax = config.code_range
    if config.symmetric:
        scale = _float16_scale(np.maximum(lo / qmin, hi / qmax))
        zero = np.zeros_like(lo, dtype=np.int32)
    else:
        scale = _float16_scale((hi - lo) / (qmax - qmin))
        safe = np.where(scale > 0, scale.astype(np.float32), 1.0)
        zero = np.clip(np.round(-lo / safe), qmin, qmax).astype(np.int32)
    s = _per_element(scale.astype(np.float32), group, n)  # [out, in]
    z = _per_element(zero, group, n)
    steps = np.divide(w, s, out=np.zeros_like(w), where=s > 0)
    codes = np.clip(np.round(steps) + z, qmin, qmax).astype(np.int32)
    if config.bits == 8:
        return QuantizedWeight(codes.astype(np.int8), scale, None, n, config)
    if config.symmetric:
        return QuantizedWeight(pack_int4(codes + 8), scale, None, n, config)
    return QuantizedWeight(pack_int4(codes), scale, pack_int4(zero), n, config)


def _quantize_with_minimum(w: np.ndarray, config: QuantConfig, starts: np.ndarray) -> QuantizedWeight:
    """int4 codes 0..15 above each group's float16 minimum: weight ≈ code * scale + minimum."""
    out, n = w.shape
    lo = np.minimum.reduceat(w, starts, axis=1)  # [out, groups]
    hi = np.maximum.reduceat(w, starts, axis=1)
    with np.errstate(over="ignore"):
        mins = lo.astype(np.float16)
    high = mins.astype(np.float32) > lo  # round the minimum *down*, so the grid still covers lo
    mins[high] = np.nextafter(mins[high], np.float16(-np.inf))
    scale = _float16_scale((hi - mins.astype(np.float32)) / 15)
    s = _per_element(scale.astype(np.float32), config.group_size, n)  # [out, in]
    m = _per_element(mins.astype(np.float32), config.group_size, n)
    steps = np.divide(w - m, s, out=np.zeros_like(w), where=s > 0)
    codes = np.clip(np.round(steps), 0, 15).astype(np.int32)
    return QuantizedWeight(pack_int4(codes), scale, None, n, config, mins)


def take_rows(qw: QuantizedWeight, rows: np.ndarray) -> QuantizedWeight:
    """Some output rows of a quantized weight, in its format (an embedding lookup's rows)."""
    def taken(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array[rows]

    return QuantizedWeight(qw.data[rows], qw.scales[rows], taken(qw.zeros), qw.in_features, qw.config,
                           taken(qw.mins))


def dequantize_rows(qw: QuantizedWeight, rows: np.ndarray) -> np.ndarray:
    """Rows of the float weight, dequantizing only those rows.  rows: [T] -> float32 [T, in]."""
    return dequantize(take_rows(qw, np.asarray(rows)))


def stored_codes(qw: QuantizedWeight) -> np.ndarray:
    """The codes as stored, [out, in] int32: signed for int8, the nibble 0..15 for int4."""
    if qw.config.bits == 8:
        return qw.data.astype(np.int32)
    return unpack_int4(qw.data, qw.in_features).astype(np.int32)


def group_offsets(qw: QuantizedWeight) -> np.ndarray:
    """Each group's offset, float32 [out, groups], so that weight = stored code * scale + offset:
    minus the zero point's worth of scales, or the stored minimum."""
    if qw.mins is not None:
        return qw.mins.astype(np.float32)
    return -_zero_points(qw).astype(np.float32) * qw.scales.astype(np.float32)


def _zero_points(qw: QuantizedWeight) -> np.ndarray:
    """Each group's integer zero point, int32 [out, groups]: 0 for int8, 8 for symmetric int4."""
    if qw.config.minimum:
        raise QuantizationError(f"{qw.config.name} stores a float minimum per group, not an integer "
                                "zero point: use stored_codes and group_offsets")
    shape = (qw.shape[0], qw.num_groups)
    if qw.config.bits == 8:
        return np.zeros(shape, np.int32)
    if qw.zeros is None:
        return np.full(shape, 8, np.int32)
    return unpack_int4(qw.zeros, qw.num_groups).astype(np.int32)


def codes_and_zeros(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """Stored codes [out, in] and zero points [out, groups], so that weight = (code - zero) * scale."""
    zeros = _zero_points(qw)  # refuses the minimum formats first
    return stored_codes(qw), zeros


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """Back to float32: (code - zero) * scale, or code * scale + minimum.  -> [out, in].

    Each step is one pass over the weight: integer codes minus their zero point, a conversion, a
    multiply by each group's scale, and with a minimum an add. (code - zero) * scale is exact in
    float32 (a <= 9-bit integer times an 11-bit float16 mantissa), and so equals code * scale +
    offset as `stored_codes` and `group_offsets` give it; with a minimum, that sum is the one
    rounding.
    """
    n, g = qw.in_features, qw.group_size
    if qw.config.bits == 8:
        codes = qw.data
    else:
        codes = unpack_int4(qw.data, n)  # uint8 0..15
        if not qw.config.minimum:  # subtract the zero point in integers, wrapping into int8
            zeros = np.uint8(8) if qw.zeros is None else unpack_int4(qw.zeros, qw.num_groups)
            codes = _per_group(np.subtract, codes, zeros, g).view(np.int8)
    w = codes.astype(np.float32, order="C")  # a new array: the steps below work in place
    _per_group(np.multiply, w, qw.scales.astype(np.float32), g)
    if qw.mins is not None:
        _per_group(np.add, w, qw.mins.astype(np.float32), g)
    return w


def _per_group(op: np.ufunc, a: np.ndarray, per_group: np.ndarray | np.uint8, group_size: int) -> np.ndarray:
    """a[:, i] = op(a[:, i], per_group[:, i // group_size]) in place, without repeating per_group
    over the inputs: whole groups as an [out, groups, group_size] view, then a ragged last group."""
    if np.ndim(per_group) == 0:
        return op(a, per_group, out=a)
    rows, n = a.shape
    whole = n // group_size
    body = a[:, :whole * group_size].reshape(rows, whole, group_size)
    op(body, per_group[:, :whole, None], out=body)
    if whole < per_group.shape[1]:
        op(a[:, whole * group_size:], per_group[:, whole:], out=a[:, whole * group_size:])
    return a


def concat_out(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output axis (fusing q|k|v or gate|up)."""
    first = parts[0]
    if any(p.config != first.config or p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one format and input width can be fused")
    def stacked(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate(arrays)

    return QuantizedWeight(np.concatenate([p.data for p in parts]),
                           np.concatenate([p.scales for p in parts]), stacked([p.zeros for p in parts]),
                           first.in_features, first.config, stacked([p.mins for p in parts]))


# ---------------------------------------------------------------- int8 K/V


def quantize_kv(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 K or V with one float16 scale per token and head.  x: [T, Hkv, hd] -> int8 [T, Hkv, hd], [T, Hkv]."""
    amax = np.abs(x).max(axis=-1).astype(np.float32)  # [T, Hkv]
    scale = _float16_scale(amax / 127)
    s = scale.astype(np.float32)[..., None]
    steps = np.divide(x, s, out=np.zeros(x.shape, np.float32), where=s > 0)
    return np.clip(np.round(steps), -127, 127).astype(np.int8), scale


def dequantize_kv(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Undo quantize_kv.  codes: [..., hd] int8, scales: [...] -> float32 [..., hd]."""
    return codes.astype(np.float32) * scales.astype(np.float32)[..., None]
