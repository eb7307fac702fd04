"""Quantized products with many rows on a CUDA GPU: dequantize-then-cuBLAS against the kernels.

    PYTHONPATH=. python scripts/gpu_quant_prefill.py --out $OUT      # JSON to $OUT/gpu_quant_prefill.json

(a) correctness: the dequantize kernels against the reference's ``dequantize`` (words: every
    format bit for bit in float32; torch's tiled int4: the map of its tiles, bit for bit against
    (nibble - 8) * scale + zero from the stored nibbles and the kernel's bf16 scales), the
    products (one buffer chunk and several) against the float64 product, under
    ``torch.compile`` and a CUDA graph, and a small Llama's prefill through the runner against
    the float64 reference.
(b) speed: each product of one layer of the llama-3-8b and llama-3.2-1b shapes (and the 8B LM
    head) at 16..512 rows: bf16 (cuBLAS), the quantized kernels, and dequantize + cuBLAS; CUDA-graph
    replays over copies of the weight that L2 cannot hold, median of 20.
(c) torch's int4 kernel against dequantizing its layout + cuBLAS at 128 and 512 rows (8B shapes).
(d) a 128-token prefill of the 8B shape through the runner, bf16 / int8 / int4-g128 with the head
    quantized: wall and CUDA time, and the kernels that take it (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import environment, graph_us_per_call, log  # noqa: E402
from gpu_quant_kernels import SHAPES, copies_for, graphed_linear, kernel_us, random_kernel_weight  # noqa: E402

from tinyinfer.quant import QuantConfig, dequantize, quantize  # noqa: E402
from tinyinfer.runners import torch_layers as layers  # noqa: E402

WORD_FORMATS = ("int8", "int8-g32", "int8-g128", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym",
                "int4-g128-asym", "int4-g32-min", "int4-g64-min")
PACK_FORMATS = ("int4-g32", "int4-g64", "int4-g128", "int4-g128-asym", "int4-g32-min")
ROWS = (16, 32, 64, 128, 256, 512)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def check(device: torch.device) -> dict[str, Any]:
    from tinyinfer.runners import torch_quant_prefill as qp

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}

    def record(key: str, err: float, limit: float, exact: bool | None = None) -> None:
        ok = math.isfinite(err) and err < limit and exact is not False
        out[key] = {"rel_error": err, "bit_exact": exact, "ok": ok}
        if not ok:
            log(f"FAILED {key}: {err:.2e} exact={exact}")

    for fmt in WORD_FORMATS:
        for shape in ((4104, 1024), (300, 2048)):
            qw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, QuantConfig.parse(fmt))
            w = layers.device_weight(qw, device, torch.bfloat16, kernel="triton")
            ref_w = torch.from_numpy(dequantize(qw)).to(device)
            buf = torch.full(shape, float("nan"), device=device)
            qp.dequantize_words_into(buf, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero)
            exact = bool(torch.equal(buf, ref_w))
            for rows in (layers.DEQUANT_ROWS, layers.DEQUANT_ROWS + 45):
                x = torch.randn((rows, shape[1]), device=device, dtype=torch.bfloat16)
                record(f"words {fmt} {shape} rows={rows}", rel(layers.linear(x, w, None), x.double() @ ref_w.double().T),
                       1e-2, exact)
    out.update(check_pack(device, rng, record))
    for fmt in ("int8", "int4-g128"):  # more rows than one buffer chunk holds
        shape = (17000, 4096)
        qw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, QuantConfig.parse(fmt))
        w = layers.device_weight(qw, device, torch.bfloat16, kernel="auto")
        x = torch.randn((layers.DEQUANT_ROWS + 6, shape[1]), device=device, dtype=torch.bfloat16)
        ref_w = torch.from_numpy(dequantize(qw)).to(device).double()
        record(f"chunked {fmt} {type(w).__name__} {shape} rows={x.shape[0]}", rel(layers.linear(x, w, None), x.double() @ ref_w.T),
               1e-2)
        del ref_w
    for fmt, kernel in (("int8", "auto"), ("int4-g128", "auto"), ("int4-g64-asym", "triton")):
        qw = quantize(rng.standard_normal((512, 1024)).astype(np.float32), QuantConfig.parse(fmt))
        w = layers.device_weight(qw, device, torch.bfloat16, kernel=kernel)
        x = torch.randn((layers.DEQUANT_ROWS + 32, 1024), device=device, dtype=torch.bfloat16)
        graph, y = graphed_linear(x, w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = x.double() @ torch.from_numpy(dequantize(qw)).to(device).double().T
        record(f"compiled + CUDA graph {fmt} {kernel} rows={x.shape[0]}", rel(y, ref), 1e-2)
    out.update(check_runner(device))
    passed = sum(v["ok"] for v in out.values())
    log(f"check: {passed}/{len(out)} ok")
    return {"cases": out, "passed": passed, "total": len(out)}


def check_pack(device: torch.device, rng: np.random.Generator, record) -> dict[str, Any]:
    """torch's tiled int4, dequantized through the tile map: bit for bit (nibble - 8) * scale + zero,
    and the product against float64 and against torch's own kernel."""
    from tinyinfer.runners import torch_quant_prefill as qp

    out: dict[str, Any] = {}
    for fmt in PACK_FORMATS:
        for shape in ((4104, 1024), (256, 96), (512, 192)):
            qw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.05, QuantConfig.parse(fmt))
            w = layers.device_weight(qw, device, torch.bfloat16, kernel="auto")
            if not isinstance(w, layers.Int4Weight):  # a ragged last group: torch's kernel does not take it
                continue
            if w.tile_map is None:
                out[f"int4pack {fmt} {shape}"] = {"ok": False, "error": "no tile map"}
                continue
            buf = torch.full(shape, float("nan"), device=device)
            qp.dequantize_int4pack_into(buf, w.packed, w.scales_and_zeros, w.group_size, w.tile_map)
            nib = torch.from_numpy(np.stack([qw.data & 0xF, qw.data >> 4], -1).reshape(shape[0], -1)[:, :shape[1]]
                                   .astype(np.float32)).to(device)
            g = torch.arange(shape[1], device=device) // w.group_size
            sz = w.scales_and_zeros.float()  # [groups, out, 2]
            want = (nib - 8) * sz[g, :, 0].T + sz[g, :, 1].T
            ref_w = torch.from_numpy(dequantize(qw)).to(device).double()
            x = torch.randn((layers.INT4PACK_DEQUANT_ROWS + 72, shape[1]), device=device, dtype=torch.bfloat16)
            tiny = torch._weight_int4pack_mm(x, w.packed, w.group_size, w.scales_and_zeros)
            got = layers.linear(x, w, None)
            record(f"int4pack {fmt} {shape} rows={x.shape[0]} vs float64", rel(got, x.double() @ ref_w.T), 1e-2,
                   bool(torch.equal(buf, want)))
            record(f"int4pack {fmt} {shape} rows={x.shape[0]} vs tinygemm", rel(got, tiny.double()), 1e-2)
    return out


def check_runner(device: torch.device) -> dict[str, Any]:
    """A small Llama's prefill past DEQUANT_ROWS and decode steps through the runner against the float64 reference."""
    from tinyinfer.config import config_from_dict
    from tinyinfer.quant import quantize_weights
    from tinyinfer.runners.numpy_ref import NumpyRunner
    from tinyinfer.runners.runner import make_batch
    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.runners.torch_weights import random_weights

    config = config_from_dict({"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
                               "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "max_position_embeddings": 512})
    floats = {k: v.numpy() for k, v in random_weights(config, device="cpu", dtype="float32", std=0.3 / 16).items()}
    out = {}
    for fmt in ("int8+head", "int4-g128+head", "int4-g32-asym"):
        weights = quantize_weights(floats, QuantConfig.parse(fmt))
        ref_runner = NumpyRunner(config, weights, dtype="float64")
        fast = TorchRunner(config, weights, device="cuda", quant_kernel="auto")
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, 500, layers.DEQUANT_ROWS + 12)]
        pages = list(range(-(-(len(prompt) + 3) // 16)))
        kv_ref, kv_fast = ref_runner.new_kv_cache(len(pages) + 1, 16), fast.new_kv_cache(len(pages) + 1, 16)
        steps = [make_batch([(prompt, 0, pages, True)], 16)] + [
            make_batch([([7 + i], len(prompt) + i, pages, False)], 16) for i in range(3)]
        worst = 0.0
        for batch in steps:
            ref, ours = ref_runner.forward(batch, kv_ref), fast.forward(batch, kv_fast)
            worst = max(worst, float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)))
        out[f"runner {fmt} prefill {len(prompt)} + decode"] = {"rel_error": worst, "ok": worst < 3e-2}
        log(f"runner {fmt}: {worst:.2e}")
    return out


def speed(device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    report: dict[str, Any] = {}
    shapes = {**{f"llama-3-8b {k}": v for k, v in SHAPES["llama-3-8b"].items()}, "llama-3-8b head": (128256, 4096),
              **{f"llama-3.2-1b {k}": v for k, v in SHAPES["llama-3.2-1b"].items()}}
    for name, shape in shapes.items():
        report.update(time_shape(name, shape, device, gen))
        torch.cuda.empty_cache()
    return report


def time_shape(name: str, shape: tuple[int, int], device: torch.device, gen: torch.Generator) -> dict[str, Any]:
    """One product at each number of rows, every way."""
    from tinyinfer.runners import torch_quant_prefill as qp

    out_f, n = shape
    bf16 = [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(copies_for(out_f * n * 2))]
    int8 = [random_kernel_weight(shape, "int8", device, gen) for _ in range(copies_for(out_f * n))]
    int4 = [random_kernel_weight(shape, "int4-g128", device, gen) for _ in range(copies_for(out_f * n // 2))]
    packed = torch._convert_weight_to_int4pack(
        torch.randint(0, 256, (out_f, n // 2), generator=gen, device=device, dtype=torch.uint8), 8)
    tile_map = qp.int4pack_tile_map(device, 8)
    tiny = [(packed.clone(), (torch.rand((n // 128, out_f, 2), generator=gen, device=device) * 1e-2)
             .to(torch.bfloat16)) for _ in range(copies_for(out_f * n // 2))]
    report = {}
    for rows in ROWS:
        x = torch.randn((rows, n), device=device, dtype=torch.bfloat16)
        t: dict[str, Any] = {
            "bf16": graph_us_per_call(lambda i, x=x: F.linear(x, bf16[i]), len(bf16), device),
            "int8 kernel": kernel_us(int8, rows, None, device),
            "int8 dequant+cuBLAS": graph_us_per_call(
                lambda i, x=x: torch.ops.tinyinfer.dequant_matmul(x, int8[i].words, int8[i].scales, None, 8, n, 0),
                len(int8), device),
            "int4 tinygemm": graph_us_per_call(
                lambda i, x=x: torch._weight_int4pack_mm(x, tiny[i][0], 128, tiny[i][1]), len(tiny), device),
            "int4 tinygemm dequant+cuBLAS": graph_us_per_call(
                lambda i, x=x: torch.ops.tinyinfer.dequant_matmul_int4pack(x, tiny[i][0], tiny[i][1], 128, tile_map),
                len(tiny), device),
            "int4 triton kernel": kernel_us(int4, rows, None, device),
            "int4 words dequant+cuBLAS": graph_us_per_call(
                lambda i, x=x: torch.ops.tinyinfer.dequant_matmul(x, int4[i].words, int4[i].scales, None, 4, 128, 8),
                len(int4), device),
        }
        report[f"{name} {list(shape)} rows={rows}"] = t
        log(f"{name} rows={rows}: " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in t.items()))
    return report


def int4pack_speed(device: torch.device) -> dict[str, Any]:
    """torch's int4 kernel against dequantizing its layout + cuBLAS, 8B shapes, 128 and 512 rows."""
    from tinyinfer.runners import torch_quant_prefill as qp

    gen = torch.Generator(device=device).manual_seed(0)
    tile_map = qp.int4pack_tile_map(device, 8)
    report: dict[str, Any] = {}

    def record(key: str, err: float, limit: float, exact: bool | None = None) -> None:
        report[key] = {"rel_error": err, "bit_exact": exact, "ok": math.isfinite(err) and err < limit
                       and exact is not False}
        log(f"{key}: {report[key]}")

    check_pack(device, np.random.default_rng(0), record)
    for name, (out_f, n) in SHAPES["llama-3-8b"].items():
        tiny = [(torch._convert_weight_to_int4pack(torch.randint(0, 256, (out_f, n // 2), generator=gen, device=device,
                                                                 dtype=torch.uint8), 8),
                 (torch.rand((n // 128, out_f, 2), generator=gen, device=device) * 1e-2).to(torch.bfloat16))
                for _ in range(copies_for(out_f * n // 2))]
        for rows in (128, 512):
            x = torch.randn((rows, n), device=device, dtype=torch.bfloat16)
            t = {"int4 tinygemm": graph_us_per_call(
                     lambda i, x=x, tiny=tiny: torch._weight_int4pack_mm(x, tiny[i][0], 128, tiny[i][1]), len(tiny),
                     device),
                 "int4 tinygemm dequant+cuBLAS": graph_us_per_call(
                     lambda i, x=x, tiny=tiny: torch.ops.tinyinfer.dequant_matmul_int4pack(
                         x, tiny[i][0], tiny[i][1], 128, tile_map), len(tiny), device)}
            report[f"llama-3-8b {name} rows={rows}"] = t
            log(f"{name} rows={rows}: " + " ".join(f"{k}={v:.1f}" for k, v in t.items()))
    return report


def prefill_profile(device: torch.device) -> dict[str, Any]:
    """A 128-token prefill of the 8B shape through the runner (eager, as the engine runs it):
    wall time (host included) and CUDA time, and the kernels that take it."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    from tinyinfer.bench.shapes import shape_models
    from tinyinfer.runners.runner import make_batch

    report = {}
    for fmt in ("bf16", "int8", "int4-g128"):
        model, _ = shape_models("llama-3-8b", "cuda", "bfloat16", quantize=None if fmt == "bf16" else fmt,
                                quantize_head=fmt != "bf16")
        runner = model.runner
        kv = runner.new_kv_cache(16, 16)
        batch = make_batch([(list(range(1000, 1128)), 0, list(range(9)), False)], 16)
        for _ in range(3):
            runner.forward(batch, kv)
        torch.cuda.synchronize()
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            runner.forward(batch, kv)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.forward(batch, kv)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
        cuda_total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        report[fmt] = {"wall_ms_median": sorted(walls)[2], "cuda_ms": cuda_total, "table": table}
        log(f"prefill 128 {fmt}: wall {sorted(walls)[2]:.1f} ms, CUDA {cuda_total:.1f} ms\n{table}")
        del model, runner, kv
        gc.collect()
        torch.cuda.empty_cache()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["check", "speed", "int4pack", "profile"])
    args = parser.parse_args()
    device = torch.device("cuda")
    path = Path(args.out) / "gpu_quant_prefill.json"
    report: dict[str, Any] = {"environment": environment(device), "command": " ".join(sys.argv)}
    log(f"{report['environment'].get('card')}")
    for name, fn in (("check", lambda: check(device)), ("speed", lambda: speed(device)),
                     ("int4pack", lambda: int4pack_speed(device)),
                     ("profile", lambda: prefill_profile(device))):
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as exc:  # noqa: BLE001 - the next part still runs, the error is kept
            import traceback

            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
        report[f"{name}_seconds"] = time.perf_counter() - t0
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
