"""ModelConfig: the architecture of a model, read from a Hugging Face config.json.

Two families cover the supported checkpoints:

* ``gpt2``  — learned positions, LayerNorm, GELU (tanh) MLP, biases everywhere, tied head.
* ``llama`` — RoPE, RMSNorm, SwiGLU MLP, grouped-query attention; also Mistral, Qwen2
  (biases on q/k/v) and models that declare themselves Llama, such as SmolLM.

Anything else is refused by name, never run as the nearest family: an unknown ``model_type``
or ``architectures`` entry, and config keys that change the math tinyinfer does not do
(Granite's multipliers, soft-capping, partial RoPE, mixtures of experts, ...) unless they hold
the value that leaves the math unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyinfer.errors import ConfigError

LLAMA_LIKE = ("llama", "mistral", "qwen2")
ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel",), "llama": ("LlamaForCausalLM",),
                 "mistral": ("MistralForCausalLM",), "qwen2": ("Qwen2ForCausalLM",)}
# Config keys that change the forward pass, and the values under which they do not.
UNSUPPORTED_KEYS = {
    "embedding_multiplier": (1, 1.0, None),  # Granite
    "residual_multiplier": (1, 1.0, None),
    "logits_scaling": (1, 1.0, None),
    "attention_multiplier": (None,),
    "attn_logit_softcapping": (None,),  # Gemma 2
    "final_logit_softcapping": (None,),
    "partial_rotary_factor": (1, 1.0, None),
    "num_local_experts": (0, None),  # mixtures of experts
    "num_experts": (0, None),
    "use_qk_norm": (False, None),
    "qk_layernorm": (False, None),
    "no_rope_layers": (None,),  # SmolLM3: some layers without RoPE
    "rope_freqs": (None,),  # GGUF: per-frequency RoPE factors
}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long contexts ("linear" or Llama-3's "llama3")."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runners need to know about a model's shape; nothing about its weights."""

    family: str  # "gpt2" or "llama"
    model_type: str  # as written in config.json (gpt2, llama, mistral, qwen2)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the dtype the checkpoint was saved in

    @property
    def uses_rope(self) -> bool:
        return self.family == "llama"

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the model supports."""
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        """Parameter count, counting a tied embedding once."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q_out + 2 * d * kv_out + q_out * d
        attn += (q_out + 2 * kv_out) * self.qkv_bias + d * self.o_bias
        if self.family == "gpt2":
            mlp = 2 * d * f + (f + d) * self.mlp_bias
            norms = 2 * 2 * d
        else:
            mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
            norms = 2 * d
        per_layer = attn + mlp + norms
        total = self.num_layers * per_layer + v * d
        total += d * (2 if self.family == "gpt2" else 1)  # final norm
        if self.family == "gpt2":
            total += self.max_position_embeddings * d
        if not self.tie_word_embeddings:
            total += v * d
        return total

    def kv_bytes_per_token(self, bytes_per_value: int = 2, scale_bytes: int = 0) -> int:
        """Bytes of K and V cache one token occupies across all layers (``scale_bytes``: a
        quantized cache's scale per token, KV head and K or V)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * bytes_per_value + scale_bytes)

    def validate(self) -> None:
        """Raise ConfigError if the numbers cannot describe a working model."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.uses_rope and self.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")


def load_config(folder: str | Path, *, shape_only: bool = False) -> ModelConfig:
    """Read ``folder/config.json`` and return a validated ModelConfig (``shape_only``: see
    config_from_dict)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {folder}: point --model at a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config_from_dict(raw, source=str(path), shape_only=shape_only)


def config_from_dict(raw: dict[str, Any], source: str = "config", *, shape_only: bool = False) -> ModelConfig:
    """Build a ModelConfig from the fields of a Hugging Face config.json.

    ``shape_only`` reads the sizes of any GPT-2- or Llama-shaped model, runnable or not (the
    simulator prices mixtures of experts it never computes with); without it, what tinyinfer
    cannot run exactly is refused by name.
    """
    model_type = raw.get("model_type")
    if not shape_only:
        _refuse_what_cannot_run(raw, source)
    try:
        if model_type == "gpt2":
            config = _gpt2_config(raw)
        else:
            config = _llama_config(raw)
    except KeyError as exc:
        raise ConfigError(f"{source}: missing field {exc.args[0]}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: a field has the wrong type: {exc}") from exc
    config.validate()
    return config


def _refuse_what_cannot_run(raw: dict[str, Any], source: str) -> None:
    """An unknown architecture, or a key that changes the math, named in a ConfigError."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported "
                          f"(tinyinfer runs {', '.join(ARCHITECTURES)})")
    archs = raw.get("architectures") or []
    odd = [a for a in archs if a not in ARCHITECTURES[model_type]] if isinstance(archs, list) else [archs]
    if odd:
        raise ConfigError(f"{source}: architectures {odd} is not a {model_type} model tinyinfer "
                          f"runs (expected {', '.join(ARCHITECTURES[model_type])})")
    changed = [key for key, neutral in UNSUPPORTED_KEYS.items() if raw.get(key) not in neutral]
    if changed:
        raise ConfigError(f"{source}: {changed[0]} = {raw[changed[0]]!r} changes the model's math "
                          "in a way tinyinfer does not implement")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _dtype(raw: dict[str, Any]) -> str:
    return str(raw.get("dtype") or raw.get("torch_dtype") or "float32")


def _gpt2_config(raw: dict[str, Any]) -> ModelConfig:
    d = int(raw["n_embd"])
    heads = int(raw["n_head"])
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ConfigError(f"GPT-2 activation {act} is not supported (expected gelu_new)")
    return ModelConfig(
        family="gpt2",
        model_type="gpt2",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=d,
        num_layers=int(raw["n_layer"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=d // heads,
        intermediate_size=int(raw.get("n_inner") or 4 * d),
        max_position_embeddings=int(raw["n_positions"]),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        dtype=_dtype(raw),
    )


def _rope_fields(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read RoPE theta and scaling from either the transformers-5 or the older layout."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(merged["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    raise ConfigError(f"RoPE scaling type {kind} is not supported (default, linear, llama3 are)")


def _llama_config(raw: dict[str, Any]) -> ModelConfig:
    d = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"activation {act} is not supported for Llama-family models (silu is)")
    theta, scaling = _rope_fields(raw)
    model_type = str(raw.get("model_type") or "llama")
    attention_bias = bool(raw.get("attention_bias", False))
    max_positions = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window", model_type == "mistral") and window:
        # Without sliding-window attention, outputs are exact only within one window.
        max_positions = min(max_positions, int(window))
    head_dim = raw.get("head_dim") or d // heads
    return ModelConfig(
        family="llama",
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=d,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(raw["intermediate_size"]),
        max_position_embeddings=max_positions,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        dtype=_dtype(raw),
    )


def rope_inverse_frequencies(config: ModelConfig) -> "list[float]":
    """Per-pair rotation frequencies of RoPE, with the config's scaling applied."""
    half = config.head_dim // 2
    inv = [1.0 / config.rope_theta ** (2 * i / config.head_dim) for i in range(half)]
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return [f / scaling.factor for f in inv]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the middle band blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / scaling.factor)
        else:
            smooth = (old_len / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            out.append((1 - smooth) * f / scaling.factor + smooth * f)
    return out
