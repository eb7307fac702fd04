"""Tensor-parallel calibration from recorded runs: the link's constants and this engine's own cost.

``scripts/tp_gpu_check.py`` records, on a machine with several GPUs, one NCCL all-reduce by
message size (TP=2 and TP=4, replayed from a CUDA graph) and batch-1 decode through the engine
(one model at TP=1, 2 and 4, a bigger one sharded only), with the time each decode step spent in
all-reduces: timed with CUDA events, or — collectives untimed, as the engine runs by default —
rank 0's collective kernel time per step from a profile stage (``..._tp<N>[_kind]_profile...``),
whose median all-reduce kernel then stands in for the wire where no sweep was recorded. This
module reads that JSON — it runs nothing — and fits, with formulas the simulator then shows:

1. the wire (hardware): ``all_reduce_latency = link_latency + 2 (gpus - 1) link_hop_latency``
   through each device count's smallest message, and ``link_bandwidth`` = the mean NCCL bus
   bandwidth of the largest message (the preset's where no message of 1 MiB or more was timed);
2. this engine, on the model that also ran on one GPU: ``bandwidth_efficiency`` = recorded copy
   bandwidth ÷ datasheet; ``step_overhead`` = its TP=1 TPOT − its roofline; then by least
   squares over its sharded runs ``all_reduce_wait`` (all-reduce time per step − the wire =
   all_reduce_wait × all_reduces²) and ``collective_overhead`` (the rest of the step beyond the
   one-GPU terms = collective_overhead × all_reduces).

Runs of the other models are held out: predicted with the fitted constants, not used to fit them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from tinyinfer.simulate.calibrate import DEVICE_PRESETS, nnls
from tinyinfer.simulate.model import Efficiency, Scenario, Simulation, simulate
from tinyinfer.simulate.presets import (
    HARDWARE,
    Hardware,
    ModelSpec,
    SimulationError,
    model_preset,
)
from tinyinfer.simulate.quantity import Quantity, format_value, given
from tinyinfer.simulate.steps import rates, wire_time

PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class AllReduceTime:
    """One bf16 all-reduce of `nbytes` over `gpus` devices, replayed from a CUDA graph."""

    gpus: int
    nbytes: int
    seconds: float

    @property
    def bus_bandwidth(self) -> float:
        """NCCL's bus bandwidth: the 2 (gpus - 1) / gpus × nbytes a ring moves per device, per second."""
        return 2 * (self.gpus - 1) / self.gpus * self.nbytes / self.seconds


@dataclass(frozen=True)
class DecodeRun:
    """Batch-1 decode of one model shape at one tensor-parallel size, through the engine."""

    model: ModelSpec
    gpus: int
    precision: str
    prompt_tokens: int
    output_tokens: int
    tpot: float  # seconds, median over the decode steps
    comm: float  # seconds per step in all-reduces, mean over ranks (waiting for the slowest included)
    copy_bandwidth: float  # bytes/s of a copy on one of its GPUs, measured before the run
    fit: bool = True

    @property
    def label(self) -> str:
        return f"{self.model.name} TP={self.gpus}"


@dataclass(frozen=True)
class Recorded:
    """What one tp_gpu_check.py JSON holds that the simulator can be compared with."""

    path: str
    device: str
    date: str
    sweep: tuple[AllReduceTime, ...]
    runs: tuple[DecodeRun, ...]
    asynchronous: bool = False  # the runs made with asynchronous scheduling (else step by step)


@dataclass(frozen=True)
class TPComparison:
    """Predicted vs measured TPOT or all-reduce time per step for one run."""

    run: DecodeRun
    metric: str  # "TPOT" or "comm"
    wire_only: float  # an engine that adds nothing to the wire: only the one-GPU terms fitted
    predicted: float  # with this engine's all-reduce wait and per-collective overhead
    measured: float

    @property
    def error(self) -> float:
        """Relative error of the calibrated prediction: +0.10 means 10% too slow."""
        return self.predicted / self.measured - 1


@dataclass(frozen=True)
class TPCalibration:
    """The recorded runs, the hardware with its fitted link, this engine's fit, the comparisons."""

    recorded: Recorded
    hardware: Hardware
    efficiency: Efficiency
    sweep: tuple[tuple[AllReduceTime, float], ...]  # each measured all-reduce, with the wire's prediction
    comparisons: tuple[TPComparison, ...]


def load_recorded(path: str | Path, asynchronous: bool = False) -> Recorded:
    """The all-reduce sweeps and the CUDA-graph decode runs of a tp_gpu_check.py JSON file (or
    of the summary scripts/tp_scaling.sh writes: each group's tp_gpu_check.py JSON by group).

    Runs that failed, ran without CUDA graphs, have no all-reduce time (collectives untimed and
    no profile), or are a variant stage (``llama3_8b_tp2_untimed``, ``..._no_mixing``: a
    different engine) are left out; runs of a model that also ran on one GPU are marked for
    fitting, the others held out. Without a sweep, the profiled runs' median all-reduce kernel
    (one message of the model's hidden state) is the wire. ``asynchronous``: the runs that
    ``_async`` stages made with asynchronous scheduling (a run's "async" record) instead of the
    step-by-step ones, a different engine to fit.
    """
    try:
        data = _merged_groups(json.loads(Path(path).read_text(encoding="utf-8")))
        # a sweep is a list of rows, or (since it also times symmetric-memory all-reduces)
        # {"sizes": rows, ...}
        sweep = tuple(AllReduceTime(int(key.removeprefix("all_reduce_tp")), int(row["bytes"]),
                                    row["graph_us"] * 1e-6)
                      for key, value in data.items() if re.fullmatch(r"all_reduce_tp\d+", key)
                      and isinstance(value, (list, dict))
                      for row in (value["sizes"] if isinstance(value, dict) else value))
        recorded = [(value, comm) for key, value in data.items()
                    if (comm := _all_reduce_ms(key, value)) is not None
                    and (not asynchronous or isinstance(value.get("async"), dict))]
        runs = [_decode_run(value, value["async"] if asynchronous else value, comm)
                for value, comm in recorded]
        if not sweep:
            sweep = tuple(AllReduceTime(run.gpus, run.model.config.hidden_size * 2,
                                        value["profile"]["median_all_reduce_us"] * 1e-6)
                          for run, (value, _) in zip(runs, recorded)
                          if run.gpus > 1 and "median_all_reduce_us" in value.get("profile", {}))
        device = f"{data['gpus']} x {data['device']}"
    except OSError as exc:
        raise SimulationError(f"cannot read recorded tensor-parallel runs from {path}: {exc.strerror}; give "
                              "the JSON file scripts/tp_gpu_check.py writes") from None
    except (ValueError, KeyError, TypeError) as exc:
        what = f"no field {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise SimulationError(f"{path} holds no recorded tensor-parallel runs ({what}): give the "
                              "JSON file scripts/tp_gpu_check.py writes") from None
    if asynchronous and not runs:
        raise SimulationError(f"{path} holds no runs made with asynchronous scheduling: record them with "
                              "an _async stage of scripts/tp_gpu_check.py")
    on_one_gpu = {r.model.name for r in runs if r.gpus == 1}
    if not sweep or not on_one_gpu:
        raise SimulationError(f"{path} needs an all_reduce_tp* sweep and a decode run at TP=1: "
                              "record them with scripts/tp_gpu_check.py")
    runs = sorted((dataclasses.replace(r, fit=r.model.name in on_one_gpu) for r in runs),
                  key=lambda r: (not r.fit, r.model.name, r.gpus))
    return Recorded(str(path), device, str(data.get("date", "undated")), sweep, tuple(runs), asynchronous)


def _merged_groups(data: dict) -> dict:
    """A tp_gpu_check.py recording as it is, or tp_scaling.sh's summary (group -> recording)
    as one recording: every group's stages, the header of the group with the most GPUs."""
    if "gpus" in data or not data or not all(isinstance(v, dict) and "gpus" in v for v in data.values()):
        return data
    groups = sorted(data.values(), key=lambda group: group["gpus"])
    return {key: value for group in groups for key, value in group.items()} | groups[-1]


def _all_reduce_ms(key: str, value: object) -> float | None:
    """A default-engine decode run's all-reduce ms per step: its timed collectives, or (untimed)
    its profile's collective kernel time on rank 0, or none on one GPU; None for anything else."""
    if not (isinstance(value, dict) and "tpot_p50_ms" in value and value["runner"].get("cuda_graphs")):
        return None
    if re.fullmatch(r"\w+_tp\d+", key) and value["runner"].get("time_collectives", True):
        return float(value["all_reduce_ms"])
    stage = re.fullmatch(r"\w+_tp(\d+)(_nccl|_symm_mem|_push)?(_async)?(_profile\w*)?", key)
    if stage and stage[1] == "1":  # one GPU: no collective
        return 0.0
    profile = value.get("profile")
    if stage and stage[4] and isinstance(profile, dict) and "collective_kernel_ms_per_step" in profile:
        # (an _async stage profiles its asynchronous steps: the same kernels, so the same time)
        return float(profile["collective_kernel_ms_per_step"])
    return None


def _decode_run(value: dict, timed: dict, all_reduce_ms: float) -> DecodeRun:
    """The run of recording ``value`` whose latency is ``timed`` (value itself, or its "async")."""
    return DecodeRun(model_preset(value["label"].split(" / ")[0]), int(value["tensor_parallel"]),
                     PRECISIONS[value["runner"]["dtype"]], int(timed["prompt_tokens"]),
                     int(timed["decode_tokens"]), timed["tpot_p50_ms"] / 1e3, all_reduce_ms / 1e3,
                     value["bandwidth"])


def hardware_named(device: str) -> Hardware:
    """The hardware preset a recorded device name (e.g. '4 x NVIDIA H200') stands for."""
    for marker, preset in DEVICE_PRESETS.items():
        if re.search(rf"\b{marker}\b", device):
            return HARDWARE[preset]
    raise SimulationError(f"no hardware preset for {device}: calibrate on one of {', '.join(DEVICE_PRESETS)}")


def fit_link(hardware: Hardware, recorded: Recorded) -> Hardware:
    """The hardware with its link constants fitted to the all-reduce sweep.

    Latency: least squares of ``link_latency + 2 (gpus - 1) link_hop_latency`` through each
    device count's smallest message (exact for two counts; one count gives no hop latency).
    Bandwidth: the mean over device counts of the largest message's bus bandwidth, where it is
    1 MiB or more (a few KB time the latency, not the bandwidth: the preset's is kept).
    """
    counts = sorted({p.gpus for p in recorded.sweep})
    smallest = [min((p for p in recorded.sweep if p.gpus == g), key=lambda p: p.nbytes) for g in counts]
    largest = [max((p for p in recorded.sweep if p.gpus == g), key=lambda p: p.nbytes) for g in counts]
    latency, hop = nnls([[1, 2 * (g - 1)] for g in counts], [p.seconds for p in smallest])
    if min(p.nbytes for p in largest) >= 1 << 20:
        bandwidth, source = statistics.mean(p.bus_bandwidth for p in largest), f"fitted to {recorded.path}"
    else:
        bandwidth = hardware.link_bandwidth
        source = f"latency fitted to {recorded.path}, bandwidth the preset's"
    return dataclasses.replace(hardware, link_latency=latency, link_hop_latency=hop,
                               link_bandwidth=bandwidth, link_source=source)


def predict_all_reduce(hardware: Hardware, gpus: int, nbytes: int) -> float:
    """The simulator's wire time for one all-reduce of `nbytes` over `gpus` devices."""
    r = rates(hardware, Efficiency(), gpus, "bf16")
    return wire_time("sweep", r, given("message", nbytes, "B")).value


def _scenario(run: DecodeRun, hardware: Hardware, efficiency: Efficiency) -> Scenario:
    return Scenario(run.model, hardware, weight_precision=run.precision, kv_precision=run.precision,
                    prompt_tokens=run.prompt_tokens, output_tokens=run.output_tokens, num_gpus=run.gpus,
                    efficiency=efficiency)


def _comm(sim: Simulation) -> Quantity:
    return sim.tpot.inputs["comm_time"]  # type: ignore[return-value]


def _all_reduces_and_wire(sim: Simulation) -> tuple[float, float]:
    """A sharded decode step's all-reduce count and the wire time of one of them."""
    comm = _comm(sim).inputs
    return comm["all_reduces"].value, comm["wire_time"].value  # type: ignore[union-attr]


def fit_engine(hardware: Hardware, runs: tuple[DecodeRun, ...]) -> Efficiency:
    """This engine's efficiency and overheads from the runs marked for fitting (see the module doc)."""
    base = Efficiency(bandwidth=statistics.mean(r.copy_bandwidth for r in runs) / hardware.memory_bandwidth)
    fitted = [r for r in runs if r.fit]
    one_gpu = [r for r in fitted if r.gpus == 1]
    (step,) = nnls([[1]] * len(one_gpu), [r.tpot - simulate(_scenario(r, hardware, base)).tpot.value
                                          for r in one_gpu])
    base = dataclasses.replace(base, step_overhead=step)
    sharded = [(r, simulate(_scenario(r, hardware, base))) for r in fitted if r.gpus > 1]
    if not sharded:
        return base
    shape = [_all_reduces_and_wire(s) for _, s in sharded]
    (wait,) = nnls([[n * n] for n, _ in shape], [r.comm - n * wire for (r, _), (n, wire) in zip(sharded, shape)])
    (outside,) = nnls([[n] for n, _ in shape],
                      [r.tpot - r.comm - (s.tpot.value - _comm(s).value) for r, s in sharded])
    return dataclasses.replace(base, all_reduce_wait=wait, collective_overhead=outside)


def compare_runs(hardware: Hardware, efficiency: Efficiency,
                 runs: tuple[DecodeRun, ...]) -> tuple[TPComparison, ...]:
    """Each run's TPOT (and, sharded, all-reduce time per step): wire only, calibrated, measured."""
    ideal = dataclasses.replace(efficiency, all_reduce_wait=0.0, collective_overhead=0.0)
    rows = []
    for run in runs:
        wire, engine = (simulate(_scenario(run, hardware, e)) for e in (ideal, efficiency))
        rows.append(TPComparison(run, "TPOT", wire.tpot.value, engine.tpot.value, run.tpot))
        if run.gpus > 1:
            rows.append(TPComparison(run, "comm", _comm(wire).value, _comm(engine).value, run.comm))
    return tuple(rows)


def calibrate_recorded(path: str | Path, asynchronous: bool = False) -> TPCalibration:
    """Fit the link and this engine's tensor-parallel terms to a recorded run; compare every run
    (``asynchronous``: the runs made with asynchronous scheduling)."""
    recorded = load_recorded(path, asynchronous)
    hardware = fit_link(hardware_named(recorded.device), recorded)
    efficiency = fit_engine(hardware, recorded.runs)
    sweep = tuple((p, predict_all_reduce(hardware, p.gpus, p.nbytes)) for p in recorded.sweep)
    return TPCalibration(recorded, hardware, efficiency, sweep, compare_runs(hardware, efficiency, recorded.runs))


def _binary_size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _sweep_lines(sweep: tuple[tuple[AllReduceTime, float], ...]) -> list[str]:
    """Measured vs predicted all-reduce time, one line per message size, one column group per device count."""
    counts = sorted({p.gpus for p, _ in sweep})
    by_key = {(p.gpus, p.nbytes): (p, predicted) for p, predicted in sweep}
    lines = [f"{'message':<10}" + "".join(f"{f'TP={g} measured':>16}{'wire':>10}{'error':>7}" for g in counts)]
    for nbytes in sorted({p.nbytes for p, _ in sweep}):
        cells = []
        for g in counts:
            p, predicted = by_key[(g, nbytes)]
            cells.append(f"{format_value(p.seconds, 's'):>16}{format_value(predicted, 's'):>10}"
                         f"{100 * (predicted / p.seconds - 1):>+6.0f}%")
        lines.append(f"{_binary_size(nbytes):<10}" + "".join(cells))
    return lines


def _bandwidth_source(hw: Hardware) -> str:
    if hw.link_source.endswith("bandwidth the preset's"):
        return "the preset's: no message of 1 MiB or more was timed"
    return "mean bus bandwidth of the largest message"


def _preset_link_note(hw: Hardware) -> str:
    """Whether `simulate --hardware NAME` uses this fit, or its preset still holds other link constants."""
    preset = HARDWARE[hw.name]
    fields = ("link_latency", "link_hop_latency", "link_bandwidth")
    if all(math.isclose(getattr(preset, f), getattr(hw, f), rel_tol=0.01) for f in fields):
        return f"the {hw.name} preset holds this fit"
    return f"the {hw.name} preset's link differs ({preset.link_source}): update it with these constants"


def tensor_parallel_report(cal: TPCalibration) -> str:
    """The tensor-parallel calibration as text: the link fit, the engine fit, predicted vs measured."""
    hw, e = cal.hardware, cal.efficiency
    lines = [
        f"recorded     {cal.recorded.device}, {cal.recorded.date} ({cal.recorded.path}), "
        f"{'asynchronous scheduling' if cal.recorded.asynchronous else 'step by step'}",
        f"wire         all_reduce_latency = {format_value(hw.link_latency, 's')} + 2 × (gpus − 1) × "
        f"{format_value(hw.link_hop_latency, 's')}; link_bandwidth = {format_value(hw.link_bandwidth, 'B/s')} "
        f"({_bandwidth_source(hw)}); {_preset_link_note(hw)}",
        *_sweep_lines(cal.sweep),
        f"this engine  bandwidth efficiency {e.bandwidth:.3f} (copy ÷ datasheet), step overhead "
        f"{format_value(e.step_overhead, 's')} (TP=1), all-reduce wait {1e6 * e.all_reduce_wait:.3f} µs × "
        f"all-reduces of the step, {format_value(e.collective_overhead, 's')} per all-reduce outside it",
        f"simulate with: --hardware {hw.name} --bandwidth-efficiency {e.bandwidth:.3f} --step-overhead-ms "
        f"{1e3 * e.step_overhead:.3f} --all-reduce-wait-us {1e6 * e.all_reduce_wait:.3f} "
        f"--collective-overhead-us {1e6 * e.collective_overhead:.1f}",
        "",
        f"{'run':<20}{'metric':<8}{'wire only':>11}{'this engine':>13}{'measured':>11}{'error':>8}  fit",
    ]
    for c in cal.comparisons:
        lines.append(f"{c.run.label:<20}{c.metric:<8}{format_value(c.wire_only, 's'):>11}"
                     f"{format_value(c.predicted, 's'):>13}{format_value(c.measured, 's'):>11}"
                     f"{100 * c.error:>+7.0f}%  {'yes' if c.run.fit else 'held out'}")
    return "\n".join(lines)
