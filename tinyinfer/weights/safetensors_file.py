"""Safetensors files ⇄ named NumPy arrays.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. We read it directly (memory-mapped),
which also lets us turn bfloat16 — a type NumPy lacks — into float32 from its raw bits.

Reading is lazy where it can be: tensors are views of the memory-mapped file, so only the
bytes a runner keeps are ever read. With ``lazy=True`` bfloat16 tensors stay ``Bf16Array``
views of their raw bits too, converted only when (and as far as) they are used — the torch
runner moves them to the device still in bf16, and a tensor-parallel rank slices out its
shard first, so no rank ever holds a whole checkpoint in float32.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from tinyinfer.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items() if name != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift the 16 stored bits up."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even) and return its 16 raw bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


class Bf16Array:
    """A bfloat16 tensor left in its file: it slices and transposes like an array, for free,
    and becomes float32 only when NumPy asks for its values (``np.asarray``)."""

    def __init__(self, bits: np.ndarray):
        self.bits = bits  # uint16, usually a view of the memory-mapped file

    shape = property(lambda self: self.bits.shape)
    ndim = property(lambda self: self.bits.ndim)
    dtype = np.dtype(np.float32)  # what its values become
    T = property(lambda self: Bf16Array(self.bits.T))

    def __getitem__(self, key: object) -> Bf16Array:
        return Bf16Array(self.bits[key])

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        values = bf16_bits_to_float32(np.ascontiguousarray(self.bits))
        return values if dtype is None else values.astype(dtype)


WeightArray = np.ndarray | Bf16Array


def read_safetensors(path: str | Path, lazy: bool = False) -> dict[str, WeightArray]:
    """Every tensor of one .safetensors file as NumPy views of the file.

    bf16 becomes float32, or with ``lazy`` stays a ``Bf16Array`` until used.
    """
    path = Path(path)
    try:
        blob = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if blob.size < 8:
        raise CheckpointError(f"{path} is not a safetensors file (only {blob.size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(blob[:8]))
    if header_len > min(_MAX_HEADER, blob.size - 8):
        raise CheckpointError(f"{path} is corrupt: header length {header_len} exceeds the file")
    try:
        header = json.loads(bytes(blob[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupt: its header is not JSON ({exc})") from exc
    data = blob[8 + header_len:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensor = _tensor_from_bytes(path, name, info, data)
        tensors[name] = tensor if lazy or not isinstance(tensor, Bf16Array) else np.asarray(tensor)
    return tensors


def _tensor_from_bytes(path: Path, name: str, info: dict, data: np.ndarray) -> WeightArray:
    try:
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(s) for s in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from exc
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if not 0 <= start <= end <= data.size or end - start != expected:
        raise CheckpointError(
            f"{path} is corrupt: tensor {name!r} needs {expected} bytes at [{start}, {end}) "
            f"but the data section holds {data.size} bytes"
        )
    array = data[start:end].view(dtype).reshape(shape)
    if info["dtype"] == "BF16":
        return Bf16Array(array)
    return array


def write_safetensors(path: str | Path, tensors: dict[str, WeightArray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write named arrays as one .safetensors file; a ``Bf16Array`` is stored as bfloat16.

    Written by hand, as it is read above (an 8-byte header length, a JSON header of dtypes,
    shapes and byte offsets, then the raw little-endian bytes): the safetensors library's NumPy
    writer has no bfloat16, the dtype checkpoints use most, and the torch one needs PyTorch.
    """
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, value in tensors.items():
        if isinstance(value, Bf16Array):
            data, dtype = np.ascontiguousarray(value.bits), "BF16"
        else:
            data = np.ascontiguousarray(value)
            dtype = _NAMES.get(data.dtype.type)
            if dtype is None:
                raise CheckpointError(f"cannot store tensor {name} of dtype {data.dtype} in safetensors")
        data = data.astype(data.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": dtype, "shape": list(data.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        blobs.append(data)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data.tobytes())


def read_checkpoint(folder: str | Path, lazy: bool = False) -> tuple[dict[str, WeightArray], dict[str, str]]:
    """All tensors of a HF folder (single file or sharded index), and which file held each."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{index} is corrupt: no readable weight_map ({exc})") from exc
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [single.name]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        if len(found) == 1:
            files = found
        else:
            raise CheckpointError(
                f"no model.safetensors or model.safetensors.index.json in {folder} "
                "(tinyinfer reads safetensors checkpoints; convert .bin files with transformers)"
            )
    tensors: dict[str, WeightArray] = {}
    origin: dict[str, str] = {}
    for name in files:
        shard = folder / name
        if not shard.is_file():
            raise CheckpointError(f"{index} names shard {name}, which is missing from {folder}")
        for key, value in read_safetensors(shard, lazy).items():
            tensors[key] = value
            origin[key] = str(shard)
    return tensors, origin
