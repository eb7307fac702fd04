"""The inference simulator: a roofline cost model of a real model on real hardware.

It predicts, it does not run. Every step of inference is either limited by arithmetic
(FLOPs ÷ FLOP/s) or by memory traffic (bytes ÷ bytes/s), whichever is slower:

* prefill computes all prompt tokens at once: many FLOPs per weight byte → compute-bound;
* decode computes one token per sequence per step but still reads every weight (and the
  KV cache) → memory-bound, until the batch is big enough to reach the compute "knee".

Each output is a ``Quantity`` carrying the formula that produced it; ``explain()`` expands
it down to the published specs and config fields. The assumptions are stated on the
numbers themselves and collected in ``ASSUMPTIONS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from tinyinfer.simulate.memory import (
    KV_PRECISIONS,
    WEIGHT_PRECISIONS,
    ParameterCounts,
    bytes_per_weight,
    kept_bytes,
    kv_bytes_per_token,
    parameter_counts,
    weight_bytes,
    weight_group_size,
)
from tinyinfer.simulate.presets import (
    HARDWARE,
    MODEL_CONFIGS,
    Hardware,
    ModelSpec,
    SimulationError,
    hardware_preset,
    model_preset,
)
from tinyinfer.simulate.quantity import Quantity, derive, given
from tinyinfer.simulate.steps import (
    Efficiency,
    Rates,
    decode_work,
    knee_batch,
    matmul_params,
    pass_time,
    prefill_work,
    rates,
)

__all__ = [
    "ASSUMPTIONS", "Efficiency", "HARDWARE", "Hardware", "KV_PRECISIONS", "MODEL_CONFIGS",
    "ModelSpec", "ParameterCounts", "Quantity", "Scenario", "Simulation", "SimulationError",
    "WEIGHT_PRECISIONS", "bytes_per_weight", "hardware_preset", "kv_bytes_per_token",
    "model_preset", "parameter_counts", "simulate", "sweep", "weight_bytes",
]

ASSUMPTIONS = (
    "GB means 10^9 bytes; hardware peaks are dense datasheet numbers.",
    "int8/int4 quantize the linear layers of every block with an fp16 scale per output row "
    "(int8) or per group of 128 inputs (int4, symmetric); "
    "embeddings, LM head and norms stay 16-bit, as GPTQ/AWQ checkpoints ship.",
    "int8/int4 weights are dequantized to bf16 for the math (weight-only quantization); fp8 "
    "weights compute at the fp8 rate where the hardware has one.",
    "Within a kernel compute and memory traffic overlap perfectly: linear layers take "
    "max(FLOPs ÷ FLOP/s, weight bytes ÷ bytes/s), attention max(FLOPs ÷ FLOP/s, KV bytes ÷ "
    "bytes/s); the two add up, as separate kernels do.",
    "Decode reads every weight once per step and each sequence's whole KV cache; its context "
    "is the average over the answer, prompt + output / 2.",
    "MoE routing is uniform and independent: a batch of B tokens touches "
    "E × (1 − (1 − k/E)^B) experts per layer.",
    "Tensor parallelism splits weights, KV and FLOPs evenly and adds 2 × layers + 1 ring "
    "all-reduces of the activations per pass (the embedding's, two a layer), not overlapped with "
    "compute; an all-reduce costs the wire (link latency and bandwidth) plus what the engine adds, "
    "0 unless calibrated.",
    "A batch arrives together: its prompts are prefilled, then it decodes in lockstep (no queueing).",
    "Memory for KV is memory × memory_utilization − weights (the rest: activations, workspace).",
)


@dataclass(frozen=True)
class Scenario:
    """Every knob of one simulation: model, hardware, precisions, workload, money."""

    model: ModelSpec
    hardware: Hardware
    weight_precision: str = "bf16"
    kv_precision: str = "bf16"
    batch: int = 1  # sequences decoding together (concurrent users)
    prompt_tokens: int = 1024
    output_tokens: int = 256
    num_gpus: int = 1  # tensor-parallel devices
    spec_k: int = 0  # speculative draft tokens per step (0: off)
    spec_acceptance: float = 0.7  # chance the target accepts each drafted token
    draft_model: ModelSpec | None = None  # None: drafts are free (prompt lookup)
    efficiency: Efficiency = Efficiency()
    price_per_hour: float | None = None  # $ per device-hour; None: the hardware preset's
    utilization: float = 1.0  # share of paid hours spent serving
    api_price_per_million: float | None = None  # an API's $ per million tokens, to compare with
    memory_utilization: float = 0.9
    group_size: int = 128

    @classmethod
    def of(cls, model: str | ModelSpec, hardware: str | Hardware, **knobs: object) -> "Scenario":
        """A scenario from preset names (or specs) and keyword knobs."""
        spec = model_preset(model) if isinstance(model, str) else model
        device = hardware_preset(hardware) if isinstance(hardware, str) else hardware
        draft = knobs.pop("draft_model", None)
        if isinstance(draft, str):
            draft = model_preset(draft)
        return cls(spec, device, draft_model=draft, **knobs)  # type: ignore[arg-type]

    @property
    def price(self) -> float:
        return self.hardware.price_per_hour if self.price_per_hour is None else self.price_per_hour

    def validate(self) -> None:
        """Raise SimulationError, saying what to change, for knobs that describe nothing real."""
        c = self.model.config
        for name in ("batch", "prompt_tokens", "output_tokens", "num_gpus", "group_size"):
            if getattr(self, name) < 1:
                raise SimulationError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.spec_k < 0 or not 0 <= self.spec_acceptance <= 1:
            raise SimulationError("speculative k must be >= 0 and the acceptance rate within [0, 1]")
        if not 0 < self.utilization <= 1 or not 0 < self.memory_utilization <= 1:
            raise SimulationError("utilization and memory utilization must be within (0, 1]")
        e = self.efficiency
        overheads = (e.step_overhead, e.prefill_seq_overhead, e.sample_cost, e.all_reduce_wait,
                     e.collective_overhead)
        if not (0 < min(e.compute, e.attention, e.bandwidth) and max(e.compute, e.attention, e.bandwidth) <= 1.5
                and min(overheads) >= 0):
            raise SimulationError("efficiencies must be positive (about 0.3-1.0) and overheads >= 0")
        if self.num_gpus > self.hardware.max_devices:
            raise SimulationError(f"{self.hardware.title} shards over at most "
                                  f"{self.hardware.max_devices} device(s); lower the GPU count")
        if c.num_heads % self.num_gpus or c.num_kv_heads % self.num_gpus:
            raise SimulationError(
                f"tensor parallelism splits attention heads: {self.num_gpus} GPUs must divide "
                f"{c.num_heads} query heads and {c.num_kv_heads} KV heads")
        for precision, table in ((self.weight_precision, WEIGHT_PRECISIONS),
                                 (self.kv_precision, KV_PRECISIONS)):
            if precision not in table:
                raise SimulationError(f"unknown precision {precision}: use one of {', '.join(table)}")


@dataclass(frozen=True)
class Simulation:
    """Everything predicted for one scenario; each number expands into its derivation."""

    scenario: Scenario
    total_parameters: Quantity
    active_parameters: Quantity
    weight_memory: Quantity
    kv_bytes_per_token: Quantity
    kv_per_sequence: Quantity
    kv_for_batch: Quantity
    kv_room: Quantity
    max_concurrent: Quantity
    ttft: Quantity
    tpot: Quantity
    user_tokens_per_second: Quantity
    decode_throughput: Quantity
    knee_batch: Quantity
    e2e_latency: Quantity
    throughput: Quantity
    cost_per_million: Quantity
    decode_bound: str  # "memory" or "compute"
    prefill_bound: str
    notes: tuple[str, ...]
    breakeven_utilization: Quantity | None = None
    spec_tokens_per_step: Quantity | None = None
    spec_tpot: Quantity | None = None
    spec_speedup: Quantity | None = None

    def rows(self) -> list[tuple[str, Quantity]]:
        """(label, quantity) pairs in reading order, for tables and UIs."""
        labels = [
            ("parameters (total)", self.total_parameters),
            ("parameters (active per token)", self.active_parameters),
            ("weight memory", self.weight_memory),
            ("KV cache per token", self.kv_bytes_per_token),
            ("KV cache per sequence", self.kv_per_sequence),
            ("KV cache for the batch", self.kv_for_batch),
            ("memory left for KV", self.kv_room),
            ("max concurrent sequences", self.max_concurrent),
            (f"TTFT (prefill, {self.prefill_bound}-bound)", self.ttft),
            (f"TPOT (decode step, {self.decode_bound}-bound)", self.tpot),
            ("tokens/s per user", self.user_tokens_per_second),
            ("decode tokens/s (all users)", self.decode_throughput),
            ("batch at the compute knee", self.knee_batch),
            ("end-to-end latency", self.e2e_latency),
            ("throughput incl. prefill", self.throughput),
            ("$ per million tokens (prompt + output)", self.cost_per_million),
            ("break-even utilization vs API", self.breakeven_utilization),
            ("speculative tokens per step", self.spec_tokens_per_step),
            ("speculative TPOT", self.spec_tpot),
            ("speculative speedup", self.spec_speedup),
        ]
        return [(label, q) for label, q in labels if q is not None]

    def quantity(self, name: str) -> Quantity:
        """Look a row up by its quantity name (e.g. 'tpot') to expand it."""
        for _, q in self.rows():
            if q.name == name:
                return q
        names = ", ".join(q.name for _, q in self.rows())
        raise SimulationError(f"no quantity named {name}; choose one of {names}")


def simulate(s: Scenario) -> Simulation:
    """Predict memory, latency, throughput and cost for one scenario."""
    s.validate()
    c, p, notes = s.model.config, parameter_counts(s.model), []
    compute_precision = {"fp32": "fp32", "fp8": "fp8"}.get(s.weight_precision, "bf16")
    if compute_precision == "fp8" and "fp8" not in s.hardware.peak_flops:
        notes.append(f"{s.hardware.title} has no fp8 units: fp8 weights compute at the 16-bit rate.")
    r = rates(s.hardware, s.efficiency, s.num_gpus, compute_precision)
    wbytes, kept = _weight_byte_sizes(s)
    batch = given("batch", s.batch, "sequences")
    prompt, output = given("prompt", s.prompt_tokens, "tokens"), given("output", s.output_tokens, "tokens")

    weights = weight_bytes(s.model, s.weight_precision, s.group_size)
    kv_token = kv_bytes_per_token(c, s.kv_precision)
    kv_seq = derive("kv_per_sequence", "B", "kv_bytes_per_token * (prompt + output)",
                    kv_bytes_per_token=kv_token, prompt=prompt, output=output)
    kv_batch = derive("kv_for_batch", "B", "kv_per_sequence * batch", kv_per_sequence=kv_seq, batch=batch)
    kv_room = derive("kv_room", "B", "memory * gpus * memory_utilization - weight_memory",
                     memory=given("memory", s.hardware.memory_bytes, "B", note=s.hardware.title),
                     gpus=r.gpus, memory_utilization=given("memory_utilization", s.memory_utilization, "%"),
                     weight_memory=weights)
    max_concurrent = derive("max_concurrent", "sequences", "max(0, floor(kv_room / kv_per_sequence))",
                            kv_room=kv_room, kv_per_sequence=kv_seq)

    matmul = matmul_params(p)
    sizes = (wbytes, kept)
    ttft, prefill_bound = pass_time("prefill", prefill_work(p, c, matmul, given("sequences", 1, "sequences"),
                                                           prompt, kv_token, sizes), c, r)
    ttft = dataclasses.replace(ttft, name="ttft", note="one prompt, no queueing")
    context = derive("decode_context", "tokens", "prompt + output / 2", note="average over the answer",
                     prompt=prompt, output=output)
    decode = decode_work(p, c, matmul, batch, batch, context, kv_token, sizes)
    tpot, decode_bound = pass_time("decode", decode, c, r)
    tpot = dataclasses.replace(tpot, name="tpot", note="one decode step = one token per sequence")

    batch_prefill, _ = pass_time("batch_prefill", prefill_work(p, c, matmul, batch, prompt, kv_token, sizes),
                                  c, r)
    e2e = derive("e2e_latency", "s", "batch_prefill_time + (output - 1) * tpot",
                 note="prefill every prompt, then decode in lockstep", batch_prefill_time=batch_prefill,
                 output=output, tpot=tpot)
    throughput = derive("throughput", "tokens/s", "batch * output / e2e_latency",
                        batch=batch, output=output, e2e_latency=e2e)
    cost = derive("cost_per_million", "$",
                  "price_per_hour * gpus / 3600 * e2e_latency / "
                  "(batch * (prompt + output) * utilization) * 1e6",
                  note="per million tokens processed, prompt and output alike, as APIs price open models",
                  price_per_hour=given("price_per_hour", s.price, "$/h", note="editable"), gpus=r.gpus,
                  e2e_latency=e2e, batch=batch, prompt=prompt, output=output,
                  utilization=given("utilization", s.utilization, "%"))
    breakeven = None if s.api_price_per_million is None else derive(
        "breakeven_utilization", "%", "cost_at_full_use / api_price",
        note="self-hosting is cheaper above this share of busy hours",
        cost_at_full_use=derive("cost_at_full_use", "$", "cost_per_million * utilization",
                                cost_per_million=cost, utilization=given("utilization", s.utilization, "%")),
        api_price=given("api_price", s.api_price_per_million, "$", note="per million tokens"))

    spec = _speculative(s, tpot, batch, context, kv_token, r)
    _add_notes(s, weights, kv_room, max_concurrent, notes)
    return Simulation(
        scenario=s,
        total_parameters=given("total_parameters", p.total, "params", note=s.model.source),
        active_parameters=derive("active_parameters", "params",
                                 "total - expert_params * (experts - active_experts)",
                                 total=p.total, expert_params=p.mlp_per_expert, experts=p.num_experts,
                                 active_experts=p.experts_per_token),
        weight_memory=weights, kv_bytes_per_token=kv_token, kv_per_sequence=kv_seq, kv_for_batch=kv_batch,
        kv_room=kv_room, max_concurrent=max_concurrent, ttft=ttft, tpot=tpot,
        user_tokens_per_second=derive("user_tokens_per_second", "tokens/s", "1 / tpot", tpot=tpot),
        decode_throughput=derive("decode_throughput", "tokens/s", "batch / tpot", batch=batch, tpot=tpot),
        knee_batch=knee_batch(p, matmul, sizes, r),
        e2e_latency=e2e, throughput=throughput, cost_per_million=cost,
        decode_bound=decode_bound, prefill_bound=prefill_bound, notes=tuple(notes),
        breakeven_utilization=breakeven, **spec)


def _weight_byte_sizes(s: Scenario) -> tuple[Quantity, Quantity]:
    """Bytes per quantized weight and per weight kept at 16-bit, for the scenario's precision."""
    group = weight_group_size(s.model, s.weight_precision, s.group_size)
    return bytes_per_weight(s.weight_precision, group), kept_bytes(s.weight_precision)


def _speculative(s: Scenario, tpot: Quantity, batch: Quantity, context: Quantity, kv_token: Quantity,
                 r: Rates) -> dict[str, Quantity]:
    """Speculative decoding: k drafts, one verification pass of k + 1 tokens per sequence."""
    if s.spec_k == 0:
        return {}
    k, alpha = given("k", s.spec_k, "tokens"), given("acceptance", s.spec_acceptance, "%")
    p, c = parameter_counts(s.model), s.model.config
    verify_tokens = derive("verify_tokens", "tokens", "batch * (k + 1)", batch=batch, k=k)
    work = decode_work(p, c, matmul_params(p), verify_tokens, batch, context, kv_token, _weight_byte_sizes(s))
    verify, _ = pass_time("verify", work, c, r)
    if s.draft_model is None:
        draft = given("draft_step_time", 0, "s", note="prompt lookup: drafting costs nothing")
    else:
        sub = dataclasses.replace(s, model=s.draft_model, draft_model=None, spec_k=0, num_gpus=1)
        draft = dataclasses.replace(simulate(sub).tpot, name="draft_step_time", note=s.draft_model.title)
    return speculative_speedup(k, alpha, draft, verify, tpot)


def speculative_speedup(k: Quantity, acceptance: Quantity, draft_step_time: Quantity,
                        verify_time: Quantity, tpot: Quantity) -> dict[str, Quantity]:
    """The closed form of speculative decoding's gain (C10), from its costs however obtained —
    the simulator's rates, or times measured by the benchmark: each drafted token is accepted
    with chance ``acceptance``, so a step of k draft steps and one verification emits
    (1 - acceptance^(k+1)) / (1 - acceptance) tokens on average."""
    tau = derive("spec_tokens_per_step", "tokens", "k + 1", k=k, note="every draft accepted") \
        if acceptance.value == 1 else derive(
            "spec_tokens_per_step", "tokens", "(1 - acceptance ** (k + 1)) / (1 - acceptance)",
            note="expected accepted drafts + the target's own token", acceptance=acceptance, k=k)
    spec_tpot = derive("spec_tpot", "s", "(k * draft_step_time + verify_time) / spec_tokens_per_step",
                       k=k, draft_step_time=draft_step_time, verify_time=verify_time,
                       spec_tokens_per_step=tau)
    speedup = derive("spec_speedup", "x", "tpot / spec_tpot", tpot=tpot, spec_tpot=spec_tpot)
    return {"spec_tokens_per_step": tau, "spec_tpot": spec_tpot, "spec_speedup": speedup}


def _add_notes(s: Scenario, weights: Quantity, kv_room: Quantity, max_concurrent: Quantity,
               notes: list[str]) -> None:
    c = s.model.config
    if s.prompt_tokens + s.output_tokens > c.max_model_len:
        notes.append(f"{s.prompt_tokens + s.output_tokens} tokens exceed {s.model.title}'s trained "
                     f"context of {c.max_model_len}: the arithmetic holds, the quality needs RoPE scaling.")
    if kv_room.value <= 0:
        notes.append(f"the weights ({weights.human()}) do not fit in {s.num_gpus} x "
                     f"{s.hardware.title}: use more GPUs or a smaller weight precision.")
    elif s.batch > max_concurrent.value:
        notes.append(f"batch {s.batch} does not fit: KV room holds {int(max_concurrent.value)} "
                     "sequences of this length; the rest would wait or be preempted.")
    if s.model.is_moe:
        notes.append(f"{s.model.title} routes each token to {s.model.experts_per_token} of "
                     f"{s.model.num_experts} experts: memory holds all, a token computes with few.")


def sweep(scenario: Scenario, knob: str, values: Iterable[int | float]) -> list[Simulation]:
    """Simulate the same scenario with one knob (e.g. 'batch') set to each value."""
    fields = {f.name for f in dataclasses.fields(Scenario)}
    if knob not in fields:
        raise SimulationError(f"cannot sweep {knob}: choose one of {', '.join(sorted(fields))}")
    return [simulate(dataclasses.replace(scenario, **{knob: v})) for v in values]
