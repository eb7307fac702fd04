"""Decode speed of weight-only int8 / int4 against bf16 on a CUDA GPU, through the runner.

    PYTHONPATH=. python scripts/gpu_quant_bench.py               # JSON to $OUT/gpu_quant_bench.json
    PYTHONPATH=. python scripts/gpu_quant_bench.py --smoke       # tiny shapes, any device: a dry run
    PYTHONPATH=. python scripts/gpu_quant_bench.py --head        # the quantized LM head (below)

(a) correctness: on a small random model, the torch runner's quantized logits in bf16 (each
    product kernel) against the float64 NumPy reference holding the same quantized weights.
(b) speed: batch-1 decode of the llama-3-8b and llama-3.2-1b shapes in bf16, and in int4-g128
    and int8 through each product kernel ("triton": tinyinfer's kernels; "torch": torch's int4
    kernel, and the compiled dequantize-then-multiply for int8), with the runner's CUDA defaults
    (torch.compile + CUDA graphs); then the graph replay of a 16-sequence decode step. Linear
    weights are random codes with random scales (one draw per matrix shape, stored once per
    layer): speed does not depend on the values. The roofline is the bytes one decode step must
    read (weights streamed + KV) over the device-to-device copy bandwidth measured in this run.
(c) the batch-1 matrix products of the 8B shape with each kind of weight, one layer after another.
(d) ``--profile``: where each variant's batch-1 step goes, kernel by kernel: ``torch.profiler``
    over replays of the step's CUDA graph (the kernels the card ran, in order; one replay's
    kernels counted and summed by name, its span from the first kernel's start to the last's
    end, and the time no kernel ran).

``--head`` measures the quantized LM head and embedding (``--quantize-head``) instead: (a) the
head's products at vocab x hidden shapes (llama-3-8b's 128256 x 4096, SmolLM2's 49152 x 576 and
1003 x 576, whose rows are no multiple of a tile) against x @ dequantize(W)^T, and a lookup's
rows against the reference's ``dequantize_rows``; the runner check with +head formats, eager
and compiled + CUDA graphs; (b) batch-1 decode of the --shapes in bf16, int8+head and
int4-g128+head (the runner's default kernels, "auto", and torch's int4 kernel beside them);
(c) the head's product alone, GB/s of the bytes it stores.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import (  # noqa: E402
    BENCH_CONFIGS,
    BLOCK,
    CHECK_CONFIGS,
    SMOKE_BENCH,
    check_schedule,
    copy_bandwidth,
    environment,
    graph_us_per_call,
    log,
    median_ms,
    numpy_weights,
    relative_error,
    run_schedule,
)

from tinyinfer.bench.shapes import quantize_randomly, random_quantized  # noqa: E402
from tinyinfer.config import ModelConfig, config_from_dict  # noqa: E402
from tinyinfer.quant import QuantConfig, quantize_weights  # noqa: E402
from tinyinfer.runners import torch_layers as layers  # noqa: E402
from tinyinfer.runners.numpy_ref import NumpyRunner  # noqa: E402
from tinyinfer.runners.runner import make_batch  # noqa: E402
from tinyinfer.runners.torch_fast import TorchRunner  # noqa: E402
from tinyinfer.runners.torch_weights import random_weights  # noqa: E402

VARIANTS = ("bf16", "int4-g128@torch", "int4-g128@triton", "int8@torch", "int8@triton")
HEAD_VARIANTS = ("bf16", "int8+head@auto", "int4-g128+head@auto", "int4-g128+head@torch")
HEAD_CHECK_VARIANTS = ("int8+head@auto", "int4-g128+head@auto", "int4-g128+head@torch", "int4-g32-min+head@auto")
HEAD_SHAPES = {"llama-3-8b": (128256, 4096), "smollm2": (49152, 576), "ragged": (1003, 576)}


CHECK_VARIANTS = ("int8@torch", "int8@triton", "int4-g128@torch", "int4-g128@triton",
                  "int4-g32-asym@triton", "int4-g32-min@triton", "int8-g32@triton")


def split_variant(variant: str) -> tuple[str, str]:
    """'int4-g128@triton' -> ('int4-g128', 'triton'); bf16 has no product kernel to pick. A
    suffix names the runner's decode_products: 'int4-g128+head@auto/triton' (see decode_speed)."""
    fmt, _, kernel = variant.partition("@")
    return fmt, (kernel.partition("/")[0] or "torch")


def decode_products(variant: str) -> str:
    """The decode_products a variant asks for: 'int4-g128@auto/triton' -> 'triton', else 'auto'."""
    return variant.partition("/")[2] or "auto"


def check_quantized_logits(device: torch.device, formats: tuple[str, ...]) -> dict[str, Any]:
    """Relative error of bf16 quantized logits vs the float64 reference on the same codes."""
    config = config_from_dict(CHECK_CONFIGS["llama-gqa"])
    steps = check_schedule(config.vocab_size, seed=3)
    floats = numpy_weights(config, seed=4)
    out = {}
    for variant in formats:
        fmt, kernel = split_variant(variant)
        weights = quantize_weights(floats, QuantConfig.parse(fmt))
        ref = run_schedule(NumpyRunner(config, weights, dtype="float64"), steps)
        for compiled in (False, True):  # eager, then torch.compile + CUDA graphs
            runner = TorchRunner(config, weights, device=str(device), dtype="bfloat16", compile=compiled,
                                 cuda_graphs=compiled and device.type == "cuda", quant_kernel=kernel)
            kinds = sorted({type(layer.qkv[0]).__name__ for layer in runner.w.layers})
            ours = run_schedule(runner, steps)
            error = max(relative_error(a, b) for a, b in zip(ours, ref))
            key = f"{variant}{' compiled + graphs' if compiled else ''}"
            head = f"head {type(runner.w.head).__name__}, embedding {type(runner.w.embed).__name__}"
            out[key] = {"relative_error": error, "weight_kinds": kinds, "head": head, "ok": error < 3e-2}
            log(f"check {key}: bf16 vs float64 reference, relative error {error:.2e} ({', '.join(kinds)}; {head})")
    return out


def bench_weights(config: ModelConfig, fmt: str, device: torch.device) -> dict[str, Any]:
    """Random weights of a shape: bf16 on the device, linear layers replaced by quantized ones."""
    weights: dict[str, Any] = random_weights(config, device=str(device), dtype="bfloat16")
    if fmt == "bf16":
        return weights
    quantize_randomly(weights, QuantConfig.parse(fmt))  # int8+head: the embedding and LM head too
    return weights


def graph_profile(graph: torch.cuda.CUDAGraph, replays: int = 5) -> dict[str, Any]:
    """One replay of a CUDA graph, kernel by kernel (the middle one of ``replays``, so that no
    replay's start or end is cut): kernels a step, each kernel name's count and µs, the µs from
    the first kernel's start to the last one's end, and the µs within that no kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA")
    per_replay = len(spans) // replays
    if per_replay * replays != len(spans):  # a kernel missed or extra: the slices would straddle replays
        raise RuntimeError(f"{len(spans)} kernels over {replays} replays of one graph")
    step = spans[replays // 2 * per_replay:(replays // 2 + 1) * per_replay]
    by_name: dict[str, list[float]] = {}
    idle, reached = 0.0, step[0][0]
    for start, end, kernel in step:
        idle += max(0.0, start - reached)
        reached = max(reached, end)
        count, us = by_name.get(kernel, (0, 0.0))
        by_name[kernel] = [count + 1, us + end - start]
    return {"kernels_a_step": per_replay, "span_us": reached - step[0][0], "idle_us": idle,
            "by_kernel": sorted(([k, c, us] for k, (c, us) in by_name.items()), key=lambda row: -row[2])}


def decode_speed(name: str, raw: dict[str, Any], variant: str, bandwidth: float, device: torch.device,
                 prompt_len: int, decode_steps: int, profile: bool = False) -> tuple[dict[str, Any], TorchRunner]:
    """Batch-1 greedy decode after a prompt: engine-facing forward and CUDA-graph replay; then
    the graph replay of a 16-sequence decode step (``profile``: and the batch-1 step's
    ``graph_profile``)."""
    torch._dynamo.reset()  # compile each model fresh: no recompiles, no dynamic shapes
    config = config_from_dict(raw)
    fmt, kernel = split_variant(variant)
    t0 = time.perf_counter()
    runner = TorchRunner(config, bench_weights(config, fmt, device), device=str(device), dtype="bfloat16",
                         quant_kernel=kernel, decode_products=decode_products(variant))
    build_s = time.perf_counter() - t0
    weight_bytes = runner.w.streamed_bytes()
    kv_token_bytes = config.kv_bytes_per_token(2)
    table = list(range(math.ceil((prompt_len + decode_steps + 64) / BLOCK)))
    kv = runner.new_kv_cache(17 * len(table), BLOCK)  # the batch-16 step's sequences take the rest
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, prompt_len).tolist()
    logits = runner.forward(make_batch([(prompt, 0, table, False)], BLOCK), kv)
    position = prompt_len

    def decode_once() -> float:
        nonlocal logits, position
        batch = make_batch([([int(logits[-1].argmax())], position, table, False)], BLOCK)
        start = time.perf_counter()
        logits = runner.forward(batch, kv)
        position += 1
        return (time.perf_counter() - start) * 1e3

    t0 = time.perf_counter()
    for _ in range(3):  # compile and graph capture happen here
        decode_once()
    warmup_s = time.perf_counter() - t0
    forward_ms = statistics.median(decode_once() for _ in range(decode_steps))
    context = position - decode_steps // 2
    replay_ms = batch16_ms = float("nan")
    decode = kv.graphs[1] if kv.graphs and 1 in kv.graphs else None  # one token per sequence
    step_profile = None
    if decode is not None and 1 in decode.graphs:
        replay_ms = median_ms(decode.graphs[1][0].replay, 100, device)
        if profile:
            step_profile = graph_profile(decode.graphs[1][0])
        # 16 sequences at the same context, each on its own pages (their K/V are left as the
        # cache holds them: the step's cost does not depend on the values)
        tables = [[p + (s + 1) * len(table) for p in table] for s in range(16)]
        batch16 = make_batch([([1], position, t, False) for t in tables], BLOCK)
        for _ in range(2):
            runner.forward(batch16, kv)
        if 16 in decode.graphs:
            batch16_ms = median_ms(decode.graphs[16][0].replay, 50, device)

    def roofline(ms: float, ctx: int) -> dict[str, float]:
        floor_ms = (weight_bytes + ctx * kv_token_bytes) / (bandwidth * 1e9) * 1e3
        return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "context": ctx, "roofline_ms": floor_ms,
                "roofline_tokens_per_s": 1e3 / floor_ms, "percent_of_roofline": 100 * floor_ms / ms}

    result = {"model": name, "format": variant, "runner": runner.describe(), "streamed_weight_bytes": weight_bytes,
              "build_s": build_s, "warmup_s": warmup_s, "forward_call": roofline(forward_ms, context),
              "graph_replay": roofline(replay_ms, position - 1),
              "batch16_graph_replay": {"ms_per_step": batch16_ms, "tokens_per_s": 16e3 / batch16_ms}}
    if step_profile is not None:
        result["step_profile"] = step_profile
    log(f"{name} {variant}: {1e3 / forward_ms:.1f} tok/s per forward call, {1e3 / replay_ms:.1f} tok/s "
        f"graph replay, {result['graph_replay']['percent_of_roofline']:.0f}% of roofline "
        f"({weight_bytes / 1e9:.2f} GB streamed; build {build_s:.0f} s, warm-up {warmup_s:.0f} s); "
        f"batch 16: {16e3 / batch16_ms:.0f} tok/s")
    return result, runner


def matmul_microbench(runner: TorchRunner, fmt: str, device: torch.device) -> dict[str, Any]:
    """Batch-1 product with each kind of linear weight, every layer's in turn (L2 holds none)."""
    torch._dynamo.reset()
    compiled = torch.compile(layers.linear)
    c = runner.config
    widths = {"qkv": c.hidden_size, "o": c.num_heads * c.head_dim, "mlp_in": c.hidden_size,
              "mlp_out": c.intermediate_size}
    out: dict[str, Any] = {}
    for kind, width in widths.items():
        weights = [getattr(layer, kind)[0] for layer in runner.w.layers]
        x = torch.randn((1, width), device=device, dtype=torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(weights[0]))
        variants = {"eager": lambda i: layers.linear(x, weights[i], None),
                    "compiled": lambda i: compiled(x, weights[i], None)}
        if isinstance(weights[0], layers.Int8Weight):
            variants["aten _weight_int8pack_mm"] = lambda i: torch._weight_int8pack_mm(
                x, weights[i].codes, weights[i].scales)
        for variant, call in variants.items():
            try:
                us = graph_us_per_call(call, len(weights), device)
            except (RuntimeError, NotImplementedError) as exc:
                out[f"{kind}, {variant}"] = {"error": str(exc).splitlines()[0][:200]}
                log(f"  {fmt} {kind} {variant}: not available ({out[f'{kind}, {variant}']['error']})")
                continue
            out[f"{kind}, {variant}"] = {"us": us, "GBps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes}
            log(f"  {fmt} {kind} {variant}: {us:.1f} us, {nbytes / (us * 1e-6) / 1e9:.0f} GB/s")
    return out


def head_formats(shape: tuple[int, int]) -> list[str]:
    """Formats to check at a head shape: int4 in groups that divide its width."""
    return ["int8@triton", "int8@torch"] + [f"int4-g{g}@{k}" for g in (128, 64) if shape[1] % g == 0
                                             for k in ("torch", "triton")][:2]


def check_head_products(device: torch.device) -> dict[str, Any]:
    """The head's product and the embedding's lookup at vocab x hidden shapes, each layout, bf16
    activations: the product within 1e-2 (relative norm) of x @ W^T in float64, W the dequantized
    weight; looked-up rows equal to the reference's dequantize_rows rounded to bf16."""
    from tinyinfer.quant import dequantize_rows

    rng = np.random.default_rng(5)
    out: dict[str, Any] = {}
    on_cpu = device.type == "cpu"  # a dry run: torch's layouts, the small shapes
    for name, shape in HEAD_SHAPES.items():
        if on_cpu and name == "llama-3-8b":
            continue
        for variant in head_formats(shape):
            if on_cpu and variant.endswith("@triton"):
                continue
            fmt, kernel = split_variant(variant)
            qw = random_quantized(shape, QuantConfig.parse(fmt), rng)
            w = layers.device_weight(qw, device, torch.bfloat16, kernel=kernel)
            table = w if not isinstance(w, layers.Int4Weight) else layers.lookup_weight(qw, device)
            # W on the device, every row looked up (checked against NumPy on a sample of rows)
            ids = torch.from_numpy(rng.integers(0, shape[0], 64)).to(device)
            rows = layers.embedding(table, ids, torch.float32).cpu().numpy()
            ref_rows = dequantize_rows(qw, ids.cpu().numpy())
            # exact where the layout keeps float16 scales; the matmul layouts that hold their
            # scales in bf16 (per-row int8, GroupWeight) round them as their products do
            lookup_error = float(np.linalg.norm(rows - ref_rows) / np.linalg.norm(ref_rows))
            lookup_ok = lookup_error < 1e-2
            full = torch.cat([layers.embedding(table, chunk, torch.float32).double()
                              for chunk in torch.arange(shape[0], device=device).split(8192)])
            errors = {}
            for m in (1, 5):
                x = torch.randn((m, shape[1]), device=device, dtype=torch.bfloat16)
                ref = x.double() @ full.T
                got = layers.linear(x, w, None).double()
                errors[m] = float((got - ref).norm() / ref.norm())
            key = f"{name} {shape[0]}x{shape[1]} {variant}"
            ok = lookup_ok and max(errors.values()) < 1e-2
            out[key] = {"layout": type(w).__name__, "relative_error": errors, "lookup_error": lookup_error,
                        "lookup_exact": lookup_error == 0.0, "ok": ok}
            log(f"head {key} ({type(w).__name__}): product rel. error {errors}, lookup rows rel. error "
                f"{lookup_error:.1e}: {'ok' if ok else 'FAILED'}")
            del w, table, full
            if not on_cpu:
                torch.cuda.empty_cache()
    return out


def head_microbench(device: torch.device) -> dict[str, Any]:
    """The llama-3-8b head's batch-1 product alone, bf16 and each quantized layout: µs and GB/s of
    the bytes its weight stores (the head is 2-5 times L2, so a replay reads it from memory)."""
    shape = HEAD_SHAPES["llama-3-8b"]
    rng = np.random.default_rng(6)
    x = torch.randn((1, shape[1]), device=device, dtype=torch.bfloat16)
    weights: dict[str, Any] = {"bf16": torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02}
    for variant in ("int8@triton", "int8@torch", "int4-g128@torch", "int4-g128@triton"):
        fmt, kernel = split_variant(variant)
        weights[variant] = layers.device_weight(random_quantized(shape, QuantConfig.parse(fmt), rng), device,
                                                torch.bfloat16, kernel=kernel)
    torch._dynamo.reset()
    compiled = torch.compile(layers.linear)
    out: dict[str, Any] = {}
    for variant, w in weights.items():
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(w))
        us = graph_us_per_call(lambda i: compiled(x, w, None), 4, device)
        out[variant] = {"layout": type(w).__name__, "us": us, "GBps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes}
        log(f"head product {variant} ({type(w).__name__}): {us:.1f} us, {nbytes / (us * 1e-6) / 1e9:.0f} GB/s "
            f"of {nbytes / 1e6:.0f} MB")
    return out


def _tensors(weight: Any) -> list[torch.Tensor]:
    if isinstance(weight, torch.Tensor):
        return [weight]
    return [v for v in vars(weight).values() if isinstance(v, torch.Tensor)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="start no new model after this many seconds (default: 300)")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_quant_bench.json)")
    parser.add_argument("--shapes", nargs="+", default=["llama-3-8b", "llama-3.2-1b"], choices=list(BENCH_CONFIGS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        help="formats, each optionally @triton, @torch or @auto, then optionally /triton "
                             "or /torch: the runner's decode_products (default: %(default)s)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--check-variants", nargs="+", default=None,
                        help="formats the correctness check runs (default: every product kernel's)")
    parser.add_argument("--head", action="store_true",
                        help="the quantized LM head: head checks, decode with it (bf16, int8+head, "
                             "int4-g128+head by the Triton kernels and by torch's), the head's product")
    parser.add_argument("--no-matmul", action="store_true", help="skip the per-matrix timings (c)")
    parser.add_argument("--profile", action="store_true",
                        help="each variant's batch-1 step kernel by kernel, from its CUDA graph's replays (d)")
    args = parser.parse_args()
    if args.head:
        args.variants, args.no_matmul = list(HEAD_VARIANTS), True
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_path = Path(args.out or os.path.join(os.environ.get("OUT", "."), "gpu_quant_bench.json"))
    report: dict[str, Any] = {"environment": environment(device)}
    report["bandwidth_GBps"] = copy_bandwidth(device, 2**28 if args.smoke else 2**31)
    log(f"device-to-device copy: {report['bandwidth_GBps']:.0f} GB/s (read + write)")
    if args.head:
        report["head_check"] = check_head_products(device)
        if device.type == "cuda":
            report["head_product"] = head_microbench(device)
    if not args.no_check:
        report["check"] = check_quantized_logits(device, tuple(args.check_variants) if args.check_variants
                                                 else (HEAD_CHECK_VARIANTS if args.head else CHECK_VARIANTS)
                                                 if device.type == "cuda"
                                                 else ("int8+head", "int4-g128+head") if args.head
                                                 else ("int8", "int4-g128", "int4-g32-asym"))
    configs = SMOKE_BENCH if args.smoke else {k: BENCH_CONFIGS[k] for k in args.shapes}
    report["decode"], report["matmul"] = [], {}
    for name, raw in configs.items():
        for fmt in args.variants:
            if time.perf_counter() - start > args.budget_s:
                log(f"skipped {name} {fmt}: past the {args.budget_s:.0f} s budget")
                continue
            try:  # one failing variant must not cost the others their numbers
                result, runner = decode_speed(name, raw, fmt, report["bandwidth_GBps"], device,
                                              prompt_len=128, decode_steps=10 if args.smoke else 40,
                                              profile=args.profile and device.type == "cuda")
                report["decode"].append(result)
                if name == next(iter(configs)) and device.type == "cuda" and not args.no_matmul:
                    report["matmul"][fmt] = matmul_microbench(runner, fmt, device)
                del runner
            except Exception as exc:  # noqa: BLE001 - recorded in the report and the log
                report.setdefault("errors", []).append(f"{name} {fmt}: {type(exc).__name__}: {exc}")
                log(f"FAILED {name} {fmt}: {type(exc).__name__}: {exc}")
            gc.collect()
            torch.cuda.empty_cache()
            out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    report["seconds"] = time.perf_counter() - start
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_summary(report)
    return 0


def print_summary(report: dict[str, Any]) -> None:
    """The decode table, with each format's speed-up over bf16 on the same shape."""
    env = report["environment"]
    print(f"\n{env.get('card', env['device'])}, torch {env['torch']}, copy {report['bandwidth_GBps']:.0f} GB/s")
    for fmt, check in report.get("check", {}).items():
        print(f"check {fmt}: relative error {check['relative_error']:.2e} {'ok' if check['ok'] else 'FAILED'}")
    for key, check in report.get("head_check", {}).items():
        print(f"head check {key} ({check['layout']}): {'ok' if check['ok'] else 'FAILED'}")
    for variant, r in report.get("head_product", {}).items():
        print(f"head product {variant} ({r['layout']}): {r['us']:.1f} us, {r['GBps']:.0f} GB/s")
    for error in report.get("errors", []):
        print(f"error: {error}")
    print(f"{'model':<14} {'format':<18} {'tok/s fwd':>9} {'tok/s graph':>11} {'roofline':>9} "
          f"{'% roof':>7} {'vs bf16':>8} {'GB/step':>8} {'B=16 tok/s':>10}")
    bf16 = {r["model"]: r["graph_replay"]["tokens_per_s"] for r in report["decode"] if r["format"] == "bf16"}
    for r in report["decode"]:
        fwd, graph = r["forward_call"], r["graph_replay"]
        speedup = graph["tokens_per_s"] / bf16[r["model"]] if r["model"] in bf16 else float("nan")
        print(f"{r['model']:<14} {r['format']:<18} {fwd['tokens_per_s']:>9.1f} {graph['tokens_per_s']:>11.1f} "
              f"{graph['roofline_tokens_per_s']:>9.1f} {graph['percent_of_roofline']:>6.0f}% "
              f"{speedup:>7.2f}x {r['streamed_weight_bytes'] / 1e9:>8.2f} "
              f"{r['batch16_graph_replay']['tokens_per_s']:>10.0f}")
    for r in report["decode"]:
        if "step_profile" not in r:
            continue
        p = r["step_profile"]
        print(f"\n{r['model']} {r['format']}: {p['kernels_a_step']} kernels a step, {p['span_us']:.0f} us from the "
              f"first kernel's start to the last one's end, {p['idle_us']:.0f} us of it with no kernel running")
        for kernel, count, us in p["by_kernel"][:8]:
            print(f"  {us:8.1f} us  {count:4d} x {us / count:7.2f} us  {kernel[:70]}")


if __name__ == "__main__":
    sys.exit(main())
