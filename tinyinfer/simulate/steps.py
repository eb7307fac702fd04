"""Step times of the simulator: how long one forward pass takes on the roofline.

A pass has two parts, each its own kernel(s) with its own roofline: the linear layers
(FLOPs against weight bytes) and attention (FLOPs against KV-cache bytes). Each takes the
slower of compute and memory; the parts add up, plus tensor-parallel all-reduces and the
engine's host overheads. An all-reduce costs what the link takes ("the wire": hardware
constants) plus what the engine adds around it ("this engine": fitted by calibration, 0 for an
ideal engine). Every time is a ``Quantity`` that shows its formula.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyinfer.config import ModelConfig
from tinyinfer.simulate.memory import ParameterCounts
from tinyinfer.simulate.presets import Hardware
from tinyinfer.simulate.quantity import Quantity, derive, given


@dataclass(frozen=True)
class Efficiency:
    """How close real kernels get to the datasheet; fitted by calibration, else typical values."""

    compute: float = 0.6  # share of peak FLOP/s that large matmuls reach (MFU)
    attention: float = 0.6  # share of peak FLOP/s that prefill attention reaches (fused kernels)
    bandwidth: float = 0.8  # share of peak bandwidth that streaming weight reads reach
    step_overhead: float = 0.0  # seconds per step outside the roofline (launches, Python)
    prefill_seq_overhead: float = 0.0  # seconds per prompt in a prefill step (per-sequence work)
    sample_cost: float = 0.0  # seconds per vocabulary entry of each sampled row (host sampling)
    all_reduce_wait: float = 0.0  # seconds each all-reduce adds beyond the wire, per all-reduce of the step
    collective_overhead: float = 0.0  # seconds per all-reduce of a sharded step outside the all-reduces


@dataclass(frozen=True)
class Rates:
    """Effective machine rates and the per-step constants every step-time formula reads."""

    flops: Quantity
    attention_flops: Quantity
    bandwidth: Quantity
    efficiency: Efficiency
    gpus: Quantity
    link_bandwidth: Quantity
    all_reduce_latency: Quantity
    act_bytes: Quantity


def rates(hw: Hardware, e: Efficiency, num_gpus: int, compute_precision: str) -> Rates:
    """Effective FLOP/s and bytes/s of `num_gpus` devices, with the constants of each step."""
    gpus = given("gpus", num_gpus, "devices")
    peak = given("peak_flops", hw.peak(compute_precision), "FLOP/s", note=f"{hw.title}, {compute_precision}")
    flops = derive("effective_flops", "FLOP/s", "peak_flops * gpus * compute_efficiency", peak_flops=peak,
                   gpus=gpus, compute_efficiency=given("compute_efficiency", e.compute, "%"))
    attention = derive("attention_flops_rate", "FLOP/s", "peak_flops * gpus * attention_efficiency",
                       peak_flops=peak, gpus=gpus,
                       attention_efficiency=given("attention_efficiency", e.attention, "%"))
    bandwidth = derive("effective_bandwidth", "B/s", "bandwidth * gpus * bandwidth_efficiency",
                       bandwidth=given("bandwidth", hw.memory_bandwidth, "B/s", note=hw.title),
                       gpus=gpus, bandwidth_efficiency=given("bandwidth_efficiency", e.bandwidth, "%"))
    latency = derive("all_reduce_latency", "s", "link_latency + 2 * (gpus - 1) * link_hop_latency",
                     note="a ring all-reduce: a fixed cost, then 2 (gpus - 1) steps of one hop each",
                     link_latency=given("link_latency", hw.link_latency, "s", note=hw.link_source),
                     gpus=gpus, link_hop_latency=given("link_hop_latency", hw.link_hop_latency, "s",
                                                       note=hw.link_source))
    return Rates(flops, attention, bandwidth, e, gpus,
                 given("link_bandwidth", hw.link_bandwidth, "B/s",
                       note=f"all-reduce bus bandwidth per device, one way; {hw.link_source}"),
                 latency, given("activation_bytes", 4 if compute_precision == "fp32" else 2, "B"))


@dataclass(frozen=True)
class Work:
    """What one forward pass does, in the two parts that have their own roofline."""

    kind: str  # "prefill" or "decode" (verification passes decode too)
    sequences: Quantity  # sequences in the pass; each samples one row of logits
    tokens: Quantity  # tokens computed in the pass (rows of every matmul)
    matmul_flops: Quantity  # linear layers: weights × tokens
    weights_read: Quantity
    attention_flops: Quantity  # scores and weighted sums against the KV cache
    kv_bytes: Quantity


def pass_time(label: str, w: Work, config: ModelConfig, r: Rates) -> tuple[Quantity, str]:
    """Time of one forward pass: linear layers and attention each take the slower of compute and
    memory (they are separate kernels), plus communication and fixed overhead."""
    parts = {}
    for part, flops, rate, nbytes in (("linear", w.matmul_flops, r.flops, w.weights_read),
                                      ("attention", w.attention_flops, r.attention_flops, w.kv_bytes)):
        compute = derive(f"{label}_{part}_compute_time", "s", "flops / effective_flops",
                         flops=flops, effective_flops=rate)
        memory = derive(f"{label}_{part}_memory_time", "s", "bytes / effective_bandwidth",
                        bytes=nbytes, effective_bandwidth=r.bandwidth)
        parts[part] = derive(f"{label}_{part}_time", "s", "max(compute_time, memory_time)",
                             compute_time=compute, memory_time=memory)
    all_reduces = all_reduce_count(config) if r.gpus.value > 1 else None
    time = derive(f"{label}_time", "s", "linear_time + attention_time + comm_time + host_time",
                  linear_time=parts["linear"], attention_time=parts["attention"],
                  comm_time=_comm_time(label, w, config, r, all_reduces),
                  host_time=_host_time(label, w, config, r.efficiency, all_reduces))
    linear = parts["linear"].inputs
    memory, compute = linear["memory_time"].value, linear["compute_time"].value  # type: ignore[union-attr]
    return time, "memory" if memory >= compute else "compute"


def all_reduce_count(config: ModelConfig) -> Quantity:
    """All-reduces in one tensor-parallel forward pass."""
    return derive("all_reduces", "all-reduces", "2 * layers + 1",
                  note="the embedding's, then each layer's attention output and MLP output",
                  layers=config.num_layers)


def _comm_time(label: str, w: Work, config: ModelConfig, r: Rates,
               all_reduces: Quantity | None) -> Quantity:
    """Time in all-reduces of [tokens, hidden] activations: the wire, plus this engine's wait."""
    if all_reduces is None:
        return given(f"{label}_comm_time", 0, "s", note="one device: no communication")
    message = derive("all_reduce_bytes", "B", "tokens * hidden * activation_bytes", note="[tokens, hidden]",
                     tokens=w.tokens, hidden=config.hidden_size, activation_bytes=r.act_bytes)
    wait = derive(f"{label}_engine_wait", "s", "all_reduce_wait * all_reduces",
                  note="this engine: what one all-reduce adds beyond the wire; 0 for an ideal engine",
                  all_reduce_wait=given("all_reduce_wait", r.efficiency.all_reduce_wait, "s",
                                        note="for each all-reduce of the step; fitted by calibration"),
                  all_reduces=all_reduces)
    return derive(f"{label}_comm_time", "s", "all_reduces * (wire_time + engine_wait)",
                  note="not overlapped with compute", all_reduces=all_reduces,
                  wire_time=wire_time(label, r, message), engine_wait=wait)


def wire_time(label: str, r: Rates, message: Quantity) -> Quantity:
    """One ring all-reduce of `message` bytes on the link: the wire, whatever the engine around it."""
    return derive(f"{label}_wire_time", "s",
                  "all_reduce_latency + 2 * (gpus - 1) / gpus * message / link_bandwidth",
                  note="the wire: each device sends and receives 2 (gpus - 1) / gpus of the message",
                  all_reduce_latency=r.all_reduce_latency, gpus=r.gpus, message=message,
                  link_bandwidth=r.link_bandwidth)


def _host_time(label: str, w: Work, config: ModelConfig, e: Efficiency,
               all_reduces: Quantity | None) -> Quantity:
    """Time outside the GPU math: a fixed cost per step, per prompt of a prefill, sampling every
    sequence's next token on the host (a pass over its vocabulary) and, sharded, a cost per
    all-reduce outside the all-reduces themselves."""
    seq_overhead = e.prefill_seq_overhead if w.kind == "prefill" else 0.0
    per_collective = e.collective_overhead if all_reduces is not None else 0.0
    if not (e.step_overhead or seq_overhead or e.sample_cost or per_collective):
        return given(f"{label}_host_time", 0, "s", note="an ideal engine: no host overhead")
    formula = "step_overhead + sequences * seq_overhead + sequences * vocab * sample_cost"
    inputs: dict[str, Quantity | int] = dict(
        step_overhead=given("step_overhead", e.step_overhead, "s"), sequences=w.sequences,
        seq_overhead=given("prefill_seq_overhead", seq_overhead, "s"), vocab=config.vocab_size,
        sample_cost=given("sample_cost", e.sample_cost, "s", note="per vocabulary entry"))
    if all_reduces is not None:
        formula += " + all_reduces * collective_overhead"
        inputs.update(all_reduces=all_reduces, collective_overhead=given(
            "collective_overhead", e.collective_overhead, "s", note="per all-reduce, outside it"))
    return derive(f"{label}_host_time", "s", formula, note="fitted by calibration", **inputs)


def weights_read(p: ParameterCounts, tokens: Quantity, wbytes: Quantity, kept: Quantity) -> Quantity:
    """Weight bytes one forward pass over `tokens` tokens reads (MoE: only the experts touched)."""
    common = dict(attention_params=given("attention_params", p.attention, "params"),
                  head_and_norm_params=given("head_and_norm_params", p.head + p.other, "params"),
                  bytes_per_weight=wbytes, kept_bytes=kept)
    if p.num_experts == 1:
        return derive("weights_read", "B",
                      "(attention_params + mlp_params) * bytes_per_weight + "
                      "head_and_norm_params * kept_bytes",
                      mlp_params=given("mlp_params", p.mlp_per_expert, "params"), **common)
    touched = derive("experts_touched", "experts", "experts * (1 - (1 - active / experts) ** tokens)",
                     note="uniform routing", experts=p.num_experts, active=p.experts_per_token,
                     tokens=tokens)
    return derive("weights_read", "B",
                  "(attention_params + expert_params * experts_touched) * bytes_per_weight + "
                  "head_and_norm_params * kept_bytes",
                  expert_params=given("expert_params", p.mlp_per_expert, "params", note="one expert"),
                  experts_touched=touched, **common)


def matmul_params(p: ParameterCounts) -> Quantity:
    """Weights one token multiplies: attention, the experts it is routed to, the LM head."""
    return given("matmul_params", p.attention + p.mlp_per_expert * p.experts_per_token + p.head,
                 "params", note="weights one token multiplies: attention, its experts, LM head")


def _attention_dims(c: ModelConfig) -> dict[str, int]:
    return dict(layers=c.num_layers, heads=c.num_heads, head_dim=c.head_dim)


def prefill_work(p: ParameterCounts, c: ModelConfig, matmul: Quantity, sequences: Quantity,
                 prompt: Quantity, kv_token: Quantity, sizes: tuple[Quantity, Quantity]) -> Work:
    """Prefill of `sequences` prompts at once: every prompt token through every matmul,
    causal attention over each prompt, and each token's K/V written once."""
    tokens = derive("prefill_tokens", "tokens", "sequences * prompt", sequences=sequences, prompt=prompt)
    return Work(
        kind="prefill",
        sequences=sequences,
        tokens=tokens,
        matmul_flops=derive("matmul_flops", "FLOP", "2 * matmul_params * tokens", matmul_params=matmul,
                            tokens=tokens),
        weights_read=weights_read(p, tokens, *sizes),
        attention_flops=derive("attention_flops", "FLOP",
                               "2 * layers * heads * head_dim * prompt ** 2 * sequences",
                               note="QK and AV over the causal half of the square", prompt=prompt,
                               sequences=sequences, **_attention_dims(c)),
        kv_bytes=derive("kv_bytes", "B", "tokens * kv_bytes_per_token", note="K/V written",
                        tokens=tokens, kv_bytes_per_token=kv_token))


def decode_work(p: ParameterCounts, c: ModelConfig, matmul: Quantity, tokens: Quantity,
                batch: Quantity, context: Quantity, kv_token: Quantity,
                sizes: tuple[Quantity, Quantity]) -> Work:
    """A decode (or verify) pass: `tokens` new tokens of `batch` sequences, each sequence's
    whole KV cache read once."""
    return Work(
        kind="decode",
        sequences=batch,
        tokens=tokens,
        matmul_flops=derive("matmul_flops", "FLOP", "2 * matmul_params * tokens", matmul_params=matmul,
                            tokens=tokens),
        weights_read=weights_read(p, tokens, *sizes),
        attention_flops=derive("attention_flops", "FLOP", "4 * layers * heads * head_dim * context * tokens",
                               note="QK and AV against the context", context=context, tokens=tokens,
                               **_attention_dims(c)),
        kv_bytes=derive("kv_bytes", "B", "batch * kv_bytes_per_token * context", note="K/V read",
                        batch=batch, kv_bytes_per_token=kv_token, context=context))


def knee_batch(p: ParameterCounts, matmul: Quantity, sizes: tuple[Quantity, Quantity], r: Rates) -> Quantity:
    """Batch where the linear layers turn compute-bound: weight read time = batch × matmul time per token.

    Attention is not in it: every sequence reads its own KV cache, so attention stays
    memory-bound at any batch.
    """
    every = given("tokens", 1e9, "tokens", note="a batch big enough to touch every expert")
    return derive("knee_batch", "sequences",
                  "weights_read / effective_bandwidth / (2 * matmul_params / effective_flops)",
                  note="below it the linear layers are memory-bound: extra sequences ride along",
                  weights_read=weights_read(p, every, *sizes), effective_bandwidth=r.bandwidth,
                  matmul_params=matmul, effective_flops=r.flops)
