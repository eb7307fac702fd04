"""Memory arithmetic of a model: parameters by role, weight bytes per precision, KV bytes.

The simulator's estimates, from a config alone: every function returns a ``Quantity`` so the
number shows the formula that produced it. Weight bytes are an average per parameter, with
the scale and zero-point sizes of `tinyinfer.quant.formats`; the weight-memory table
(`tinyinfer.quant.weight_memory_table`) counts the same formats exactly, layer by layer, and
tests/test_simulate.py pins the two together.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyinfer.config import ModelConfig
from tinyinfer.quant.formats import SCALE_BYTES, ZERO_POINT_BYTES
from tinyinfer.simulate.presets import ModelSpec, SimulationError
from tinyinfer.simulate.quantity import Quantity, derive, given

WEIGHT_PRECISIONS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}  # bits
KV_PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}  # bytes per value


def bytes_per_weight(precision: str, group_size: int = 128, zero_points: bool = False) -> Quantity:
    """Bytes one weight occupies, including an int format's fp16 scale (and zero point) per group.

    int8 groups are whole rows (per output channel, ``group_size`` = the layer's inputs); int4
    groups are ``group_size`` inputs; asymmetric int4 adds a 4-bit zero point per group.
    """
    if precision not in WEIGHT_PRECISIONS:
        raise SimulationError(f"unknown weight precision {precision}: use one of "
                              f"{', '.join(WEIGHT_PRECISIONS)}")
    bits = given("bits", WEIGHT_PRECISIONS[precision], "bits", note=precision)
    if not precision.startswith("int"):
        return derive("bytes_per_weight", "B", "bits / 8", bits=bits)
    if group_size < 1:
        raise SimulationError(f"group size must be at least 1, got {group_size}")
    return derive("bytes_per_weight", "B", "bits / 8 + (scale_bytes + zero_bytes) / group_size",
                  note="codes + an fp16 scale per group", bits=bits,
                  scale_bytes=given("scale_bytes", SCALE_BYTES, "B"),
                  zero_bytes=given("zero_bytes", ZERO_POINT_BYTES if zero_points else 0, "B",
                                   note="4-bit zero point" if zero_points else "symmetric: none"),
                  group_size=given("group_size", group_size, "weights"))


@dataclass(frozen=True)
class ParameterCounts:
    """Where a model's parameters live; what a token touches differs from what memory holds."""

    embedding: int  # token (and learned position) embeddings: looked up, not multiplied
    head: int  # the LM head matrix every token multiplies (shared with the embedding if tied)
    head_stored: int  # head parameters stored separately (0 when tied)
    attention: int  # q, k, v, o matrices of all layers
    mlp_per_expert: int  # one expert's MLP matrices over all layers (the MLP, when dense)
    other: int  # norms, biases, MoE routers
    num_experts: int
    experts_per_token: int

    @property
    def total(self) -> int:
        return self.embedding + self.head_stored + self.attention + \
            self.mlp_per_expert * self.num_experts + self.other

    @property
    def active(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        return self.total - self.mlp_per_expert * (self.num_experts - self.experts_per_token)

    @property
    def quantizable(self) -> int:
        """The block linear layers: what int8/int4 formats quantize."""
        return self.attention + self.mlp_per_expert * self.num_experts

    @property
    def kept(self) -> int:
        """Parameters kept at 16-bit by quantized formats: embeddings, head, norms, biases."""
        return self.total - self.quantizable


def as_spec(model: ModelSpec | ModelConfig) -> ModelSpec:
    """A ModelSpec for a bare config (a dense model named after its type)."""
    return model if isinstance(model, ModelSpec) else ModelSpec(model.model_type, model.model_type, model)


def parameter_counts(model: ModelSpec | ModelConfig) -> ParameterCounts:
    """Split a model's parameters by role, from its config (and expert counts for MoE)."""
    model = as_spec(model)
    c = model.config
    d, layers = c.hidden_size, c.num_layers
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    attention = layers * (2 * d * q_out + 2 * d * kv_out)
    mlp = layers * (2 if c.family == "gpt2" else 3) * d * c.intermediate_size
    embedding = c.vocab_size * d + (c.max_position_embeddings * d if c.family == "gpt2" else 0)
    head_stored = 0 if c.tie_word_embeddings else c.vocab_size * d
    router = layers * d * model.num_experts if model.is_moe else 0
    other = c.num_parameters - embedding - head_stored - attention - mlp + router
    return ParameterCounts(embedding, c.vocab_size * d, head_stored, attention, mlp, other,
                           model.num_experts, model.experts_per_token)


def kept_bytes(precision: str) -> Quantity:
    """Bytes per parameter of what quantized formats keep at 16-bit (fp32 in fp32 checkpoints)."""
    return given("kept_bytes", 4 if precision == "fp32" else 2, "B",
                 note="embeddings, head, norms: fp32 in fp32 checkpoints, else 16-bit")


def weight_group_size(model: ModelSpec | ModelConfig, precision: str, group_size: int = 128) -> int:
    """Weights per scale: int8 is per output channel (a row of ~hidden inputs), int4 per group."""
    return as_spec(model).config.hidden_size if precision == "int8" else group_size


def weight_bytes(model: ModelSpec | ModelConfig, precision: str, group_size: int = 128,
                 zero_points: bool = False) -> Quantity:
    """Bytes the weights occupy in memory in a precision (all experts of an MoE)."""
    spec = as_spec(model)
    p = parameter_counts(spec)
    return derive(
        "weight_memory", "B", "quantized_params * bytes_per_weight + kept_params * kept_bytes",
        note=f"{spec.title} in {precision}",
        quantized_params=given("quantized_params", p.quantizable, "params",
                               note="linear layers of the blocks"),
        bytes_per_weight=bytes_per_weight(precision, weight_group_size(spec, precision, group_size),
                                          zero_points and precision == "int4"),
        kept_params=given("kept_params", p.kept, "params", note="embeddings, head, norms, biases"),
        kept_bytes=kept_bytes(precision))


def kv_bytes_per_token(config: ModelConfig, precision: str = "bf16") -> Quantity:
    """K and V of one token across all layers: 2 × layers × KV heads × head dim × bytes."""
    if precision not in KV_PRECISIONS:
        raise SimulationError(f"unknown KV precision {precision}: use one of {', '.join(KV_PRECISIONS)}")
    return derive("kv_bytes_per_token", "B", "2 * layers * kv_heads * head_dim * kv_bytes",
                  note="K and V, every layer",
                  layers=config.num_layers, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                  kv_bytes=given("kv_bytes", KV_PRECISIONS[precision], "B", note=precision))
