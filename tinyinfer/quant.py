"""Weight-only quantization: int8 per output channel, int4 in groups, and int8 K/V.

A quantized weight keeps small integer *codes* and, per group of inputs of one output row,
a float16 *scale* (and for asymmetric int4 an integer *zero point*):

    weight ≈ (code - zero) * scale

* int8: one group per output row (per-output-channel), codes in [-128, 127], zero 0.
* int4: groups of 32 / 64 / 128 inputs (the last group of a row may be shorter), two codes
  packed per byte. Symmetric: codes in [-8, 7], stored as nibbles code + 8 (zero 8).
  Asymmetric: codes in [0, 15] with a zero point per group, itself packed as a nibble.

Every scale is the smallest float16 whose grid covers the group's range, so each weight is
off by at most half a scale step. Only the transformer blocks' linear layers are quantized;
embeddings, the LM head (its errors land straight on the logits), norms and biases stay in
floating point.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tinyinfer.config import ModelConfig
from tinyinfer.display import progress
from tinyinfer.errors import CheckpointError, TinyInferError
from tinyinfer.weights import (
    Bf16Array,
    float32_to_bf16_bits,
    internal_shapes,
    read_checkpoint,
    write_safetensors,
)

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "fc", "proj")
CONFIG_FILE = "quantization.json"
FORMAT = "tinyinfer-quant-v1"


class QuantizationError(TinyInferError):
    """A quantization format is asked for that does not exist, or a weight cannot be stored in it."""


# ---------------------------------------------------------------- formats


@dataclass(frozen=True)
class QuantConfig:
    """A weight format: bits, group size (int4) and whether int4 groups carry zero points."""

    bits: int
    group_size: int | None = None  # int4 only; int8 always uses one group per output row
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise QuantizationError(f"bits must be 8 or 4, got {self.bits}")
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise QuantizationError("int8 is per-output-channel and symmetric: drop the group size "
                                    "and --asymmetric, or use --bits 4")
        if self.bits == 4 and self.group_size not in GROUP_SIZES:
            raise QuantizationError(f"int4 group size must be one of {GROUP_SIZES}, "
                                    f"got {self.group_size}")

    @property
    def name(self) -> str:
        """Short name: int8, int4-g128, int4-g64-asym."""
        if self.bits == 8:
            return "int8"
        return f"int4-g{self.group_size}" + ("" if self.symmetric else "-asym")

    @classmethod
    def parse(cls, name: str) -> QuantConfig:
        """Read a short name back: 'int8', 'int4' (= int4-g128), 'int4-g64', 'int4-g32-asym'."""
        parts = name.strip().lower().split("-")
        try:
            if parts == ["int8"]:
                return cls(bits=8)
            if parts[0] == "int4" and len(parts) <= 3:
                group = int(parts[1].removeprefix("g")) if len(parts) > 1 else 128
                if len(parts) == 3 and parts[2] != "asym":
                    raise ValueError(parts[2])
                return cls(bits=4, group_size=group, symmetric=len(parts) < 3)
        except ValueError:
            pass
        raise QuantizationError(f"unknown quantization {name}: use int8, int4, int4-g32, int4-g64, "
                                "int4-g128, optionally with -asym for int4 (e.g. int4-g64-asym)")

    @property
    def code_range(self) -> tuple[int, int]:
        """Smallest and largest code: signed when symmetric, unsigned with a zero point otherwise."""
        if self.symmetric:
            return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        return 0, 2 ** self.bits - 1


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A linear layer's [out, in] weight as integer codes plus float16 scales (and zero points)."""

    data: np.ndarray  # int8 [out, in], or uint8 [out, ceil(in / 2)]: two int4 nibbles per byte
    scales: np.ndarray  # float16 [out, groups]; int8 has one group per row
    zeros: np.ndarray | None  # uint8 [out, ceil(groups / 2)] packed zero points (asymmetric int4)
    in_features: int
    config: QuantConfig

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
        return self.data.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)


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
    """Undo pack_int4.  uint8 [..., ceil(n / 2)] -> uint8 [..., n] in 0..15."""
    pairs = np.stack([packed & 0x0F, packed >> 4], axis=-1)  # [..., ceil(n/2), 2]
    return pairs.reshape(*packed.shape[:-1], -1)[..., :n]


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
    w = np.asarray(weight, dtype=np.float32)  # [out, in]
    if w.ndim != 2 or 0 in w.shape:
        raise QuantizationError(f"only non-empty 2-D weights can be quantized, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise QuantizationError("the weight holds NaN or infinity: the checkpoint is corrupt")
    out, n = w.shape
    group = config.group_size or n
    starts = np.arange(0, n, group)  # first input of each group
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


def codes_and_zeros(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """Stored codes [out, in] and zero points [out, groups], so that weight = (code - zero) * scale."""
    out, n = qw.shape
    if qw.config.bits == 8:
        return qw.data.astype(np.int32), np.zeros((out, qw.num_groups), np.int32)
    codes = unpack_int4(qw.data, n).astype(np.int32)
    if qw.zeros is None:
        return codes, np.full((out, qw.num_groups), 8, np.int32)
    return codes, unpack_int4(qw.zeros, qw.num_groups).astype(np.int32)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """Back to float32: (code - zero) * scale, each group with its own scale.  -> [out, in].

    The products are exact in float32 (a 9-bit integer times an 11-bit float16 mantissa).
    """
    codes, zeros = codes_and_zeros(qw)
    n, g = qw.in_features, qw.group_size
    z = _per_element(zeros, g, n)
    s = _per_element(qw.scales.astype(np.float32), g, n)
    return (codes - z).astype(np.float32) * s


def concat_out(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one format along the output axis (fusing q|k|v or gate|up)."""
    first = parts[0]
    if any(p.config != first.config or p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one format and input width can be fused")
    zeros = None if first.zeros is None else np.concatenate([p.zeros for p in parts])
    return QuantizedWeight(np.concatenate([p.data for p in parts]),
                           np.concatenate([p.scales for p in parts]), zeros,
                           first.in_features, first.config)


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


# ---------------------------------------------------------------- whole models


def is_quantized_name(name: str) -> bool:
    """Whether a runner weight name is a block's linear layer, the weights quantization applies to."""
    parts = name.split(".")
    return parts[0] == "layers" and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


def quantize_weights(weights: dict[str, np.ndarray], config: QuantConfig
                     ) -> dict[str, np.ndarray | QuantizedWeight]:
    """Quantize every linear weight of a runner's weight dict; leave the rest as they are."""
    return {name: quantize(value, config) if is_quantized_name(name) else value
            for name, value in progress.track(weights.items(), f"quantize to {config.name}: tensors")}


def weights_nbytes(weights: dict[str, np.ndarray | QuantizedWeight]) -> int:
    """Bytes the weights hold in memory, as they are stored (codes, scales, float arrays)."""
    return sum(int(w.nbytes) for w in weights.values())


def save_quantized(folder: str | Path, weights: dict[str, np.ndarray | QuantizedWeight],
                   config: QuantConfig, float_dtype: str = "float32") -> Path:
    """Write quantized weights as `model.safetensors` + `quantization.json` (runner names).

    A QuantizedWeight ``name`` is stored as ``name.qdata``, ``name.scales`` and (asymmetric)
    ``name.zeros``; other arrays as ``name`` in `float_dtype`: float32, float16 or bfloat16.
    """
    if float_dtype not in ("float32", "float16", "bfloat16"):
        raise QuantizationError(f"float_dtype must be float32, float16 or bfloat16, got {float_dtype}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray | Bf16Array] = {}
    floats: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if isinstance(value, QuantizedWeight):
            tensors[f"{name}.qdata"] = value.data
            tensors[f"{name}.scales"] = value.scales
            if value.zeros is not None:
                tensors[f"{name}.zeros"] = value.zeros
        else:
            floats[name] = np.asarray(value, dtype=np.float32)
    for name, value in floats.items():
        tensors[name] = (Bf16Array(float32_to_bf16_bits(value)) if float_dtype == "bfloat16"
                         else value.astype(float_dtype))
    write_safetensors(folder / "model.safetensors", tensors)
    quantized = sorted(name for name, value in weights.items() if isinstance(value, QuantizedWeight))
    meta = {"format": FORMAT, **asdict(config), "float_dtype": float_dtype, "quantized": quantized}
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return folder


def read_quant_config(folder: str | Path) -> QuantConfig | None:
    """The QuantConfig of a folder written by save_quantized, or None for a plain checkpoint."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a tinyinfer quantization config ({FORMAT})")
        return QuantConfig(bits=int(meta["bits"]), group_size=meta["group_size"],
                           symmetric=bool(meta["symmetric"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, QuantizationError) as exc:
        raise CheckpointError(f"{path} is corrupt ({exc}): re-run tinyinfer quantize") from exc


def load_quantized(folder: str | Path, model: ModelConfig
                   ) -> tuple[dict[str, np.ndarray | QuantizedWeight], QuantConfig]:
    """Read a folder written by save_quantized, checking every name and shape against `model`."""
    qconfig = read_quant_config(folder)
    if qconfig is None:
        raise CheckpointError(f"no {CONFIG_FILE} in {folder}: it is not a quantized checkpoint")
    tensors, _ = read_checkpoint(folder)
    weights: dict[str, np.ndarray | QuantizedWeight] = {}
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], dtype: type | None = None) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"tensor {name} is missing from the quantized checkpoint in {folder}")
        value = tensors[name]
        if value.shape != shape or (dtype is not None and value.dtype != dtype):
            raise CheckpointError(f"tensor {name} in {folder} is {value.dtype}{list(value.shape)}, "
                                  f"expected {np.dtype(dtype or value.dtype)}{list(shape)}: "
                                  "re-run tinyinfer quantize")
        used.add(name)
        return value

    for name, shape in internal_shapes(model).items():
        if not is_quantized_name(name):
            weights[name] = take(name, shape)
            continue
        out, n = shape
        groups = math.ceil(n / (qconfig.group_size or n))
        if qconfig.bits == 8:
            data = take(f"{name}.qdata", (out, n), np.int8)
        else:
            data = take(f"{name}.qdata", (out, math.ceil(n / 2)), np.uint8)
        scales = take(f"{name}.scales", (out, groups), np.float16)
        zeros = None if qconfig.symmetric else take(f"{name}.zeros", (out, math.ceil(groups / 2)), np.uint8)
        weights[name] = QuantizedWeight(np.asarray(data), np.asarray(scales),
                                        None if zeros is None else np.asarray(zeros), n, qconfig)
    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"unexpected tensor(s) {extra[:5]} in {folder}: the quantized checkpoint "
                              "does not match its config.json")
    return weights, qconfig


# ---------------------------------------------------------------- error statistics


@dataclass(frozen=True)
class LayerError:
    """How far one quantized weight is from the original."""

    name: str
    relative: float  # ||W - Ŵ||_F / ||W||_F
    max_abs: float  # largest |W - Ŵ| of any element
    mean_abs: float


@dataclass(frozen=True)
class Histogram:
    """Counts of values in equal-width bins between edges[0] and edges[-1]."""

    edges: tuple[float, ...]  # [bins + 1]
    counts: tuple[int, ...]  # [bins]


def layer_error(name: str, weight: np.ndarray, qw: QuantizedWeight) -> LayerError:
    """Relative (Frobenius), max and mean absolute error of one quantized weight."""
    w = np.asarray(weight, dtype=np.float64)
    err = np.abs(w - dequantize(qw))
    norm = np.linalg.norm(w)
    return LayerError(name=name, relative=float(np.linalg.norm(err) / norm) if norm else 0.0,
                      max_abs=float(err.max()), mean_abs=float(err.mean()))


def layer_errors(weights: dict[str, np.ndarray], quantized: dict[str, np.ndarray | QuantizedWeight]
                 ) -> list[LayerError]:
    """LayerError of every quantized weight, in model order."""
    return [layer_error(name, weights[name], q)
            for name, q in progress.track(quantized.items(), "quantization error: tensors")
            if isinstance(q, QuantizedWeight)]


def histogram(values: np.ndarray, bins: int = 41) -> Histogram:
    """Equal-width histogram over the values' full range, for plotting in a terminal."""
    counts, edges = np.histogram(np.asarray(values, dtype=np.float64).ravel(), bins=bins)
    return Histogram(edges=tuple(float(e) for e in edges), counts=tuple(int(c) for c in counts))


def error_histograms(weight: np.ndarray, qw: QuantizedWeight,
                     bins: int = 41) -> tuple[Histogram, Histogram]:
    """Histograms of a weight's values and of its quantization errors (W - Ŵ)."""
    w = np.asarray(weight, dtype=np.float32)
    return histogram(w, bins), histogram(w - dequantize(qw), bins)


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryRow:
    """Weight bytes of a whole model in one format."""

    format: str
    parameters: int
    linear_bytes: int  # codes (or floats) of the blocks' linear weights
    overhead_bytes: int  # scales and zero points
    other_bytes: int  # embeddings, LM head, norms, biases: kept in floating point

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.overhead_bytes + self.other_bytes

    @property
    def bits_per_parameter(self) -> float:
        return 8 * self.total_bytes / self.parameters


MEMORY_FORMATS = ("fp32", "bf16", "int8", "int4-g128", "int4-g64", "int4-g32", "int4-g128-asym")


def memory_row(model: ModelConfig, fmt: str) -> MemoryRow:
    """Bytes of `model`'s weights in one format; the unquantized rest is kept at 16 bits."""
    shapes = internal_shapes(model)
    linear = [s for name, s in shapes.items() if is_quantized_name(name)]
    other = sum(math.prod(s) for name, s in shapes.items() if not is_quantized_name(name))
    params = other + sum(out * n for out, n in linear)
    if fmt in ("fp32", "bf16", "fp16"):
        size = 4 if fmt == "fp32" else 2
        return MemoryRow(fmt, params, size * (params - other), 0, size * other)
    q = QuantConfig.parse(fmt)
    codes = overhead = 0
    for out, n in linear:
        groups = math.ceil(n / (q.group_size or n))
        codes += out * (n if q.bits == 8 else math.ceil(n / 2))
        overhead += out * groups * 2 + (0 if q.symmetric else out * math.ceil(groups / 2))
    return MemoryRow(q.name, params, codes, overhead, 2 * other)


def weight_memory_table(model: ModelConfig, formats: tuple[str, ...] = MEMORY_FORMATS) -> list[MemoryRow]:
    """Weight bytes per format for any config (no weights needed): the C11 table."""
    return [memory_row(model, fmt) for fmt in formats]


def format_memory_table(rows: list[MemoryRow]) -> str:
    """The table as aligned text: total (decimal GB / MB), bits per parameter, scale overhead."""
    def human(n: float) -> str:
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"

    lines = [f"{'format':<15} {'weights':>10} {'bits/param':>10} {'scales+zeros':>13}"]
    for r in rows:
        lines.append(f"{r.format:<15} {human(r.total_bytes):>10} {r.bits_per_parameter:>10.2f} "
                     f"{human(r.overhead_bytes):>13}")
    return "\n".join(lines)
