"""The batch-1 products with int8 / int4 weights on a CUDA GPU, fused and unfused: correctness, then speed.

    PYTHONPATH=. python scripts/gpu_quant_fused.py              # JSON to $OUT/gpu_quant_fused.json
    PYTHONPATH=. python scripts/gpu_quant_fused.py --no-tiles   # each product at its default tiles only
    PYTHONPATH=. python scripts/gpu_quant_fused.py --parts layer --shapes llama-3-8b   # one part

(a) correctness: for every format, torch_triton_gemv's layer functions handed quantized weights
    (``torch_quant_gemv``) against torch_layers' functions with the same weights (the unfused
    products: the glue, ``kernel_inputs``, then the operator) and against torch_layers' functions
    in float32 holding the dequantized weights; bf16 inputs, 1 and 3 rows, outputs allocated
    over NaN-filled memory, each fused call run twice and required to repeat bit for bit, the
    residual sums required to equal torch's.
(b) one layer of each --shapes at one row, its glue included (attention excluded): the compiled
    torch_layers functions (glue kernels, then the unfused products) against the fused functions,
    every copy of the layer's weights in turn from one CUDA graph (enough copies that L2 holds
    none; the fused kernels launched as in the runner, each overlapping the previous one's tail);
    (c) each product of those shapes and the LM head alone, unfused (``torch_quant_kernel``, its
    float32 inputs prepared beforehand) and fused (with its prologue and epilogue), at the
    default tiles and others (``--no-tiles`` skips them). µs, and GB/s of the bytes the weights
    store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import copy_bandwidth, environment, graph_us_per_call, log  # noqa: E402
from gpu_quant_kernels import copies_for, fresh_output_memory, nbytes, random_kernel_weight  # noqa: E402

from tinyinfer.quant import QuantConfig, dequantize, quantize  # noqa: E402
from tinyinfer.runners import torch_layers as L  # noqa: E402
from tinyinfer.runners import triton_env  # noqa: E402

PRODUCT_FORMATS = ("int4-g128", "int8")  # the formats the layer and product timings run
CHECK_FORMATS = ("int8", "int8-g32", "int4-g128", "int4-g32", "int4-g64-asym", "int4-g32-min")
SHAPES = {  # one layer's products and the LM head, [out, in]
    "llama-3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                   "head": (128256, 4096)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "head": (128256, 2048)},
}
LAYER = ("qkv", "o", "gate_up", "down")
TILES = {  # (block_n, block_k, num_warps, num_stages) of a one-row product beside its default, per (fused, bits)
    (False, 4): [(16, 512, 2, 3), (32, 512, 2, 3), (8, 1024, 2, 3), (8, 512, 2, 4), (8, 512, 4, 3),
                 (16, 1024, 2, 3), (8, 256, 2, 4)],
    (False, 8): [(8, 256, 2, 4), (16, 512, 2, 4)],
    (True, 4): [(16, 512, 2, 3), (32, 512, 2, 3), (32, 1024, 2, 3), (64, 256, 4, 4), (8, 512, 2, 3),
                (8, 1024, 2, 3), (8, 1024, 2, 4), (16, 1024, 2, 3), (16, 512, 4, 3), (16, 256, 2, 4),
                (32, 256, 4, 4), (64, 256, 4, 3)],
    (True, 8): [(16, 512, 2, 4), (16, 256, 2, 4), (32, 256, 2, 4), (32, 512, 2, 4), (8, 512, 2, 4), (8, 1024, 2, 4),
                (16, 512, 2, 3), (16, 512, 2, 6), (16, 512, 4, 4), (16, 1024, 2, 3), (16, 1024, 4, 4),
                (32, 512, 4, 4), (16, 256, 2, 6)],
}
NORMED = ("qkv", "gate_up", "head")  # the products with a norm in their prologue (whole rows: no split K)
EPS = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check_format(fmt: str) -> dict[str, Any]:
    """One format's layer functions (a worker process: the formats compile in parallel)."""
    from tinyinfer.runners import torch_triton_gemv as G

    device = torch.device("cuda")
    rng = np.random.default_rng(CHECK_FORMATS.index(fmt))
    d, f, qkv_out, vocab = 2048, 8448, 3072, 32000  # f past LONG_ROWS: the down product's long-row tiles
    shapes = {"qkv": (qkv_out, d), "o": (d, d), "up": (2 * f, d), "down": (d, f), "head": (vocab, d)}
    q, w = {}, {}
    for name, shape in shapes.items():
        qw = quantize((rng.standard_normal(shape) * 0.02).astype(np.float32), QuantConfig.parse(fmt))
        q[name] = L.device_weight(qw, device, torch.bfloat16, kernel="triton")
        assert isinstance(q[name], L.KernelWeight), type(q[name])
        w[name] = torch.from_numpy(dequantize(qw)).to(device)
    out: dict[str, Any] = {}
    for rows in (1, 3):
        x, r, attn = (torch.randn((rows, d), device=device).to(torch.bfloat16) for _ in range(3))
        norm = (1 + 0.1 * torch.randn(d, device=device)).to(torch.bfloat16)
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.float()

        def fused(x=x, r=r, attn=attn, norm=norm) -> tuple[torch.Tensor, ...]:
            fresh_output_memory(device)
            total, qkv = G.attention_input(x, r, norm, None, q["qkv"], None, EPS)
            x2, mlp = G.mlp_block(x, attn, q["o"], None, norm, None, q["up"], None, q["down"], None, EPS, True)
            logits = G.final_logits(x, r, norm, None, q["head"], EPS)
            return total, qkv, x2, mlp, logits

        got, again = fused(), fused()
        unfused_total, unfused_qkv = L.attention_input(x, r, norm, None, q["qkv"], None, EPS)
        unfused_x, unfused_mlp = L.mlp_block(x, attn, q["o"], None, norm, None, q["up"], None, q["down"], None,
                                             EPS, True)
        unfused_logits = L.final_logits(x, r, norm, None, q["head"], EPS)
        _, ref_qkv = L.attention_input(f32(x), f32(r), f32(norm), None, w["qkv"], None, EPS)
        ref_x, ref_mlp = L.mlp_block(f32(x), f32(attn), w["o"], None, f32(norm), None, w["up"], None, w["down"],
                                     None, EPS, True)
        ref_logits = L.final_logits(f32(x), f32(r), f32(norm), None, w["head"], EPS)
        case = {
            "sum_equal": bool(torch.equal(got[0], unfused_total)),
            "repeatable": all(bool(torch.equal(a, b)) for a, b in zip(got, again)),
            "vs_unfused": {"qkv": rel(got[1], unfused_qkv), "x": rel(got[2], unfused_x),
                           "mlp": rel(got[3], unfused_mlp), "logits": rel(got[4], unfused_logits)},
            "vs_dequantized_float32": {"qkv": rel(got[1], ref_qkv), "x": rel(got[2], ref_x),
                                       "mlp": rel(got[3], ref_mlp), "logits": rel(got[4], ref_logits)},
            "unfused_vs_dequantized_float32": {"qkv": rel(unfused_qkv, ref_qkv), "mlp": rel(unfused_mlp, ref_mlp),
                                               "logits": rel(unfused_logits, ref_logits)},
        }
        worst = max(case["vs_dequantized_float32"].values())
        case["ok"] = bool(case["sum_equal"] and case["repeatable"] and worst < 2e-2 and np.isfinite(worst))
        out[f"{fmt} rows={rows}"] = case
    return out


def layer_weights(fmt: str, shape: str, device: torch.device,
                  gen: torch.Generator) -> list[dict[str, L.KernelWeight]]:
    """Copies of one layer's weights in the kernels' layout, enough that L2 holds none."""
    bits = QuantConfig.parse(fmt).bits
    products = {kind: SHAPES[shape][kind] for kind in LAYER}
    one = sum(o * i for o, i in products.values()) * bits // 8
    return [{kind: random_kernel_weight(size, fmt, device, gen) for kind, size in products.items()}
            for _ in range(copies_for(one))]


def layer_timings(device: torch.device, gen: torch.Generator, formats: list[str], shapes: list[str]) -> dict[str, Any]:
    """One layer of each shape at one row: the compiled unfused functions against the fused ones."""
    from tinyinfer.runners import torch_triton_gemv as G

    compiled = (torch.compile(L.attention_input), torch.compile(L.mlp_block))
    report: dict[str, Any] = {}
    for shape in shapes:
        d = SHAPES[shape]["qkv"][1]
        x, r, attn = (torch.randn((1, d), device=device, dtype=torch.bfloat16) for _ in range(3))
        norm = torch.ones(d, device=device, dtype=torch.bfloat16)
        for fmt in formats:
            layers = layer_weights(fmt, shape, device, gen)
            stored = sum(nbytes(w) for w in layers[0].values())
            for name, (attention_input, mlp_block) in (("unfused, compiled", compiled),
                                                       ("fused", (G.attention_input, G.mlp_block))):
                def call(i: int, attention_input=attention_input, mlp_block=mlp_block, layers=layers) -> None:
                    w = layers[i]
                    total, _ = attention_input(x, r, norm, None, w["qkv"], None, EPS)
                    mlp_block(total, attn, w["o"], None, norm, None, w["gate_up"], None, w["down"], None, EPS, True)

                try:
                    us = graph_us_per_call(call, len(layers), device)
                except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                    report[f"{shape} {fmt} {name}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    log(f"layer {shape} {fmt} {name} FAILED: {exc}")
                    continue
                report[f"{shape} {fmt} {name}"] = {"us": us, "bytes": stored, "GBps": stored / us / 1e3}
                log(f"layer {shape} {fmt} {name}: {us:.1f} us, {stored / us / 1e3:.0f} GB/s of {stored / 1e6:.1f} MB")
            del layers
            torch.cuda.empty_cache()
    return report


def product_call(kind: str, x: torch.Tensor, r: torch.Tensor, norm: torch.Tensor, weights: list, config: Any,
                 fused: bool = True):
    """A fused product of one kind, with the prologue and epilogue the layer functions give it; or
    (``fused`` off) the unfused product alone, its float32 inputs prepared beforehand."""
    from tinyinfer.runners import torch_quant_gemv as Q
    from tinyinfer.runners import torch_quant_kernel as qk

    if not fused:
        w0 = weights[0]
        xg, xsum = L.kernel_inputs(x, w0.bits, w0.group_size)
        return lambda i: qk.quant_matmul(xg, xsum, weights[i].words, weights[i].scales, weights[i].offsets,
                                         w0.bits, w0.group_size, w0.zero, torch.bfloat16, config)
    total = torch.empty_like(x)
    if kind in ("qkv", "head"):
        return lambda i: Q.fused_gemv(x, weights[i], norm=norm, residual=r, sum_out=total, eps=EPS, config=config,
                                      out_dtype=torch.float32 if kind == "head" else None)
    if kind == "o":
        return lambda i: Q.fused_gemv(x, weights[i], add=r, config=config)
    if kind == "gate_up":
        return lambda i: Q.fused_gemv(x, weights[i], norm=norm, eps=EPS, gated=True, config=config)
    return lambda i: Q.fused_gemv(x, weights[i], config=config)


def product_configs(fmt: str, shape: tuple[int, int], kind: str, device: torch.device, tiles: bool,
                    fused: bool) -> dict[str, Any]:
    """The default tiles of one product, then the others (K split while tiles leave
    multiprocessors idle, but never under a norm in a fused product)."""
    from tinyinfer.runners import torch_quant_gemv as Q
    from tinyinfer.runners import torch_quant_kernel as qk

    processors, tma = qk.device_traits(device)  # the words of these shapes fit tensor descriptors
    bits = QuantConfig.parse(fmt).bits
    out_f, k = shape
    n = out_f // 2 if kind == "gate_up" and fused else out_f
    whole = fused and kind in NORMED
    if fused:
        configs: dict[str, Any] = {"default": Q.pick_config(n, k, bits, processors, tma, norm=whole,
                                                                gated=kind == "gate_up")}
    else:
        configs = {"default": qk.pick_config(1, n, k, bits, processors, tma)}
    if tiles:
        for block_n, block_k, warps, stages in TILES[fused, bits]:
            base = qk.Config(block_n, block_k, num_warps=warps, num_stages=stages, tma=tma)
            configs[f"{block_n}x{block_k} w{warps} s{stages}"] = (
                base if whole else qk.with_split(base, 1, n, k, processors, 1))
    return configs


def product_inputs(kind: str, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    x = torch.randn((1, k), device=device, dtype=torch.bfloat16)
    r = torch.randn((1, n if kind == "o" else k), device=device, dtype=torch.bfloat16)
    return x, r, torch.ones(k, device=device, dtype=torch.bfloat16)


def product_jobs(formats: list[str], shapes: list[str], tiles: bool,
                 device: torch.device) -> list[tuple[str, str, str, bool, Any]]:
    """Every (format, shape, kind, fused, tiles) the product timings run."""
    return [(fmt, shape, kind, fused, config) for fmt in formats for shape in shapes
            for kind, size in SHAPES[shape].items() for fused in (False, True)
            for config in product_configs(fmt, size, kind, device, tiles, fused).values()]


def warm_products(jobs: list[tuple[str, str, str, bool, Any]]) -> int:
    """Compile each job's kernel once (a worker: Triton's disk cache is shared)."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    done = 0
    for fmt, shape, kind, fused, config in jobs:
        out_f, k = SHAPES[shape][kind]
        n = out_f // 2 if kind == "gate_up" else out_f
        try:
            product_call(kind, *product_inputs(kind, k, n, device),
                         [random_kernel_weight((out_f, k), fmt, device, gen)], config, fused)(0)
            done += 1
        except Exception as exc:  # noqa: BLE001 - the timing pass records the failure
            log(f"compile failed {fmt} {shape} {kind} fused={fused} {tuple(config)}: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()
    return done


def tile_timings(device: torch.device, gen: torch.Generator, formats: list[str], shapes: list[str],
                 tiles: bool) -> dict[str, Any]:
    """Each product of the shapes alone, unfused and fused: the default tiles, then others."""
    report: dict[str, Any] = {}
    for fmt in formats:
        bits = QuantConfig.parse(fmt).bits
        for shape in shapes:
            for kind, size in SHAPES[shape].items():
                out_f, k = size
                n = out_f // 2 if kind == "gate_up" else out_f
                ws = [random_kernel_weight(size, fmt, device, gen) for _ in range(copies_for(out_f * k * bits // 8))]
                x, r, norm = product_inputs(kind, k, n, device)
                for fused in (False, True):
                    row: dict[str, Any] = {"shape": list(size), "bytes": nbytes(ws[0])}
                    for name, config in product_configs(fmt, size, kind, device, tiles, fused).items():
                        try:
                            us = graph_us_per_call(product_call(kind, x, r, norm, ws, config, fused), len(ws), device)
                            row[name] = {"us": us, "GBps": nbytes(ws[0]) / us / 1e3, "config": list(config)}
                        except Exception as exc:  # noqa: BLE001 - a tile that fails is recorded, the rest run
                            row[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                    best = min(((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v),
                               default=None)
                    row["best"] = best
                    key = f"{fmt} {shape} {kind} {'fused' if fused else 'unfused'}"
                    report[key] = row
                    log(f"{key} {size}: " + ", ".join(
                        f"{name} {v['us']:.1f}" if "us" in v else f"{name} {v.get('error', '')[:60]}"
                        for name, v in row.items() if isinstance(v, dict)) + f"; best {best}")
                del ws
                torch.cuda.empty_cache()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_quant_fused.json)")
    parser.add_argument("--parts", nargs="+", default=["check", "layer", "products"],
                        choices=["check", "layer", "products"], help="what to run (default: all)")
    parser.add_argument("--shapes", nargs="+", default=["llama-3-8b", "llama-3.2-1b"], choices=list(SHAPES))
    parser.add_argument("--no-tiles", action="store_true", help="time each product at its default tiles only")
    parser.add_argument("--formats", nargs="+", default=list(PRODUCT_FORMATS), choices=PRODUCT_FORMATS,
                        help="the layer and product timings' formats (default: both)")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes that run the checks (a format each) and compile the timed kernels")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device("cuda")
    path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "gpu_quant_fused.json"))
    report: dict[str, Any] = {"environment": environment(device), "command": " ".join(sys.argv),
                              "bandwidth_GBps": copy_bandwidth(device, 2**31)}
    log(f"{report['environment'].get('card')}: copy {report['bandwidth_GBps']:.0f} GB/s")
    jobs = product_jobs(args.formats, args.shapes, not args.no_tiles, device) if "products" in args.parts else []
    with torch.multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        # the checks run while the timed kernels compile
        pending = pool.map_async(check_format, CHECK_FORMATS if "check" in args.parts else ())
        warmed = pool.map_async(warm_products, [jobs[i::args.workers] for i in range(args.workers)])
        try:
            report["check"] = {k: v for part in pending.get() for k, v in part.items()}
        except Exception as exc:  # noqa: BLE001 - recorded; the timings still run
            report["check"] = {"error": f"{type(exc).__name__}: {exc}"}
        checks = report["check"]
        passed = sum(c.get("ok", False) for c in checks.values() if isinstance(c, dict))
        log(f"check: {passed}/{len(checks)} ok " + json.dumps(checks, default=str)[:3000])
        log(f"compiled {sum(warmed.get())}/{len(jobs)} products at {time.perf_counter() - start:.0f} s")
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    gen = torch.Generator(device=device).manual_seed(0)
    if "layer" in args.parts:
        try:
            report["layer"] = layer_timings(device, gen, args.formats, args.shapes)
        except Exception as exc:  # noqa: BLE001 - recorded; the product timings still run
            report["layer"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"layer timings FAILED: {type(exc).__name__}: {exc}")
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if "products" in args.parts:
        report["products"] = tile_timings(device, gen, args.formats, args.shapes, not args.no_tiles)
    report["seconds"] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({"layer": report.get("layer"), "check_passed": f"{passed}/{len(checks)}",
                      "best": {k: v.get("best") for k, v in report.get("products", {}).items()}},
                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    # kernels timed alone launch as a runner's steps launch them (programmatic dependent launch
    # where the card has it); each runner built here applies its own pdl option inside
    with triton_env.dependent_launch(True):
        sys.exit(main())
