"""Calibration: measure this device and the engine on it, then fit the simulator's efficiencies.

The roofline assumes datasheet rates; real kernels reach a share of them, and an engine pays
for work outside the GPU math (Python, kernel launches, sampling on the host). Calibration
measures:

1. a device-to-device copy (memory bandwidth) and a large matmul (FLOP/s) with torch;
2. real engine runs on the torch runner with random weights of real shapes: time to first
   token of a batch of prompts and time per output token;

and fits ``Efficiency`` (see ``fit_efficiency``). It then lists predicted vs measured TTFT
and TPOT, marking the runs the fit saw and those it did not. Unlike the simulator, this
module runs things: it imports torch and the engine, lazily.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tinyinfer import progress
from tinyinfer.simulate import Efficiency, Scenario, Simulation, simulate
from tinyinfer.simulate_presets import (
    HARDWARE, Hardware, ModelSpec, SimulationError, model_from_hf, model_preset,
)
from tinyinfer.simulate_quantity import Quantity, format_value

# A Llama-shaped model small enough to measure on any CPU.
TINY_LLAMA = model_from_hf("tiny-llama", {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 1024}, "tiny Llama (4 layers, 256 wide)", "calibration")

DEVICE_PRESETS = {"H100": "h100-sxm", "H200": "h200", "A100": "a100-80gb", "L4": "l4",
                  "4090": "rtx-4090"}
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Microbenchmarks:
    """Raw rates of this device, measured with torch."""

    device: str
    precision: str  # "fp32" or "bf16": the dtype of the matmul and of the engine runs
    copy_bandwidth: float  # bytes read + written per second by a device-to-device copy
    matmul_flops: float  # FLOP/s of a square matmul


@dataclass(frozen=True)
class CalibrationCase:
    """One engine workload: a model shape, a batch, prompt and output lengths."""

    model: ModelSpec
    batch: int
    prompt_tokens: int
    output_tokens: int
    fit: bool = True  # used to fit the efficiencies (else only compared)


@dataclass(frozen=True)
class EngineTiming:
    """What the engine measured for a case: TTFT and median TPOT of its requests."""

    case: CalibrationCase
    ttft: float  # seconds; the batch's prompts are prefilled in one step, so all share it
    tpot: float  # seconds


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured for one metric of one case."""

    label: str
    metric: str  # "TTFT" or "TPOT"
    predicted: float
    measured: float
    fitted: bool

    @property
    def error(self) -> float:
        """Relative error of the prediction: +0.10 means 10% too slow."""
        return self.predicted / self.measured - 1


@dataclass(frozen=True)
class Calibration:
    """The measured device, the fitted efficiencies and how well they predict the engine."""

    micro: Microbenchmarks
    hardware: Hardware
    efficiency: Efficiency
    comparisons: tuple[Comparison, ...]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    """Median wall time of fn() after one warm-up call, synchronising the device around it."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(device: str, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / seconds


def measure_matmul_flops(device: str, precision: str, n: int, repeats: int = 5) -> float:
    """FLOP/s of an n × n by n × n matmul (2 n^3 FLOPs) in the given precision."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[precision])
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats)
    return 2 * n ** 3 / seconds


def measure_device(device: str, precision: str, nbytes: int, n: int) -> Microbenchmarks:
    """Both microbenchmarks on one device."""
    return Microbenchmarks(device, precision, measure_copy_bandwidth(device, nbytes),
                           measure_matmul_flops(device, precision, n))


def hardware_for(micro: Microbenchmarks) -> Hardware:
    """The preset of this GPU if it is one, else a Hardware whose peaks are the measured rates."""
    import torch

    if micro.device.startswith("cuda"):
        name = torch.cuda.get_device_name(micro.device)
        for marker, preset in DEVICE_PRESETS.items():
            if re.search(rf"\b{marker}\b", name):
                return HARDWARE[preset]
        memory = torch.cuda.get_device_properties(micro.device).total_memory
    else:
        name = f"this CPU ({os.cpu_count()} threads)"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rates = {"fp32": micro.matmul_flops, "bf16": micro.matmul_flops}
    return Hardware("this-device", name, rates, micro.copy_bandwidth, float(memory),
                    HARDWARE["laptop-cpu"].price_per_hour, source="measured by calibration")


def measure_engine(cases: Sequence[CalibrationCase], device: str, precision: str,
                   seed: int = 0) -> list[EngineTiming]:
    """Run cases through the real engine (torch runner, random weights of each case's shape),
    each once to warm up (compile, CUDA graphs) and once measured; grouped by model, so each
    model's weights are made once and freed before the next model's."""
    import gc

    import torch

    from tinyinfer.model.torch_fast import TorchRunner
    from tinyinfer.model.torch_weights import random_weights

    dtype = TORCH_DTYPES[precision]
    order = {name: i for i, name in reversed(list(enumerate(c.model.name for c in cases)))}
    runner, shape, timings = None, None, []
    for case in progress.track(sorted(cases, key=lambda c: order[c.model.name]), "calibration: engine cases"):
        config = case.model.config
        if case.model.is_moe:
            raise SimulationError("the engine runs dense models only: calibrate with a dense preset")
        if case.prompt_tokens + case.output_tokens > config.max_model_len:
            raise SimulationError(f"{case.model.title} holds {config.max_model_len} tokens: "
                                  "shorten the calibration prompt or output")
        if shape != config:
            runner = None  # free the last model's weights (and compiled code holding them) first
            torch.compiler.reset()
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            runner = TorchRunner(config, random_weights(config, device, dtype, seed), device=device, dtype=dtype)
            shape = config
        _run_case(case, runner, seed)
        timings.append(_run_case(case, runner, seed + 1))
    return timings


def _run_case(case: CalibrationCase, runner: object, seed: int) -> EngineTiming:
    import random
    from pathlib import Path

    from tinyinfer.engine import Engine
    from tinyinfer.loading import Model
    from tinyinfer.sampling import SamplingParams

    config = case.model.config
    model = Model(config=config, runner=runner, path=Path("."),  # type: ignore[arg-type]
                  name=case.model.name)
    pages_per_seq = -(-(case.prompt_tokens + case.output_tokens) // 16)
    engine = Engine(model, num_pages=case.batch * pages_per_seq + 1, max_num_seqs=case.batch,
                    max_num_batched_tokens=max(512, case.batch * case.prompt_tokens),
                    enable_prefix_caching=False)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=case.output_tokens, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(config.vocab_size) for _ in range(case.prompt_tokens)], params)
           for _ in range(case.batch)]
    while engine.has_unfinished():
        engine.step()
    done = [engine.release(i).metrics for i in ids]
    tpots = [(m.finished - m.first_token) / max(1, case.output_tokens - 1) for m in done]
    return EngineTiming(case, ttft=statistics.median(m.ttft for m in done), tpot=statistics.median(tpots))


def _scenario(case: CalibrationCase, hardware: Hardware, precision: str, efficiency: Efficiency) -> Scenario:
    return Scenario(case.model, hardware, weight_precision=precision, kv_precision=precision,
                    batch=case.batch, prompt_tokens=case.prompt_tokens,
                    output_tokens=case.output_tokens, efficiency=efficiency)


def _prefill_time(sim: Simulation) -> Quantity:
    """Prefill of the whole batch: the TTFT of a batch whose prompts arrive together."""
    return sim.e2e_latency.inputs["batch_prefill_time"]  # type: ignore[return-value]


def _parts(step: Quantity) -> tuple[float, float]:
    """A step's roofline times: (linear part, attention part)."""
    return step.inputs["linear_time"].value, step.inputs["attention_time"].value  # type: ignore[union-attr]


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least squares A·x ≈ y with every x ≥ 0, exactly, for the few unknowns calibration has.

    The optimum is the unconstrained least-squares solution on some subset of the unknowns
    (the rest held at 0): try every subset, keep the best one that is non-negative.
    """
    import itertools

    import numpy as np

    a, target = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    n = a.shape[1]
    best, best_sse = np.zeros(n), float(target @ target)
    for size in range(1, n + 1):
        for subset in itertools.combinations(range(n), size):
            x_sub = np.linalg.lstsq(a[:, subset], target, rcond=None)[0]
            if (x_sub < 0).any():
                continue
            x = np.zeros(n)
            x[list(subset)] = x_sub
            sse = float(((a @ x - target) ** 2).sum())
            if sse < best_sse - 1e-15 * max(1.0, best_sse):
                best, best_sse = x, sse
    return best.tolist()


def fit_efficiency(hardware: Hardware, micro: Microbenchmarks,
                   timings: Sequence[EngineTiming]) -> Efficiency:
    """Efficiencies and overheads that make the simulator reproduce the measured engine runs.

    Start from the microbenchmarks (matmul ÷ peak, copy ÷ peak bandwidth), then fit by
    non-negative least squares over the runs used for fitting:
      TPOT = step_overhead + sample_cost × batch × vocab + slowdown × decode roofline
      TTFT = the same overheads + prefill_seq_overhead × prompts
             + slowdown_linear × linear time + slowdown_attention × attention time
    where rooflines are the simulator's times at the microbenchmark rates. An efficiency is its
    microbenchmark share ÷ its slowdown; no slowdown may make the engine beat the matmul
    microbenchmark or the datasheet bandwidth (streaming reads may beat a copy, up to the peak).
    """
    peak = hardware.peak(micro.precision)
    share = min(1.5, micro.matmul_flops / peak)
    base = Efficiency(compute=share, attention=share,
                      bandwidth=min(1.5, micro.copy_bandwidth / hardware.memory_bandwidth))
    fitted = [t for t in timings if t.case.fit]
    if not fitted:
        return base
    sims = [simulate(_scenario(t.case, hardware, micro.precision, base)) for t in fitted]
    logits = [t.case.batch * t.case.model.config.vocab_size for t in fitted]
    decode = [sum(_parts(s.tpot)) for s in sims]
    least = base.bandwidth  # slowdown of a read at the datasheet peak
    step, sample_cost, extra = nnls([[1, n, r] for n, r in zip(logits, decode)],
                                    [t.tpot - least * r for t, r in zip(fitted, decode)])
    prefill = [_parts(_prefill_time(s)) for s in sims]
    per_prompt, extra_linear, extra_attention = nnls(
        [[t.case.batch, lin, att] for t, (lin, att) in zip(fitted, prefill)],
        [t.ttft - step - sample_cost * n - (lin + att)
         for t, n, (lin, att) in zip(fitted, logits, prefill)])
    return Efficiency(compute=share / (1 + extra_linear), attention=share / (1 + extra_attention),
                      bandwidth=base.bandwidth / (least + extra),
                      step_overhead=step, prefill_seq_overhead=per_prompt, sample_cost=sample_cost)


def compare(hardware: Hardware, precision: str, efficiency: Efficiency,
            timings: Sequence[EngineTiming]) -> tuple[Comparison, ...]:
    """Predicted vs measured TTFT (the batch's prompts arriving together) and TPOT, per run."""
    rows = []
    for t in timings:
        c = t.case
        label = f"{c.model.name} b={c.batch} p={c.prompt_tokens} o={c.output_tokens}"
        batch = simulate(_scenario(c, hardware, precision, efficiency))
        rows.append(Comparison(label, "TTFT", _prefill_time(batch).value, t.ttft, c.fit))
        rows.append(Comparison(label, "TPOT", batch.tpot.value, t.tpot, c.fit))
    return tuple(rows)


def default_cases(device: str) -> list[CalibrationCase]:
    """Real 7B-13B shapes on a GPU (MHA and GQA, vocabularies of 32K to 152K), the tiny Llama on
    a CPU; a few runs held out of the fit to show how well it predicts what it has not seen."""
    if device.startswith("cuda"):
        l2, l3, qwen, big = (model_preset(n) for n in ("llama-2-7b", "llama-3-8b", "qwen2.5-7b", "llama-2-13b"))
        fit = [(l2, 1, 512), (l2, 16, 512), (l2, 64, 128), (l3, 1, 2048), (l3, 4, 1024), (l3, 32, 256),
               (qwen, 2, 512), (qwen, 16, 256), (big, 1, 512), (big, 8, 256)]
        held_out = [(l2, 8, 1024), (l3, 16, 512), (qwen, 8, 2048), (big, 4, 1024)]
        return [CalibrationCase(m, b, p, 32) for m, b, p in fit] + \
            [CalibrationCase(m, b, p, 32, fit=False) for m, b, p in held_out]
    return [CalibrationCase(TINY_LLAMA, 1, 64, 8), CalibrationCase(TINY_LLAMA, 8, 64, 8),
            CalibrationCase(TINY_LLAMA, 4, 128, 8), CalibrationCase(TINY_LLAMA, 2, 256, 8, fit=False)]


def calibrate(device: str | None = None, cases: Sequence[CalibrationCase] | None = None) -> Calibration:
    """Measure the device and the engine on it; fit efficiencies; compare predictions."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    precision = "bf16" if on_gpu else "fp32"
    with progress.task(f"calibration: microbenchmarks on {device} ({precision})"):
        micro = measure_device(device, precision, nbytes=(1 << 30) if on_gpu else (64 << 20),
                               n=8192 if on_gpu else 512)
    hardware = hardware_for(micro)
    timings = measure_engine(cases if cases is not None else default_cases(device), device, precision)
    efficiency = fit_efficiency(hardware, micro, timings)
    return Calibration(micro, hardware, efficiency, compare(hardware, precision, efficiency, timings))


def calibration_report(cal: Calibration) -> str:
    """The calibration as text: rates, fitted efficiencies, predicted vs measured."""
    m, hw, e = cal.micro, cal.hardware, cal.efficiency
    peak = hw.peak(m.precision)
    lines = [
        f"device       {hw.title} ({m.device}, {m.precision})",
        f"copy         {format_value(m.copy_bandwidth, 'B/s')} = "
        f"{100 * m.copy_bandwidth / hw.memory_bandwidth:.0f}% of {format_value(hw.memory_bandwidth, 'B/s')}",
        f"matmul       {format_value(m.matmul_flops, 'FLOP/s')} = "
        f"{100 * m.matmul_flops / peak:.0f}% of {format_value(peak, 'FLOP/s')}",
        f"fitted       compute {e.compute:.3f}, attention {e.attention:.3f}, bandwidth {e.bandwidth:.3f}, "
        f"step overhead {format_value(e.step_overhead, 's')}, per prompt in a prefill "
        f"{format_value(e.prefill_seq_overhead, 's')}, host sampling {1e9 * e.sample_cost:.1f} ns "
        "per vocabulary entry",
        f"simulate with: --compute-efficiency {e.compute:.3f} --attention-efficiency {e.attention:.3f} "
        f"--bandwidth-efficiency {e.bandwidth:.3f} "
        f"--step-overhead-ms {1e3 * e.step_overhead:.3f} --prefill-seq-overhead-ms "
        f"{1e3 * e.prefill_seq_overhead:.3f} --sample-ns {1e9 * e.sample_cost:.2f}",
        "",
        f"{'run':<34}{'metric':<8}{'predicted':>12}{'measured':>12}{'error':>9}  fit",
    ]
    for c in cal.comparisons:
        lines.append(f"{c.label:<34}{c.metric:<8}{format_value(c.predicted, 's'):>12}"
                     f"{format_value(c.measured, 's'):>12}{100 * c.error:>+8.0f}%  "
                     f"{'yes' if c.fitted else 'held out'}")
    return "\n".join(lines)

