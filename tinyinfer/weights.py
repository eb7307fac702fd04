"""Checkpoint files ⇄ named NumPy arrays.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. We read it directly (memory-mapped),
which also lets us turn bfloat16 — a type NumPy lacks — into float32 from its raw bits.

Reading is lazy where it can be: tensors are views of the memory-mapped file, so only the
bytes a runner keeps are ever read. With ``lazy=True`` bfloat16 tensors stay ``Bf16Array``
views of their raw bits too, converted only when (and as far as) they are used — the torch
runner moves them to the device still in bf16, and a tensor-parallel rank slices out its
shard first, so no rank ever holds a whole checkpoint in float32.

Hugging Face names are mapped to one internal naming shared by both runners. Every linear
weight is stored ``[out_features, in_features]`` so that ``y = x @ W.T``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from tinyinfer.config import ModelConfig
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


class _Source:
    """Takes tensors out of a checkpoint by HF name, remembering which were used."""

    def __init__(self, tensors: dict[str, WeightArray], origin: dict[str, str], prefix: str):
        self.tensors, self.origin, self.prefix = tensors, origin, prefix
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> WeightArray:
        key = self.prefix + name
        if key not in self.tensors:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint")
        value = self.tensors[key]
        if value.shape != shape:
            raise CheckpointError(
                f"tensor {key!r} in {self.origin[key]} has shape {list(value.shape)}, "
                f"but the config implies {list(shape)}"
            )
        self.used.add(key)
        return value

    def unused(self, ignore: tuple[str, ...]) -> list[str]:
        return sorted(k for k in self.tensors if k not in self.used and not k.endswith(ignore))


def map_weights(config: ModelConfig, tensors: dict[str, WeightArray],
                origin: dict[str, str]) -> dict[str, WeightArray]:
    """Rename a checkpoint's HF tensors to tinyinfer's names, checking every shape."""
    if config.family == "gpt2":
        prefix = "transformer." if any(k.startswith("transformer.") for k in tensors) else ""
        source = _Source(tensors, origin, prefix)
        weights = _map_gpt2(config, source)
        ignore = (".attn.bias", ".attn.masked_bias", "lm_head.weight")
    else:
        source = _Source(tensors, origin, "")
        weights = _map_llama(config, source)
        ignore = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if config.tie_word_embeddings else ())
    extra = source.unused(ignore)
    if extra:
        where = origin[extra[0]]
        raise CheckpointError(
            f"unexpected tensor(s) {extra[:5]} in {where}: the checkpoint does not match "
            f"its config.json ({config.model_type}, {config.num_layers} layers)"
        )
    return weights


def _map_gpt2(c: ModelConfig, src: _Source) -> dict[str, WeightArray]:
    d, f = c.hidden_size, c.intermediate_size
    w = {
        "embed": src.take("wte.weight", (c.vocab_size, d)),
        "pos_embed": src.take("wpe.weight", (c.max_position_embeddings, d)),
        "final_norm.weight": src.take("ln_f.weight", (d,)),
        "final_norm.bias": src.take("ln_f.bias", (d,)),
    }
    for i in range(c.num_layers):
        h, L = f"h.{i}.", f"layers.{i}."
        w[L + "attn_norm.weight"] = src.take(h + "ln_1.weight", (d,))
        w[L + "attn_norm.bias"] = src.take(h + "ln_1.bias", (d,))
        # GPT-2's Conv1D stores [in, out]; q, k and v are fused along the output axis.
        qkv = src.take(h + "attn.c_attn.weight", (d, 3 * d)).T
        qkv_b = src.take(h + "attn.c_attn.bias", (3 * d,))
        for j, name in enumerate("qkv"):
            w[L + f"{name}.weight"] = qkv[j * d:(j + 1) * d]
            w[L + f"{name}.bias"] = qkv_b[j * d:(j + 1) * d]
        w[L + "o.weight"] = src.take(h + "attn.c_proj.weight", (d, d)).T
        w[L + "o.bias"] = src.take(h + "attn.c_proj.bias", (d,))
        w[L + "mlp_norm.weight"] = src.take(h + "ln_2.weight", (d,))
        w[L + "mlp_norm.bias"] = src.take(h + "ln_2.bias", (d,))
        w[L + "fc.weight"] = src.take(h + "mlp.c_fc.weight", (d, f)).T
        w[L + "fc.bias"] = src.take(h + "mlp.c_fc.bias", (f,))
        w[L + "proj.weight"] = src.take(h + "mlp.c_proj.weight", (f, d)).T
        w[L + "proj.bias"] = src.take(h + "mlp.c_proj.bias", (d,))
    return w


def _map_llama(c: ModelConfig, src: _Source) -> dict[str, WeightArray]:
    d, f = c.hidden_size, c.intermediate_size
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {
        "embed": src.take("model.embed_tokens.weight", (c.vocab_size, d)),
        "final_norm.weight": src.take("model.norm.weight", (d,)),
    }
    if not c.tie_word_embeddings:
        w["lm_head"] = src.take("lm_head.weight", (c.vocab_size, d))
    for i in range(c.num_layers):
        h, L = f"model.layers.{i}.", f"layers.{i}."
        w[L + "attn_norm.weight"] = src.take(h + "input_layernorm.weight", (d,))
        w[L + "mlp_norm.weight"] = src.take(h + "post_attention_layernorm.weight", (d,))
        for name, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            w[L + f"{name}.weight"] = src.take(h + f"self_attn.{name}_proj.weight", (out, d))
            if c.qkv_bias:
                w[L + f"{name}.bias"] = src.take(h + f"self_attn.{name}_proj.bias", (out,))
        w[L + "o.weight"] = src.take(h + "self_attn.o_proj.weight", (d, q_out))
        if c.o_bias:
            w[L + "o.bias"] = src.take(h + "self_attn.o_proj.bias", (d,))
        w[L + "gate.weight"] = src.take(h + "mlp.gate_proj.weight", (f, d))
        w[L + "up.weight"] = src.take(h + "mlp.up_proj.weight", (f, d))
        w[L + "down.weight"] = src.take(h + "mlp.down_proj.weight", (d, f))
        if c.mlp_bias:
            for name, out in (("gate", f), ("up", f), ("down", d)):
                w[L + f"{name}.bias"] = src.take(h + f"mlp.{name}_proj.bias", (out,))
    return w


def internal_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every runner weight name and its shape, in model order, from the config alone."""
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    gpt2 = c.family == "gpt2"
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d)}
    if gpt2:
        shapes["pos_embed"] = (c.max_position_embeddings, d)
    linears = {"q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d), "o": (d, q_out)}
    linears.update({"fc": (f, d), "proj": (d, f)} if gpt2 else
                   {"gate": (f, d), "up": (f, d), "down": (d, f)})
    bias = {"q": c.qkv_bias, "k": c.qkv_bias, "v": c.qkv_bias, "o": c.o_bias,
            "fc": True, "proj": True, "gate": c.mlp_bias, "up": c.mlp_bias, "down": c.mlp_bias}
    for i in range(c.num_layers):
        for norm in ("attn_norm", "mlp_norm"):
            shapes[f"layers.{i}.{norm}.weight"] = (d,)
            if gpt2:
                shapes[f"layers.{i}.{norm}.bias"] = (d,)
        for name, shape in linears.items():
            shapes[f"layers.{i}.{name}.weight"] = shape
            if bias[name]:
                shapes[f"layers.{i}.{name}.bias"] = (shape[0],)
    shapes["final_norm.weight"] = (d,)
    if gpt2:
        shapes["final_norm.bias"] = (d,)
    if not gpt2 and not c.tie_word_embeddings:  # GPT-2 checkpoints always tie their head
        shapes["lm_head"] = (v, d)
    return shapes


def load_weights(folder: str | Path, config: ModelConfig, lazy: bool = False) -> dict[str, WeightArray]:
    """Read and map a checkpoint folder's weights (float32/float16 as stored; bf16 → float32,
    or with ``lazy`` a ``Bf16Array`` to convert when used)."""
    tensors, origin = read_checkpoint(folder, lazy)
    return map_weights(config, tensors, origin)
