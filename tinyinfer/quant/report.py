"""What quantization costs and saves: each weight's rounding error, and bytes per format.

Error: `layer_error` compares one float weight W with its quantized Ŵ (relative Frobenius
error ‖W − Ŵ‖/‖W‖, largest and mean absolute error); `histogram` / `error_histograms` bin
the values and the errors for a terminal. `error_report` measures a whole model once, while
its float weights are still at hand: `tinyinfer.load(..., quantize=..., measure_error=True)`
keeps the result as `Model.quant_errors`, which the TUI's Quantization panel shows.

Memory: `weight_memory_table` is the weight-memory table, bytes per format for any config
(no weights needed), counted with `QuantConfig.stored_bytes`; `weights_nbytes` counts the
bytes a loaded weight dict holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tinyinfer.display import progress
from tinyinfer.config import ModelConfig
from tinyinfer.quant.formats import (QuantConfig, QuantizedWeight, dequantize, is_quantized_name)
from tinyinfer.weights import internal_shapes

BINS = 24  # histogram bins: one terminal character each

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


def histogram(values: np.ndarray, bins: int = BINS) -> Histogram:
    """Equal-width histogram over the values' full range, for plotting in a terminal."""
    counts, edges = np.histogram(np.asarray(values, dtype=np.float64).ravel(), bins=bins)
    return Histogram(edges=tuple(float(e) for e in edges), counts=tuple(int(c) for c in counts))


def error_histograms(weight: np.ndarray, qw: QuantizedWeight,
                     bins: int = BINS) -> tuple[Histogram, Histogram]:
    """Histograms of a weight's values and of its quantization errors (W - Ŵ)."""
    w = np.asarray(weight, dtype=np.float32)
    return histogram(w, bins), histogram(w - dequantize(qw), bins)


@dataclass(frozen=True)
class ErrorReport:
    """A quantized model's rounding error, measured once against its float weights."""

    layers: tuple[LayerError, ...]  # every quantized weight, in model order
    histograms: tuple[tuple[Histogram, Histogram], ...]  # per layer: (weights, errors)


def error_report(weights: dict[str, np.ndarray], quantized: dict[str, np.ndarray | QuantizedWeight],
                 bins: int = BINS) -> ErrorReport:
    """LayerError and histograms of every quantized weight (as slow as quantizing again)."""
    layers = tuple(layer_errors(weights, quantized))
    return ErrorReport(layers, tuple(error_histograms(weights[e.name], quantized[e.name], bins)
                                     for e in layers))


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryRow:
    """Weight bytes of a whole model in one format."""

    format: str
    parameters: int
    linear_bytes: int  # codes (or floats) of the quantized weights: the blocks' linear layers (+head)
    overhead_bytes: int  # scales and zero points
    other_bytes: int  # embeddings, LM head (unless +head), norms, biases: kept in floating point

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.overhead_bytes + self.other_bytes

    @property
    def bits_per_parameter(self) -> float:
        return 8 * self.total_bytes / self.parameters


MEMORY_FORMATS = ("fp32", "bf16", "int8", "int4-g128", "int4-g64", "int4-g32", "int4-g128-asym",
                  "int8+head", "int4-g128+head")


def memory_row(model: ModelConfig, fmt: str) -> MemoryRow:
    """Bytes of `model`'s weights in one format (int8+head: the embedding and LM head in it too);
    the unquantized rest is kept at 16 bits."""
    shapes = internal_shapes(model)
    if fmt in ("fp32", "bf16", "fp16"):
        params = sum(math.prod(s) for s in shapes.values())
        linear_params = sum(math.prod(s) for name, s in shapes.items() if is_quantized_name(name))
        size = 4 if fmt == "fp32" else 2
        return MemoryRow(fmt, params, size * linear_params, 0, size * (params - linear_params))
    q = QuantConfig.parse(fmt)
    linear = [s for name, s in shapes.items() if q.applies_to(name)]
    other = sum(math.prod(s) for name, s in shapes.items() if not q.applies_to(name))
    params = other + sum(out * n for out, n in linear)
    sizes = [q.stored_bytes(out, n) for out, n in linear]
    return MemoryRow(q.name, params, sum(c for c, _ in sizes), sum(o for _, o in sizes), 2 * other)


def weight_memory_table(model: ModelConfig, formats: tuple[str, ...] = MEMORY_FORMATS) -> list[MemoryRow]:
    """Weight bytes per format for any config (no weights needed): the C11 table.

    The simulator estimates the same bytes from parameter counts (simulate.memory.weight_bytes);
    tests/test_simulate.py pins the two together.
    """
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


def weights_nbytes(weights: dict[str, np.ndarray | QuantizedWeight]) -> int:
    """Bytes the weights hold in memory, as they are stored (codes, scales, float arrays)."""
    return sum(int(w.nbytes) for w in weights.values())
