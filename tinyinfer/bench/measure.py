"""Measurements the simulator is calibrated against: this device's copy bandwidth and matmul
rate, and real engine runs (torch runner, random weights of real shapes) timed for time to
first token and time per output token. ``calibrate`` measures, then hands the numbers to the
simulator's fit (``tinyinfer.simulate.calibrate``). torch and the engine are imported lazily,
so importing this module costs nothing.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from tinyinfer.display import progress
from tinyinfer.runners import threads
from tinyinfer.engine_config import DEFAULTS
from tinyinfer.simulate.calibrate import (
    DEVICE_PRESETS,
    Calibration,
    CalibrationCase,
    EngineTiming,
    Microbenchmarks,
    compare,
    default_cases,
    fit_efficiency,
)
from tinyinfer.simulate.presets import HARDWARE, Hardware, SimulationError

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def sync(device: str) -> None:
    """Wait for the device's queued work (a CUDA device; the CPU has none to wait for)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    """Median wall time of fn() after one warm-up call, synchronising the device around it."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


COPY_BYTES = {"cuda": 2 << 30, "cpu": 1 << 30}  # far beyond every cache (docs/benchmarks.md)


def measure_copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write: the roofline's
    denominator. On a GPU each copy is timed with CUDA events (no host round trip in the
    interval), the median of ``repeats`` after a warm-up; on the CPU NumPy's copy (the NumPy
    path needs no torch), in as many slices at once as the runs' thread count (``threads``:
    NumPy lets go of the interpreter lock while it copies), with the host clock."""
    if not device.startswith("cuda"):
        from concurrent.futures import ThreadPoolExecutor

        src_host = np.ones((nbytes or COPY_BYTES["cpu"]) // 4, dtype=np.float32)
        dst_host = np.empty_like(src_host)
        count = threads.default_threads()  # what threads.use set for this run
        cuts = np.linspace(0, src_host.size, count + 1, dtype=np.int64)
        pieces = [(dst_host[a:b], src_host[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        with ThreadPoolExecutor(count) as pool:
            def copy() -> None:
                list(pool.map(lambda piece: np.copyto(*piece), pieces))
            seconds = median_seconds(copy, device, repeats)
        return 2 * src_host.nbytes / seconds
    import torch

    src = torch.empty((nbytes or COPY_BYTES["cuda"]) // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times)


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

    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.runners.torch_weights import random_weights

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
    from tinyinfer.model import Model
    from tinyinfer.sampling import SamplingParams

    config = case.model.config
    model = Model(config=config, runner=runner, path=Path("."),  # type: ignore[arg-type]
                  name=case.model.name)
    pages_per_seq = -(-(case.prompt_tokens + case.output_tokens) // DEFAULTS.page_size)
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


def calibrate(device: str | None = None, cases: Sequence[CalibrationCase] | None = None) -> Calibration:
    """Measure the device and the engine on it; fit efficiencies; compare predictions."""
    from tinyinfer.runners.torch_weights import pick_device

    device = device or pick_device(None).type
    on_gpu = device.startswith("cuda")
    precision = "bf16" if on_gpu else "fp32"
    with progress.task(f"calibration: microbenchmarks on {device} ({precision})"):
        micro = measure_device(device, precision, nbytes=(1 << 30) if on_gpu else (64 << 20),
                               n=8192 if on_gpu else 512)
    hardware = hardware_for(micro)
    timings = measure_engine(cases if cases is not None else default_cases(device), device, precision)
    efficiency = fit_efficiency(hardware, micro, timings)
    return Calibration(micro, hardware, efficiency, compare(hardware, precision, efficiency, timings))
