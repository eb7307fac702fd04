"""The torch runner's weights: moved to the device once, fused, or made random on the device.

q, k and v are concatenated along the output axis into one matrix, and so are gate and up
(Llama): at batch 1 each matrix product is one pass over its weights, and one larger pass
runs closer to the memory bandwidth than several small ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.quant import QuantizedWeight, concat_out
from tinyinfer.runners.torch_layers import Int4Weight, QuantWeight, device_weight, lookup_weight
from tinyinfer.weights import Bf16Array

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

Pair = tuple[Tensor, Tensor | None]  # (weight, bias or None)
LinearPair = tuple[Tensor | QuantWeight, Tensor | None]  # a linear weight may be int8 / int4


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block's weights, fused and on the device."""

    attn_norm: Pair
    qkv: LinearPair  # [(H + 2 Hkv) hd, D]
    o: LinearPair  # [D, H hd]
    mlp_norm: Pair
    mlp_in: LinearPair  # gate|up [2F, D] (Llama) or fc [F, D] (GPT-2)
    mlp_out: LinearPair  # down / proj [D, F]


@dataclass(frozen=True)
class DeviceWeights:
    """Every weight of a model on one device, in one dtype."""

    embed: Tensor | QuantWeight  # [V, D]; quantized: rows dequantized as they are looked up
    pos_embed: Tensor | None  # [max positions, D] (GPT-2)
    head: Tensor | QuantWeight  # [V, D]; the embedding itself when tied (and its layout allows)
    final_norm: Pair
    layers: list[LayerWeights]

    @classmethod
    def load(cls, config: ModelConfig, weights: Mapping[str, np.ndarray | Tensor | QuantizedWeight],
             device: torch.device, dtype: torch.dtype, quant_kernel: str = "torch") -> DeviceWeights:
        """Move named weights (the reference's names) to the device, fusing q|k|v and gate|up.

        Quantized linear weights stay int8 / int4, in the layout of the matmul kernel
        ``quant_kernel`` picks ("torch", "triton" or "auto": ``torch_layers.device_weight``), and
        so does a quantized LM head. A quantized embedding is looked up in the head's layout
        when tied, except torch's tiled int4, which cannot be gathered by row: then, as for an
        untied embedding, the stored codes (``torch_layers.lookup_weight``).
        """

        def get(name: str) -> Tensor | None:
            if name not in weights:
                return None
            value = weights[name]
            if isinstance(value, Bf16Array):  # still bf16 bits in the file: no float32 on the host
                bits = np.require(value.bits, requirements=["C", "W"])
                value = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
            elif isinstance(value, np.ndarray):
                value = torch.from_numpy(np.require(value, requirements=["C", "W"]))
            if not isinstance(value, Tensor):
                raise TinyInferError(f"weight {name} is a {type(value).__name__}, not an array: "
                                     "only the blocks' linear layers, the embedding and the LM "
                                     "head can be quantized")
            return value.to(device=device, dtype=dtype)

        def linear_weight(prefix: str, names: tuple[str, ...]) -> Tensor | QuantWeight:
            parts = [weights.get(f"{prefix}{n}.weight") for n in names]
            if all(isinstance(p, QuantizedWeight) for p in parts):
                return device_weight(concat_out(parts), device, dtype,  # type: ignore[arg-type]
                                     kernel=quant_kernel)
            return torch.cat([need(f"{prefix}{n}.weight") for n in names])

        def need(name: str) -> Tensor:
            tensor = get(name)
            if tensor is None:
                raise TinyInferError(f"weight {name} is missing: the checkpoint does not match its config")
            return tensor

        def fused(prefix: str, names: tuple[str, ...], suffix: str) -> Tensor | None:
            parts = [get(f"{prefix}{n}.{suffix}") for n in names]
            present = [p for p in parts if p is not None]
            return torch.cat(present) if present else None

        mlp_in, mlp_out = (("gate", "up"), "down") if config.family == "llama" else (("fc",), "proj")
        layers = []
        for i in range(config.num_layers):
            p = f"layers.{i}."
            layers.append(LayerWeights(
                attn_norm=(need(f"{p}attn_norm.weight"), get(f"{p}attn_norm.bias")),
                qkv=(linear_weight(p, ("q", "k", "v")), fused(p, ("q", "k", "v"), "bias")),
                o=(linear_weight(p, ("o",)), get(f"{p}o.bias")),
                mlp_norm=(need(f"{p}mlp_norm.weight"), get(f"{p}mlp_norm.bias")),
                mlp_in=(linear_weight(p, mlp_in), fused(p, mlp_in, "bias")),
                mlp_out=(linear_weight(p, (mlp_out,)), get(f"{p}{mlp_out}.bias")),
            ))
        tied = "lm_head" not in weights
        table = weights.get("embed")
        head_table = table if tied else weights["lm_head"]
        head = (device_weight(head_table, device, dtype, kernel=quant_kernel)
                if isinstance(head_table, QuantizedWeight) else need("embed" if tied else "lm_head"))
        if tied and not isinstance(head, Int4Weight):
            embed: Tensor | QuantWeight = head
        elif isinstance(table, QuantizedWeight):
            embed = lookup_weight(table, device)
        else:
            embed = need("embed")
        return cls(embed=embed, pos_embed=get("pos_embed"), head=head,
                   final_norm=(need("final_norm.weight"), get("final_norm.bias")), layers=layers)

    def streamed_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer, the final norm and the LM head.

        The input embedding (and GPT-2's position table) is read one row per token, so it counts
        only when it is also the head.
        """
        tensors: list[Tensor | QuantWeight | None] = [self.head, *self.final_norm]
        for layer in self.layers:
            for pair in (layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.mlp_in,
                         layer.mlp_out):
                tensors.extend(pair)
        return sum(_nbytes(t) for t in tensors if t is not None)


def _nbytes(value: Tensor | QuantWeight) -> int:
    """Bytes of a tensor, or of every tensor a quantized weight holds (codes, scales, zeros)."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(part) for part in vars(value).values() if isinstance(part, Tensor))


def pick_device(device: str | None) -> torch.device:
    """The requested device, or CUDA when available and nothing was asked for."""
    if device is None:
        return _indexed(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        chosen = torch.device(device)
    except RuntimeError as exc:
        raise TinyInferError(f"unknown device {device}: use cpu or cuda") from exc
    if chosen.type not in ("cpu", "cuda"):
        raise TinyInferError(f"device {device} is not supported: use cpu or cuda")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise TinyInferError("CUDA is not available on this machine: use device cpu")
    return _indexed(chosen)


def _indexed(device: torch.device) -> torch.device:
    """"cuda" as the GPU it means now (cuda:0 ...), as torch places the tensors made there: a
    runner compares its device with its tensors', and torch.device("cuda") is not cuda:0."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pick_dtype(dtype: str | None, on_cuda: bool, int4: bool = False) -> torch.dtype:
    """The requested compute dtype. By default bf16 on CUDA, and float32 on the CPU except for
    int4 weights: torch's CPU int4 kernel is fast with bf16 activations only (about 35 times
    the speed it has with float32 ones, measured in docs/quantization.md)."""
    if dtype is None:
        return torch.bfloat16 if on_cuda or int4 else torch.float32
    if dtype not in DTYPES:
        raise TinyInferError(f"the torch runner computes in one of {tuple(DTYPES)}, not {dtype}")
    return DTYPES[dtype]


def random_weights(config: ModelConfig, device: str | None = None, dtype: str | None = None,
                   seed: int = 0, std: float = 0.02) -> dict[str, Tensor]:
    """Random weights with the reference's names, made directly on the device (for benchmarks).

    A real shape can be measured without its checkpoint: normal(0, std) matrices and biases,
    unit norm scales, created where they will be used rather than in host memory.
    """
    c = config
    dev = pick_device(device)
    kind = pick_dtype(dtype, dev.type == "cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)

    def normal(*shape: int) -> Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=kind) * std

    def ones(n: int) -> Tensor:
        return torch.ones(n, device=dev, dtype=kind)

    d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q_out, kv_out = c.num_heads * hd, c.num_kv_heads * hd
    w: dict[str, Tensor] = {"embed": normal(c.vocab_size, d), "final_norm.weight": ones(d)}
    if c.family == "gpt2":
        w["pos_embed"] = normal(c.max_position_embeddings, d)
        w["final_norm.bias"] = normal(d)
    if not c.tie_word_embeddings:
        w["lm_head"] = normal(c.vocab_size, d)
    shapes: dict[str, tuple[int, int]] = {"q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d),
                                          "o": (d, q_out)}
    shapes.update({"gate": (f, d), "up": (f, d), "down": (d, f)} if c.family == "llama"
                  else {"fc": (f, d), "proj": (d, f)})
    with_bias = {"q": c.qkv_bias, "k": c.qkv_bias, "v": c.qkv_bias, "o": c.o_bias,
                 "gate": c.mlp_bias, "up": c.mlp_bias, "down": c.mlp_bias, "fc": True, "proj": True}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        for norm_name in ("attn_norm", "mlp_norm"):
            w[f"{p}{norm_name}.weight"] = ones(d)
            if c.family == "gpt2":
                w[f"{p}{norm_name}.bias"] = normal(d)
        for name, shape in shapes.items():
            w[f"{p}{name}.weight"] = normal(*shape)
            if with_bias[name]:
                w[f"{p}{name}.bias"] = normal(shape[0])
    return w
