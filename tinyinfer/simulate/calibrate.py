"""Calibration, the simulator's side: fit its efficiencies to measured runs, and report.

The roofline assumes datasheet rates; real kernels reach a share of them, and an engine pays
for work outside the GPU math (Python, kernel launches, sampling on the host). The
measurements (a device-to-device copy, a large matmul, and real engine runs of real shapes:
time to first token and time per output token) are taken on the engine's side of the wall,
by ``tinyinfer.bench.measure``; this module fits ``Efficiency`` to them
(``fit_efficiency``) and lists predicted vs measured TTFT and TPOT, marking the runs the fit
saw and those it did not. Like the rest of the simulator, it runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tinyinfer.simulate.model import Efficiency, Scenario, Simulation, simulate
from tinyinfer.simulate.presets import Hardware, ModelSpec, model_from_hf, model_preset
from tinyinfer.simulate.quantity import Quantity, format_value

# A Llama-shaped model small enough to measure on any CPU.
TINY_LLAMA = model_from_hf("tiny-llama", {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 1024}, "tiny Llama (4 layers, 256 wide)", "calibration")

DEVICE_PRESETS = {"H100": "h100-sxm", "H200": "h200", "A100": "a100-80gb", "L4": "l4",
                  "4090": "rtx-4090"}


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

