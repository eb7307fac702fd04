"""Presets for the simulator: published model configs and published hardware specs.

Models are written exactly as their Hugging Face ``config.json`` files (the fields that
matter) and go through ``config_from_dict`` like any checkpoint, so the simulator and the
engine read a model's shape the same way. Hardware numbers are vendor datasheet figures:
dense (no 2:4 sparsity) peak FLOP/s, memory bandwidth and capacity in decimal units. Prices
are typical on-demand cloud rates (or an amortised purchase) and are meant to be edited.
Links between devices are datasheet bandwidths with a typical latency, except where a preset's
``link_source`` names the measurement its link constants were fitted to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinyinfer.config import ModelConfig, config_from_dict, load_config
from tinyinfer.errors import TinyInferError


class SimulationError(TinyInferError):
    """A simulator input is unknown or out of range."""


@dataclass(frozen=True)
class ModelSpec:
    """A model for the simulator: its config plus what config.json says about experts (MoE)."""

    name: str
    title: str
    config: ModelConfig
    num_experts: int = 1  # MLP experts per layer (1 = dense)
    experts_per_token: int = 1  # experts each token is routed to
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1


def model_from_hf(name: str, raw: dict[str, Any], title: str = "", source: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict (Mixtral-style MoE fields understood)."""
    config = config_from_dict(raw, source=source or name, shape_only=True)
    experts = int(raw.get("num_local_experts") or 1)
    active = int(raw.get("num_experts_per_tok") or 1) if experts > 1 else 1
    return ModelSpec(name, title or name, config, experts, active, source)


def model_from_folder(folder: str | Path) -> ModelSpec:
    """A ModelSpec from a local model folder's config.json."""
    path = Path(folder).expanduser()
    load_config(path, shape_only=True)  # says clearly what is wrong with a missing or malformed config.json
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return model_from_hf(path.name, raw, source=str(path))


def _gpt2(n_embd: int, n_layer: int, n_head: int) -> dict[str, Any]:
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257,
            "n_positions": 1024, "n_ctx": 1024, "n_embd": n_embd, "n_layer": n_layer,
            "n_head": n_head, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "bos_token_id": 50256, "eos_token_id": 50256}


def _llama(model_type: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           vocab: int, max_positions: int, rope_theta: float, dtype: str,
           **extra: Any) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    return {"model_type": model_type, "architectures": [arch], "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": max_positions, "rope_theta": rope_theta,
            "rms_norm_eps": extra.pop("rms_norm_eps", 1e-5), "tie_word_embeddings": False,
            "torch_dtype": dtype, **extra}


# name -> (title, Hugging Face repository the config.json comes from, config.json fields)
MODEL_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT-2 124M", "openai-community/gpt2", _gpt2(768, 12, 12)),
    "gpt2-xl": ("GPT-2 1.5B", "openai-community/gpt2-xl", _gpt2(1600, 48, 25)),
    "llama-3.2-1b": ("Llama-3.2 1B", "meta-llama/Llama-3.2-1B",
                     _llama("llama", 2048, 8192, 16, 32, 8, 128256, 131072, 500000.0, "bfloat16",
                            head_dim=64, tie_word_embeddings=True,
                            rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                            bos_token_id=128000, eos_token_id=128001)),
    "qwen2.5-0.5b": ("Qwen2.5 0.5B", "Qwen/Qwen2.5-0.5B",
                     _llama("qwen2", 896, 4864, 24, 14, 2, 151936, 32768, 1e6, "bfloat16",
                            rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=32768,
                            use_sliding_window=False, bos_token_id=151643, eos_token_id=151643)),
    "llama-2-7b": ("Llama-2 7B", "meta-llama/Llama-2-7b-hf",
                   _llama("llama", 4096, 11008, 32, 32, 32, 32000, 4096, 10000.0, "float16",
                          bos_token_id=1, eos_token_id=2)),
    "llama-2-13b": ("Llama-2 13B", "meta-llama/Llama-2-13b-hf",
                    _llama("llama", 5120, 13824, 40, 40, 40, 32000, 4096, 10000.0, "float16",
                           bos_token_id=1, eos_token_id=2)),
    "llama-2-70b": ("Llama-2 70B", "meta-llama/Llama-2-70b-hf",
                    _llama("llama", 8192, 28672, 80, 64, 8, 32000, 4096, 10000.0, "float16",
                           bos_token_id=1, eos_token_id=2)),
    "llama-3-8b": ("Llama-3 8B", "meta-llama/Meta-Llama-3-8B",
                   _llama("llama", 4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, "bfloat16",
                          bos_token_id=128000, eos_token_id=128001)),
    "llama-3-70b": ("Llama-3 70B", "meta-llama/Meta-Llama-3-70B",
                    _llama("llama", 8192, 28672, 80, 64, 8, 128256, 8192, 500000.0, "bfloat16",
                           bos_token_id=128000, eos_token_id=128001)),
    "mistral-7b": ("Mistral 7B v0.3", "mistralai/Mistral-7B-v0.3",
                   _llama("mistral", 4096, 14336, 32, 32, 8, 32768, 32768, 1e6, "bfloat16",
                          sliding_window=None, bos_token_id=1, eos_token_id=2)),
    "mixtral-8x7b": ("Mixtral 8x7B", "mistralai/Mixtral-8x7B-v0.1",
                     _llama("mixtral", 4096, 14336, 32, 32, 8, 32000, 32768, 1e6, "bfloat16",
                            sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
                            bos_token_id=1, eos_token_id=2)),
    "qwen2.5-7b": ("Qwen2.5 7B", "Qwen/Qwen2.5-7B",
                   _llama("qwen2", 3584, 18944, 28, 28, 4, 152064, 131072, 1e6, "bfloat16",
                          rms_norm_eps=1e-6, sliding_window=131072, use_sliding_window=False,
                          bos_token_id=151643, eos_token_id=151643)),
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU) as the roofline sees it: peak rates, memory, price."""

    name: str
    title: str
    peak_flops: dict[str, float] = field(compare=False)  # dense FLOP/s by compute precision
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    price_per_hour: float  # $ per device-hour
    link_bandwidth: float = 0.0  # bytes/s an all-reduce moves per device, one way (0: cannot shard)
    link_latency: float = 0.0  # seconds per all-reduce, independent of size and device count
    link_hop_latency: float = 0.0  # seconds each of a ring all-reduce's 2 (devices - 1) steps adds
    max_devices: int = 1
    source: str = ""
    link_source: str = "datasheet bandwidth, typical latency: not measured"

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a compute precision (fp8 falls back to 16-bit where unsupported)."""
        if precision == "fp8" and "fp8" not in self.peak_flops:
            return self.peak_flops["bf16"]
        return self.peak_flops[precision]


H200_LINK_MEASUREMENTS = "docs/tp_gpu_check_2026-11-26-h200x4.json"

HARDWARE: dict[str, Hardware] = {
    hw.name: hw for hw in (
        Hardware("h100-sxm", "NVIDIA H100 SXM 80GB",
                 {"fp32": 67e12, "bf16": 989e12, "fp8": 1979e12}, 3.35e12, 80e9, 3.00,
                 link_bandwidth=450e9, link_latency=8e-6, max_devices=8,
                 source="NVIDIA H100 datasheet (SXM); NVLink 4 900 GB/s both ways"),
        # Link: fit_link on the 2 KiB and 64 MiB all-reduces of the sweep; hop = (16.54 − 11.22 µs)
        # ÷ (2·3 − 2·1), latency = 11.22 µs − 2·1 × hop, bandwidth = (263.4 + 305.1 GB/s) ÷ 2.
        Hardware("h200", "NVIDIA H200 SXM 141GB",
                 {"fp32": 67e12, "bf16": 989e12, "fp8": 1979e12}, 4.8e12, 141e9, 3.80,
                 link_bandwidth=284e9, link_latency=8.56e-6, link_hop_latency=1.33e-6, max_devices=8,
                 source="NVIDIA H200 datasheet (SXM)",
                 link_source=f"fitted to {H200_LINK_MEASUREMENTS} (NCCL in CUDA graphs, TP=2 and 4)"),
        Hardware("a100-80gb", "NVIDIA A100 SXM 80GB",
                 {"fp32": 19.5e12, "bf16": 312e12}, 2.039e12, 80e9, 1.80,
                 link_bandwidth=300e9, link_latency=10e-6, max_devices=8,
                 source="NVIDIA A100 datasheet (SXM, 80GB); no fp8"),
        Hardware("l4", "NVIDIA L4 24GB",
                 {"fp32": 30.3e12, "bf16": 121e12, "fp8": 242e12}, 300e9, 24e9, 0.80,
                 link_bandwidth=32e9, link_latency=20e-6, max_devices=8,
                 source="NVIDIA L4 datasheet; PCIe Gen4 x16 between cards"),
        Hardware("rtx-4090", "NVIDIA GeForce RTX 4090 24GB",
                 {"fp32": 82.6e12, "bf16": 165.2e12, "fp8": 330.3e12}, 1.008e12, 24e9, 0.50,
                 link_bandwidth=32e9, link_latency=20e-6, max_devices=8,
                 source="NVIDIA Ada whitepaper (16-bit tensor rate with fp32 accumulate); PCIe Gen4"),
        Hardware("m2-max", "Apple M2 Max (38-core GPU, 64GB)",
                 {"fp32": 13.6e12, "bf16": 13.6e12}, 400e9, 64e9, 0.15,
                 source="Apple M2 Max specs; price = a $4,000 laptop over 3 years"),
        Hardware("laptop-cpu", "Laptop CPU (8 cores AVX2, dual-channel DDR5-5600, 32GB)",
                 {"fp32": 0.9e12, "bf16": 0.9e12}, 89.6e9, 32e9, 0.05,
                 source="8 cores x 3.5 GHz x 32 FLOP/cycle (2 AVX2 FMA units); 2 x 5600 MT/s x 8 B"),
    )
}

HARDWARE_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "4090": "rtx-4090", "cpu": "laptop-cpu",
                    "m2": "m2-max"}
MODEL_ALIASES = {"gpt2-124m": "gpt2", "gpt2-1.5b": "gpt2-xl", "mistral-7b-v0.3": "mistral-7b",
                 "mixtral": "mixtral-8x7b", "qwen2.5": "qwen2.5-7b"}


def model_preset(name: str) -> ModelSpec:
    """A model preset by name (see MODEL_CONFIGS), or a local folder holding a config.json."""
    key = MODEL_ALIASES.get(name.lower(), name.lower())
    if key in MODEL_CONFIGS:
        title, repo, raw = MODEL_CONFIGS[key]
        return model_from_hf(key, raw, title, repo)
    if Path(name).expanduser().is_dir():
        return model_from_folder(name)
    raise SimulationError(f"unknown model {name}: use one of {', '.join(MODEL_CONFIGS)} "
                          "or a folder with a Hugging Face config.json")


def hardware_preset(name: str) -> Hardware:
    """A hardware preset by name or alias (h100, a100, 4090, cpu, ...)."""
    key = HARDWARE_ALIASES.get(name.lower(), name.lower())
    if key not in HARDWARE:
        raise SimulationError(f"unknown hardware {name}: use one of {', '.join(HARDWARE)} "
                              f"(aliases: {', '.join(HARDWARE_ALIASES)})")
    return HARDWARE[key]
