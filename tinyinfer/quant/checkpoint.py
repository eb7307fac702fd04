"""Whole quantized models on disk and at load: the weight dict in, a quantized weight dict out.

`quantize_weights` quantizes a runner's weight dict as a model loads (`tinyinfer.load(...,
quantize="int8")`). `save_quantized` writes it as a folder `tinyinfer.load` reads back with
`load_quantized`: ``model.safetensors`` holding each linear weight as ``name.qdata`` (codes),
``name.scales`` and, asymmetric int4 only, ``name.zeros`` (or ``name.mins``), next to ``quantization.json``, which
names the format and whether the embedding and LM head are in it (`read_quant_config`). The formats themselves are in `tinyinfer.quant.formats`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tinyinfer.display import progress
from tinyinfer.config import ModelConfig
from tinyinfer.errors import CheckpointError
from tinyinfer.quant.formats import QuantConfig, QuantizationError, QuantizedWeight, quantize
from tinyinfer.weights import (Bf16Array, float32_to_bf16_bits, internal_shapes, read_checkpoint,
                               write_safetensors)

CONFIG_FILE = "quantization.json"
FORMAT = "tinyinfer-quant-v1"


def quantize_weights(weights: dict[str, np.ndarray], config: QuantConfig
                     ) -> dict[str, np.ndarray | QuantizedWeight]:
    """Quantize every linear weight of a runner's weight dict (and with ``config.head`` the
    embedding and LM head: a tied model's one table); leave the rest as they are."""
    return {name: quantize(value, config) if config.applies_to(name) else value
            for name, value in progress.track(weights.items(), f"quantize to {config.name}: tensors")}


def save_quantized(folder: str | Path, weights: dict[str, np.ndarray | QuantizedWeight],
                   config: QuantConfig, float_dtype: str = "float32") -> Path:
    """Write quantized weights as `model.safetensors` + `quantization.json` (runner names).

    A QuantizedWeight ``name`` is stored as ``name.qdata``, ``name.scales`` and (asymmetric)
    ``name.zeros`` or ``name.mins``; other arrays as ``name`` in `float_dtype`: float32, float16 or bfloat16.
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
            if value.mins is not None:
                tensors[f"{name}.mins"] = value.mins
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
                           symmetric=bool(meta["symmetric"]), minimum=bool(meta.get("minimum", False)),
                           head=bool(meta.get("head", False)))
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
        if not qconfig.applies_to(name):
            weights[name] = take(name, shape)
            continue
        out, n = shape
        groups = math.ceil(n / (qconfig.group_size or n))
        if qconfig.bits == 8:
            data = take(f"{name}.qdata", (out, n), np.int8)
        else:
            data = take(f"{name}.qdata", (out, math.ceil(n / 2)), np.uint8)
        scales = take(f"{name}.scales", (out, groups), np.float16)
        zeros = mins = None
        if qconfig.minimum:
            mins = np.asarray(take(f"{name}.mins", (out, groups), np.float16))
        elif not qconfig.symmetric:
            zeros = np.asarray(take(f"{name}.zeros", (out, math.ceil(groups / 2)), np.uint8))
        weights[name] = QuantizedWeight(np.asarray(data), np.asarray(scales), zeros, n,
                                        qconfig.weight_format, mins)
    extra = sorted(set(tensors) - used)
    if extra:
        raise CheckpointError(f"unexpected tensor(s) {extra[:5]} in {folder}: the quantized checkpoint "
                              "does not match its config.json")
    return weights, qconfig
