"""Hugging Face tensor names → tinyinfer's names, one map per architecture family.

Both runners read one internal naming. Every linear weight is stored ``[out_features,
in_features]`` so that ``y = x @ W.T``; every shape is checked against the config, and a
tensor the config does not explain is an error (the checkpoint does not match its config).
"""

from __future__ import annotations

from pathlib import Path

from tinyinfer.config import ModelConfig
from tinyinfer.errors import CheckpointError
from tinyinfer.weights.safetensors_file import WeightArray, read_checkpoint


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
