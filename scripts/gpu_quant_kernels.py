"""The Triton int8 / int4 product kernels on a CUDA GPU: correctness, then speed per matrix.

    PYTHONPATH=. python scripts/gpu_quant_kernels.py            # JSON to $OUT/gpu_quant_kernels.json
    PYTHONPATH=. python scripts/gpu_quant_kernels.py --sweep    # also time every candidate tile
    PYTHONPATH=. python scripts/gpu_quant_kernels.py --candidates   # every tile in every loop mode
    PYTHONPATH=. python scripts/gpu_quant_kernels.py --check-only   # the checks alone

(a) correctness: every format, odd and real shapes, 1..100 rows of activations, each kind of
    program (elementwise, matrix units, split K) against the float64 product with the
    reference's dequantized weight (``tinyinfer.quant.dequantize``); outputs are allocated over
    NaN-filled memory, so an element left unwritten fails.
(b) speed: the products of one layer of the llama-3-8b and llama-3.2-1b shapes at 1..16 rows:
    the kernels' own tile choice (and with --sweep, every candidate), against bf16 (cuBLAS),
    torch's int4 kernel and the int8 path the runner used before the kernels. Each time is a
    CUDA-graph replay of the product over enough copies of the weight that L2 holds none,
    median of 20 replays; GB/s counts the bytes the weight stores (codes, scales, offsets).
    With --candidates: every candidate tile in every loop mode (``MODES``: the loop's loads
    staged 3-4 deep by Triton's pipeliner through shared memory, from pointers or through
    tensor descriptors, the copy engine) on each
    product at 1, 2 and 16 rows, compiled beforehand in worker processes; then split K around
    the best one-row programs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import copy_bandwidth, environment, graph_us_per_call, log  # noqa: E402

from tinyinfer.quant import QuantConfig, dequantize, quantize  # noqa: E402
from tinyinfer.runners import torch_layers as layers  # noqa: E402

SHAPES = {  # one layer's products: [out, in]
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
}
CHECK_FORMATS = ("int8", "int8-g32", "int8-g128", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym",
                 "int4-g128-asym", "int4-g32-min", "int4-g64-min")
ROWS = (1, 2, 4, 8, 16)
L2_BYTES = 256 << 20  # copies of a weight cover this much, several times the 50-60 MB L2


def kernel_module():
    from tinyinfer.runners import torch_quant_kernel

    return torch_quant_kernel


def fresh_output_memory(device: torch.device) -> None:
    """Fill freed cached memory with NaN, so an output the kernel does not write reads NaN."""
    junk = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=device)
    del junk


PIPELINED = {  # the loop's loads staged by Triton's pipeliner (pointers, or tensor descriptors: the copy engine)
    "elementwise pipelined": {"num_stages": 3}, "elementwise TMA": {"num_stages": 3, "tma": True},
    "dot pipelined": {"num_stages": 3, "dot": True}, "dot TMA": {"num_stages": 3, "tma": True, "dot": True},
}


def check_format(fmt: str) -> tuple[dict[str, Any], float]:
    """One format against x @ dequantize(W)^T in float64: odd and real shapes, 1..100 rows, each
    kind of program (a worker process runs it: the formats compile in parallel)."""
    qk = kernel_module()
    device = torch.device("cuda")
    rng = np.random.default_rng(CHECK_FORMATS.index(fmt))
    every = {"auto": None, "dot": qk.Config(64, 256, 1, dot=True)}
    every.update({name: qk.Config(16 if "elementwise" in name else 64, 256, 1, **options)
                  for name, options in PIPELINED.items()})
    more = {**every, "elementwise": qk.Config(16, 256, 1), "elementwise split 4": qk.Config(16, 128, 4),
            "dot split 2": qk.Config(32, 128, 2, dot=True),
            "elementwise pipelined split 4": qk.Config(16, 128, 4, num_stages=4),
            "elementwise TMA split 4": qk.Config(16, 128, 4, num_stages=4, tma=True),
            "dot TMA split 2": qk.Config(32, 128, 2, num_stages=3, tma=True, dot=True)}
    out, worst = {}, 0.0
    for shape in ((72, 384), (4104, 1024)):
        qw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, QuantConfig.parse(fmt))
        weight = layers.device_weight(qw, device, torch.bfloat16, kernel="triton")
        assert isinstance(weight, layers.KernelWeight), type(weight)
        ref_w = torch.from_numpy(dequantize(qw)).to(device, torch.float64)
        for rows in (1, 3, 16, 100):
            x = torch.randn((rows, shape[1]), device=device, dtype=torch.bfloat16)
            ref = x.double() @ ref_w.T
            xg, xsum = layers.kernel_inputs(x, weight.bits, weight.group_size)
            configs = more if fmt in ("int8", "int4-g128-asym", "int4-g32-min") else every
            for name, config in configs.items():
                if config is not None and not config.dot and rows > 3:
                    continue  # the elementwise program re-reads the weight per row
                fresh_output_memory(device)
                got = qk.quant_matmul(xg, xsum, weight.words, weight.scales, weight.offsets, weight.bits,
                                      weight.group_size, weight.zero, torch.bfloat16, config)
                again = qk.quant_matmul(xg, xsum, weight.words, weight.scales, weight.offsets,
                                        weight.bits, weight.group_size, weight.zero, torch.bfloat16,
                                        config)
                err = float((got.double() - ref).norm() / ref.norm())
                ok = math.isfinite(err) and err < 1e-2 and bool(torch.equal(got, again))
                worst = max(worst, err if math.isfinite(err) else float("inf"))
                key = f"{fmt} {shape[0]}x{shape[1]} rows={rows} {name}"
                out[key] = {"rel_error": err, "repeatable": bool(torch.equal(got, again)), "ok": ok}
                if not ok:
                    log(f"FAILED {key}: rel error {err:.2e}")
    return out, worst


def check(device: torch.device, per_format: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """Each format and program kind against x @ dequantize(W)^T in float64 (``check_format`` per
    format, in worker processes), then the operator compiled and inside a CUDA graph (here)."""
    out, worst = {}, 0.0
    for cases, fmt_worst in per_format:
        out.update(cases)
        worst = max(worst, fmt_worst)
    rng = np.random.default_rng(1)
    # Through the layer function, compiled, inside a CUDA graph: the operator as the runner uses it.
    qw = quantize(rng.standard_normal((512, 1024)).astype(np.float32), QuantConfig.parse("int4-g64-asym"))
    weight = layers.device_weight(qw, device, torch.bfloat16, kernel="triton")
    x = torch.randn((4, 1024), device=device, dtype=torch.bfloat16)
    graph, y = graphed_linear(x, weight)
    x.copy_(torch.randn_like(x))
    ref = x.double() @ torch.from_numpy(dequantize(qw)).to(device, torch.float64).T
    graph.replay()
    err = float((y.double() - ref).norm() / ref.norm())
    out["compiled + CUDA graph, int4-g64-asym rows=4"] = {"rel_error": err, "ok": err < 1e-2}
    passed = sum(v["ok"] for v in out.values())
    log(f"check: {passed}/{len(out)} ok, worst relative error {worst:.2e}, compiled+graph {err:.2e}")
    return {"cases": out, "passed": passed, "total": len(out), "worst_rel_error": worst}


# ---------------------------------------------------------------- speed


def random_kernel_weight(shape: tuple[int, int], fmt: str, device: torch.device,
                         gen: torch.Generator) -> layers.KernelWeight:
    """Random codes, scales and offsets in the kernels' layout (speed does not depend on values)."""
    qc = QuantConfig.parse(fmt)
    out, n = shape
    group = qc.group_size or n
    words = torch.randint(-2**31, 2**31 - 1, (out, n * qc.bits // 32), generator=gen, device=device,
                          dtype=torch.int32)
    scales = (torch.rand((out, n // group), generator=gen, device=device) * 1e-3 + 1e-4).half()
    offsets = None if qc.symmetric else (scales.float() * -7).contiguous()
    zero = 8 if qc.bits == 4 and qc.symmetric else 0
    return layers.KernelWeight(words, scales, offsets, qc.bits, group, zero)


def nbytes(weight: Any) -> int:
    tensors = [weight] if isinstance(weight, torch.Tensor) else \
        [v for v in vars(weight).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def copies_for(one: int) -> int:
    return max(2, math.ceil(L2_BYTES / one))


def timed(call: Callable[[int], Any], copies: int, device: torch.device) -> float | str:
    try:
        return graph_us_per_call(call, copies, device)
    except Exception as exc:  # noqa: BLE001 - one failing variant is recorded, the rest still run
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def kernel_us(weights: list, rows: int, config: Any, device: torch.device) -> float | str:
    qk = kernel_module()
    w0 = weights[0]
    x = torch.randn((rows, w0.words.shape[1] * 32 // w0.bits), device=device, dtype=torch.bfloat16)
    xg, xsum = layers.kernel_inputs(x, w0.bits, w0.group_size)
    return timed(lambda i: qk.quant_matmul(xg, xsum, weights[i].words, weights[i].scales, weights[i].offsets,
                                           w0.bits, w0.group_size, w0.zero, torch.bfloat16, config),
                 len(weights), device)


def baselines(shape: tuple[int, int], rows: int, device: torch.device, gen: torch.Generator,
              compiled_int8: bool = True) -> dict:
    """bf16 (cuBLAS), torch's int4 kernel (int4-g128) and the earlier int8 path (compiled)."""
    out_f, n = shape
    x = torch.randn((rows, n), device=device, dtype=torch.bfloat16)
    result = {}
    bf16 = [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(copies_for(out_f * n * 2))]
    result["bf16"] = (timed(lambda i: F.linear(x, bf16[i]), len(bf16), device), out_f * n * 2)
    packed = torch.randint(0, 256, (out_f, n // 2), generator=gen, device=device, dtype=torch.uint8)
    tiled = torch._convert_weight_to_int4pack(packed, 8)
    int4 = [(tiled.clone(), torch.randn((n // 128, out_f, 2), generator=gen, device=device,
                                        dtype=torch.bfloat16)) for _ in range(copies_for(out_f * n // 2))]
    result["torch int4-g128"] = (timed(lambda i: torch._weight_int4pack_mm(x, int4[i][0], 128, int4[i][1]),
                                       len(int4), device), nbytes(int4[0][0]) + nbytes(int4[0][1]))
    if compiled_int8:
        int8 = [layers.Int8Weight(torch.randint(-127, 128, shape, generator=gen, device=device, dtype=torch.int8),
                                  torch.rand(out_f, generator=gen, device=device, dtype=torch.bfloat16))
                for _ in range(copies_for(out_f * n))]
        compiled = torch.compile(layers.quantized_matmul)
        result["torch int8 (compiled dequant)"] = (timed(lambda i: compiled(x, int8[i]), len(int8), device),
                                                   nbytes(int8[0]))
    return {k: {"us": us, "bytes": b, "GBps": b / us / 1e3 if isinstance(us, float) else None}
            for k, (us, b) in result.items()}


SWEEP = {  # (block_n, block_k, num_warps, num_stages, dot) candidates per bits
    4: [(16, 512, 4, 1, False), (16, 1024, 4, 1, False), (32, 512, 4, 1, False), (32, 1024, 4, 1, False),
        (8, 1024, 4, 1, False), (16, 512, 2, 1, False), (16, 256, 4, 1, False), (64, 512, 8, 1, False),
        (32, 512, 8, 1, False), (16, 512, 4, 2, False),
        (64, 512, 4, 3, True), (64, 256, 4, 3, True), (32, 256, 4, 3, True), (32, 512, 4, 3, True),
        (128, 256, 4, 3, True), (64, 512, 8, 3, True), (64, 256, 4, 4, True)],
    8: [(16, 256, 4, 1, False), (16, 512, 4, 1, False), (32, 256, 4, 1, False), (32, 512, 4, 1, False),
        (8, 512, 4, 1, False), (16, 256, 2, 1, False), (64, 256, 8, 1, False), (16, 1024, 4, 1, False),
        (32, 256, 8, 1, False), (16, 256, 4, 2, False),
        (64, 256, 4, 3, True), (64, 128, 4, 3, True), (32, 128, 4, 3, True), (32, 256, 4, 3, True),
        (128, 128, 4, 3, True), (64, 256, 8, 3, True), (64, 128, 4, 4, True)],
}


def rotated_weights(shapes: dict, fmt: str, device: torch.device, gen: torch.Generator) -> dict[str, list]:
    """Random weights of each kind's shape in ``fmt``, as many copies as keep L2 from serving
    a product that cycles through them."""
    bits = QuantConfig.parse(fmt).bits
    return {kind: [random_kernel_weight(shape, fmt, device, gen)
                   for _ in range(copies_for(shape[0] * shape[1] * bits // 8))]
            for kind, shape in shapes.items()}


def graphed_linear(x: torch.Tensor, weight: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``layers.linear(x, weight)`` compiled and captured in a CUDA graph, as the runner runs it:
    the graph, and the output it writes on each replay of the current x."""
    compiled = torch.compile(layers.linear)
    for _ in range(2):
        compiled(x, weight, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = compiled(x, weight, None)
    return graph, y


def speed(device: torch.device, sweep: bool, budget_s: float, start: float) -> dict[str, Any]:
    qk = kernel_module()
    gen = torch.Generator(device=device).manual_seed(0)
    report: dict[str, Any] = {}
    for model, shapes in SHAPES.items():
        for fmt in ("int4-g128", "int8"):
            bits = QuantConfig.parse(fmt).bits
            weights = rotated_weights(shapes, fmt, device, gen)
            for rows in ROWS:
                key = f"{model} {fmt} rows={rows}"
                entry = report.setdefault(key, {})
                for kind, ws in weights.items():
                    us = kernel_us(ws, rows, None, device)
                    b = nbytes(ws[0])
                    tma = torch.cuda.get_device_capability(device) >= (9, 0) and qk.tma_fits(ws[0].words)
                    entry[kind] = {"us": us, "bytes": b, "GBps": b / us / 1e3 if isinstance(us, float) else None,
                                   "config": qk.pick_config(rows, shapes[kind][0], shapes[kind][1], bits,
                                                            torch.cuda.get_device_properties(device)
                                                            .multi_processor_count, tma)._asdict()}
                log(f"{key}: " + ", ".join(f"{k} {v['us']:.1f} us {v['GBps'] or 0:.0f} GB/s"
                                          if isinstance(v["us"], float) else f"{k} {v['us']}"
                                          for k, v in entry.items()))
            if sweep:
                for rows in (1, 16):
                    key = f"sweep {model} {fmt} rows={rows}"
                    table = report.setdefault(key, {})
                    for block_n, block_k, warps, stages, dot in SWEEP[bits]:
                        if time.perf_counter() - start > budget_s:
                            table["stopped"] = "time budget"
                            break
                        if rows > 1 and not dot:
                            continue
                        config = qk.Config(block_n, block_k, 1, warps, stages, dot)
                        times = {kind: kernel_us(ws, rows, config, device) for kind, ws in weights.items()}
                        total = sum(t for t in times.values() if isinstance(t, float))
                        table[str(tuple(config))] = {"us": times, "layer_us": total, "config": config}
                        log(f"  {key} {tuple(config)}: layer {total:.1f} us "
                            + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in times.items()))
                    best_config = min((v for v in table.values() if isinstance(v, dict)),
                                      key=lambda v: v["layer_us"])["config"]
                    table["best"] = best_config
                    for kind, ws in weights.items():
                        for split in (2, 4, 8):
                            us = kernel_us(ws, rows, best_config._replace(split_k=split), device)
                            table[f"best, {kind}, split {split}"] = us
            del weights
            torch.cuda.empty_cache()
        for rows in (1, 16):
            for kind, shape in shapes.items():
                report.setdefault(f"{model} baselines rows={rows}", {})[kind] = baselines(shape, rows, device, gen)
        log(f"{model} baselines done")
    return report


QUICK = {  # (block_n, block_k, num_warps) of the elementwise program, per bits
    4: [(16, 512, 4), (8, 512, 4), (8, 1024, 4), (16, 1024, 4), (32, 512, 8), (16, 256, 4), (8, 512, 2)],
    8: [(16, 256, 4), (8, 256, 4), (8, 512, 4), (16, 512, 4), (32, 256, 8), (16, 128, 4), (8, 256, 2)],
}


def quick(device: torch.device) -> dict[str, Any]:
    """The llama-3-8b shapes at one row (elementwise tiles, split targets), two and four rows,
    against bf16 and torch's int4 / earlier int8 paths."""
    qk = kernel_module()
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = SHAPES["llama-3-8b"]
    report: dict[str, Any] = {"baselines": {kind: baselines(shape, 1, device, gen) for kind, shape in shapes.items()}}
    for fmt in ("int4-g128", "int8"):
        bits = QuantConfig.parse(fmt).bits
        weights = {kind: [random_kernel_weight(shape, fmt, device, gen)
                          for _ in range(copies_for(shape[0] * shape[1] * bits // 8))]
                   for kind, shape in shapes.items()}
        for block_n, block_k, warps in QUICK[bits]:
            for per_sm in (2, 4, 8):
                base = qk.Config(block_n, block_k, 1, warps, 1, False)
                times = {kind: kernel_us(ws, 1, qk.with_split(base, 1, *shapes[kind], processors, per_sm), device)
                         for kind, ws in weights.items()}
                key = f"{fmt} rows=1 {tuple(base)} programs/SM {per_sm}"
                total = sum(t for t in times.values() if isinstance(t, float))
                report[key] = {"us": times, "layer_us": total}
                log(f"{key}: layer {total:.1f} us " + " ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in times.items()))
        for rows in (2, 4):
            for name, config in (("elementwise", qk.Config(16, 512 if bits == 4 else 256, 1, 4, 1, False)),
                                 ("dot", qk.Config(64, 512 if bits == 4 else 256, 1, 4, 3, True))):
                times = {kind: kernel_us(ws, rows, qk.with_split(config, rows, *shapes[kind], processors), device)
                         for kind, ws in weights.items()}
                key = f"{fmt} rows={rows} {name}"
                report[key] = {"us": times, "layer_us": sum(t for t in times.values() if isinstance(t, float))}
                log(f"{key}: layer {report[key]['layer_us']:.1f} us")
        del weights
        torch.cuda.empty_cache()
    return report


MODES = {  # how a program's loop gets its words in flight: (num_stages, tma)
    "pipelined 3": (3, False), "pipelined 4": (4, False), "TMA 3": (3, True), "TMA 4": (4, True),
}
CANDIDATE_TILES = {  # (block_n, block_k, num_warps) per (bits, dot)
    (4, False): [(16, 512, 4), (32, 512, 4), (16, 1024, 4), (8, 512, 2)],
    (8, False): [(16, 256, 4), (32, 256, 4), (16, 512, 4), (8, 256, 2)],
    (4, True): [(64, 512, 4), (32, 512, 4), (64, 256, 4), (32, 256, 4)],
    (8, True): [(32, 128, 4), (64, 128, 4), (64, 256, 4), (32, 256, 4)],
}
CANDIDATE_ROWS = {4: (1, 2, 16), 8: (1, 16)}


def candidate_configs(bits: int, rows: int, processors: int, shape: tuple[int, int],
                      per_sm: int = 4) -> dict[str, Any]:
    """Every candidate program for a product: the elementwise one up to its rows, the matrix
    units from two rows, each tile in each mode, split K as ``with_split`` picks it."""
    qk = kernel_module()
    out_f, n = shape
    found = {}
    kinds = [False] if rows == 1 else [True] if rows > qk.ELEMENTWISE_ROWS[4] or bits == 8 else [False, True]
    for dot in kinds:
        for block_n, block_k, warps in CANDIDATE_TILES[bits, dot]:
            for mode, (stages, tma) in MODES.items():
                config = qk.Config(block_n, block_k, 1, warps, stages, dot, tma)
                name = f"{'dot' if dot else 'elementwise'} {block_n}x{block_k} w{warps} {mode}"
                found[name] = qk.with_split(config, rows, out_f, n, processors, per_sm)
    return found


def warm_jobs(jobs: list[tuple[tuple[int, int], str, int, Any]]) -> int:
    """Compile each (shape, format, rows, config) once (a worker: Triton's disk cache is shared)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    done = 0
    for shape, fmt, rows, config in jobs:
        w = random_kernel_weight(shape, fmt, torch.device("cuda"), gen)
        x = torch.randn((rows, shape[1]), device="cuda", dtype=torch.bfloat16)
        xg, xsum = layers.kernel_inputs(x, w.bits, w.group_size)
        try:
            kernel_module().quant_matmul(xg, xsum, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero,
                                         torch.bfloat16, config)
            done += 1
        except Exception as exc:  # noqa: BLE001 - the timing pass records the failure
            log(f"compile failed {shape} {fmt} rows={rows} {tuple(config)}: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()
    return done


def warm(pool: Any, jobs: list, workers: int) -> None:
    """Compile the jobs in the pool's processes, spread evenly."""
    t0 = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    done = sum(pool.map(warm_jobs, chunks))
    log(f"compiled {done}/{len(jobs)} kernels in {time.perf_counter() - t0:.0f} s")


def candidate_jobs(processors: int) -> list[tuple[tuple[int, int], str, int, Any]]:
    """(shape, format, rows, config) of every candidate the sweep times."""
    jobs = []
    for shapes in SHAPES.values():
        for fmt in ("int4-g128", "int8"):
            bits = QuantConfig.parse(fmt).bits
            for shape in shapes.values():
                for rows in CANDIDATE_ROWS[bits]:
                    for config in candidate_configs(bits, rows, processors, shape).values():
                        jobs.append((shape, fmt, rows, config))
    return jobs


def candidates(device: torch.device, pool: Any, workers: int, budget_s: float, start: float) -> dict[str, Any]:
    """Each candidate program on every product of the 8B and 1B shapes at 1, 2 and 16 rows
    (µs per product, CUDA-graph replays over copies no cache holds, median of 20), the
    current choice and bf16 / tinygemm beside them; then split K around the best one-row
    programs. The candidates are compiled beforehand (``candidate_jobs``, ``warm``)."""
    qk = kernel_module()
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    report: dict[str, Any] = {}
    for model, shapes in SHAPES.items():
        for fmt in ("int4-g128", "int8"):
            bits = QuantConfig.parse(fmt).bits
            weights = rotated_weights(shapes, fmt, device, gen)
            for rows in CANDIDATE_ROWS[bits]:
                if time.perf_counter() - start > budget_s:
                    log(f"skipped {model} {fmt} rows={rows}: past the budget")
                    continue
                table: dict[str, Any] = {}
                for kind, ws in weights.items():
                    shape = shapes[kind]
                    configs = {"current": qk.pick_config(rows, *shape, bits, processors),
                               **candidate_configs(bits, rows, processors, shape)}
                    for name, config in configs.items():
                        us = kernel_us(ws, rows, config, device)
                        table.setdefault(name, {"us": {}, "split_k": {}})["us"][kind] = us
                        table[name]["split_k"][kind] = config.split_k
                for entry in table.values():
                    times = entry["us"].values()
                    entry["layer_us"] = sum(times) if all(isinstance(t, float) for t in times) else None
                ranked = sorted((v["layer_us"], k) for k, v in table.items() if v["layer_us"])
                best_each = {kind: min((v["us"][kind], k) for k, v in table.items()
                                       if isinstance(v["us"][kind], float)) for kind in shapes}
                key = f"{model} {fmt} rows={rows}"
                report[key] = {"configs": table, "ranked": ranked[:10], "best_per_matrix": best_each}
                log(f"{key}: current {table['current']['layer_us']:.1f} us a layer; best "
                    + "; ".join(f"{k} {t:.1f}" for t, k in ranked[:3]) + " | per matrix "
                    + ", ".join(f"{kind} {t:.1f} ({k})" for kind, (t, k) in best_each.items()))
            # split K around the best one-row program (a second warm-up for the new splits)
            best = report.get(f"{model} {fmt} rows=1", {}).get("ranked", [])[:2]
            split_jobs, split_configs = [], {}
            for _, name in best:
                for per_sm in (1, 2, 8, 16):
                    for kind, shape in shapes.items():
                        config = candidate_configs(bits, 1, processors, shape, per_sm)[name]
                        split_configs[name, per_sm, kind] = config
                        split_jobs.append((shape, fmt, 1, config))
            if split_jobs and time.perf_counter() - start < budget_s:
                warm(pool, split_jobs, workers)
                splits: dict[str, Any] = {}
                for (name, per_sm, kind), config in split_configs.items():
                    entry = splits.setdefault(f"{name}, {per_sm} programs/SM", {"us": {}, "split_k": {}})
                    entry["us"][kind] = kernel_us(weights[kind], 1, config, device)
                    entry["split_k"][kind] = config.split_k
                report[f"{model} {fmt} rows=1 splits"] = splits
                for name, entry in splits.items():
                    log(f"  {model} {fmt} {name}: " + " ".join(
                        f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in entry["us"].items()))
            del weights
            torch.cuda.empty_cache()
        for rows in (1, 2, 16):
            for kind, shape in shapes.items():
                result = baselines(shape, rows, device, gen, compiled_int8=False)
                report.setdefault(f"{model} baselines rows={rows}", {})[kind] = result
            log(f"{model} baselines rows={rows}: " + ", ".join(
                f"{kind} bf16 {v['bf16']['us']:.1f} tinygemm {v['torch int4-g128']['us']:.1f}"
                for kind, v in report[f"{model} baselines rows={rows}"].items()))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile too")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop sweeping after this long")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_quant_kernels.json)")
    parser.add_argument("--quick", action="store_true", help="only the elementwise tiles at one and two rows")
    parser.add_argument("--check-only", action="store_true", help="the checks, no timings")
    parser.add_argument("--candidates", action="store_true",
                        help="the checks, then every candidate program (tiles x loop modes) per product")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1),
                        help="processes that compile kernels and run the checks")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device("cuda")
    path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "gpu_quant_kernels.json"))
    report: dict[str, Any] = {"environment": environment(device),
                              "bandwidth_GBps": copy_bandwidth(device, 2**31)}
    log(f"{report['environment'].get('card')}: copy {report['bandwidth_GBps']:.0f} GB/s")
    if args.quick:
        report["quick"] = quick(device)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        return 0
    with torch.multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        pending = pool.map_async(check_format, CHECK_FORMATS)
        if args.candidates:  # compiled while the checks run, timed after them
            warm(pool, candidate_jobs(report["environment"]["multiprocessors"]), args.workers)
        try:
            report["check"] = check(device, pending.get())
        except Exception as exc:  # noqa: BLE001 - the speed half still runs and the error is kept
            report["check"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"check FAILED: {type(exc).__name__}: {exc}")
        log(f"checks done at {time.perf_counter() - start:.0f} s")
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        if args.candidates:
            report["candidates"] = candidates(device, pool, args.workers, args.budget_s, start)
        elif not args.check_only:
            report["speed"] = speed(device, args.sweep, args.budget_s, start)
    report["seconds"] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"check {report['check'].get('passed')}/{report['check'].get('total')} "
          f"worst {report['check'].get('worst_rel_error')}; {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
