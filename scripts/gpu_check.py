"""Check the torch runner on a CUDA GPU and time batch-1 decode against the memory roofline.

    PYTHONPATH=. python scripts/gpu_check.py               # JSON to $OUT/gpu_check.json or --out
    PYTHONPATH=. python scripts/gpu_check.py --smoke       # tiny shapes, any device: a dry run

(a) correctness: bf16 logits vs the float64 NumPy reference on random-weight models; fp32
    greedy tokens through the Engine identical to the reference's; the CUDA-graph path vs the
    eager path; the Triton decode kernel vs the torch gather version, with bf16 and int8 K/V;
    int8 K/V through the whole runner (compiled, CUDA graphs) vs the reference's int8 K/V.
(b) speed: batch-1 decode of random-weight models of the llama-3.2-1b and llama-3-8b shapes
    in bf16. Timed with CUDA events after warm-up, medians. The roofline is (weight bytes +
    KV bytes read per step) / the device-to-device copy bandwidth measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tinyinfer.config import ModelConfig, config_from_dict
from tinyinfer.engine import Engine
from tinyinfer.model import Model
from tinyinfer.runners.numpy_ref import NumpyRunner
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.torch_weights import random_weights
from tinyinfer.sampling import SamplingParams

BLOCK = 16
CHECK_CONFIGS = {
    "llama-gqa": dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 128}),
    "qwen2-tied": dict(model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                       max_position_embeddings=1024, tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", vocab_size=512, n_embd=256, n_layer=3, n_head=4,
                 n_positions=1024),
}
BENCH_CONFIGS = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072,
                         tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192,
                       tie_word_embeddings=False, rope_theta=500000.0),
}
SMOKE_BENCH = {"tiny-llama": dict(CHECK_CONFIGS["llama-gqa"], num_hidden_layers=2)}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """‖ours − ref‖ / ‖ref‖ over every element."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def median_ms(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median time of fn() in milliseconds: CUDA events on a GPU, the host clock elsewhere."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = median_ms(lambda: dst.copy_(src), 20, device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------- correctness


def numpy_weights(config: ModelConfig, seed: int, bf16: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights, logits of spread ~0.3; with bf16=True, rounded to bf16 values."""
    std = 0.3 / math.sqrt(config.hidden_size)
    weights = random_weights(config, device="cpu", dtype="float32", seed=seed, std=std)
    if bf16:
        weights = {name: w.bfloat16().float() for name, w in weights.items()}
    return {name: w.numpy() for name, w in weights.items()}


def check_schedule(vocab: int, seed: int) -> list[list[tuple[list[int], int, list[int], bool]]]:
    """Prefill three sequences (one in two chunks), then decode at batch 3, 2 and 1, then a
    mixed step; pages shuffled. Returns the make_batch entries of each step."""
    rng = np.random.default_rng(seed)
    lengths = [70, 33, 1]
    total = [n + 12 for n in lengths]
    ids = [rng.integers(0, vocab, n).tolist() for n in total]
    pages = rng.permutation(64).tolist()
    tables = [[pages.pop() for _ in range(math.ceil(n / BLOCK))] for n in total]
    steps = [[(ids[0][:40], 0, tables[0], False), (ids[1][:33], 0, tables[1], False),
              (ids[2][:1], 0, tables[2], False)],
             [(ids[0][40:70], 40, tables[0], True)]]
    pos = [70, 33, 1]
    for live in ([0, 1, 2],) * 4 + ([0, 1],) * 2 + ([1],) * 2 + ([2, 0, 1],) * 2:
        steps.append([(ids[s][pos[s]:pos[s] + 1], pos[s], tables[s], False) for s in live])
        for s in live:
            pos[s] += 1
    steps.append([(ids[0][pos[0]:pos[0] + 1], pos[0], tables[0], False),
                  (ids[1][pos[1]:pos[1] + 2], pos[1], tables[1], True)])
    return steps


def run_schedule(runner: Any, steps: list, num_pages: int = 64) -> list[np.ndarray]:
    kv = runner.new_kv_cache(num_pages, BLOCK)
    return [runner.forward(make_batch(entries, BLOCK), kv) for entries in steps]


def check_bf16_vs_float64(device: torch.device) -> dict[str, Any]:
    """bf16 fast runner (default options) against the float64 reference, step by step.

    The reference gets the same bf16-rounded weights, so what is measured is the rounding of
    activations; the error against the unrounded weights is reported beside it.
    """
    out = {}
    for name, raw in CHECK_CONFIGS.items():
        config = config_from_dict(raw)
        steps = check_schedule(config.vocab_size, seed=2)
        weights = numpy_weights(config, seed=1, bf16=True)
        ref = run_schedule(NumpyRunner(config, weights, dtype="float64"), steps)
        unrounded = run_schedule(NumpyRunner(config, numpy_weights(config, seed=1), dtype="float64"),
                                 steps)
        # Compiling costs seconds per model and shape: one model takes the compiled path.
        fast = TorchRunner(config, weights, device=str(device), dtype="bfloat16",
                           compile=name == "llama-gqa")
        ours = run_schedule(fast, steps)
        error = max(relative_error(a, b) for a, b in zip(ours, ref))
        out[name] = {"runner": fast.describe(), "max_rel_error": error,
                     "max_rel_error_vs_unrounded_weights": max(
                         relative_error(a, b) for a, b in zip(ours, unrounded)),
                     "ok": error <= 2e-2}
        log(f"  bf16 vs float64 {name}: max ‖Δ‖/‖ref‖ over steps = {error:.2e}")
    return out


def check_fp32_greedy(device: torch.device) -> dict[str, Any]:
    """Greedy tokens through the Engine: fp32 fast runner vs the float32 reference."""
    out = {}
    for name in ("llama-gqa", "gpt2"):
        config = config_from_dict(CHECK_CONFIGS[name])
        weights = numpy_weights(config, seed=3)
        rng = np.random.default_rng(4)
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 13, 50, 29)]
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        tokens = []
        runners = (NumpyRunner(config, weights),
                   TorchRunner(config, weights, device=str(device), dtype="float32", compile=False))
        for runner in runners:
            engine = Engine(Model(config=config, runner=runner, path=Path("."), name=name),
                            page_size=BLOCK, max_num_batched_tokens=64)
            tokens.append([c.token_ids for c in engine.generate(prompts, params)])
        same = tokens[0] == tokens[1]
        out[name] = {"runner": runners[1].describe(), "identical": same,
                     "tokens_compared": sum(len(t) for t in tokens[0])}
        log(f"  fp32 greedy {name}: identical = {same}")
    return out


def check_graphs_vs_eager(device: torch.device) -> dict[str, Any]:
    """Same schedule through eager, CUDA graphs, compile, and the torch decode attention."""
    config = config_from_dict(CHECK_CONFIGS["llama-gqa"])
    weights = numpy_weights(config, seed=5)
    steps = check_schedule(config.vocab_size, seed=6)
    on_cuda = device.type == "cuda"
    variants = {
        "eager": dict(compile=False, cuda_graphs=False),
        "graphs": dict(compile=False, cuda_graphs=on_cuda),
        "compile+graphs": dict(compile=True, cuda_graphs=on_cuda),
        "eager, torch decode attention": dict(compile=False, cuda_graphs=False,
                                              decode_attention="torch"),
    }
    results = {name: run_schedule(TorchRunner(config, weights, device=str(device),
                                              dtype="bfloat16", **options), steps)
               for name, options in variants.items()}
    base = results["eager"]
    out: dict[str, Any] = {}
    for name, logits in results.items():
        if name == "eager":
            continue
        diffs = [relative_error(a, b) for a, b in zip(logits, base)]
        exact = [bool(np.array_equal(a, b)) for a, b in zip(logits, base)]
        out[name] = {"max_rel_diff_vs_eager": max(diffs), "steps_bit_identical": sum(exact),
                     "steps": len(exact), "ok": max(diffs) <= 2e-2}
        log(f"  {name} vs eager: max rel diff {max(diffs):.2e}, "
            f"{sum(exact)}/{len(exact)} steps bit-identical")
    return out


def check_decode_kernel(device: torch.device) -> dict[str, Any]:
    """Triton paged decode vs the gather version on long contexts, bf16, fresh random data; with
    int8 K/V, random codes and scales, the reference math being the gather version's (float32
    attention over codes x scales), and the new token's codes and scales compared as written."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    from tinyinfer.runners import torch_layers, torch_triton

    out = {}
    gen = torch.Generator(device=device).manual_seed(7)
    shapes = ((32, 8, 64, 1), (32, 8, 128, 5), (12, 12, 64, 3))
    for (heads, kv_heads, hd, batch), int8 in [(s, False) for s in shapes] + [(s, True) for s in shapes]:
        pages, length = 512, 1600
        if int8:  # codes and float16 scales of about a bf16 cache's spread (|x| ~ 3)
            k_cache, v_cache = torch.randint(-127, 128, (2, pages, BLOCK, kv_heads, hd), generator=gen,
                                             device=device, dtype=torch.int8).unbind(0)
            scales = tuple((torch.rand((2, pages, BLOCK, kv_heads), generator=gen, device=device)
                            * 0.03 + 0.005).half().unbind(0))
        else:
            k_cache, v_cache = torch.randn((2, pages, BLOCK, kv_heads, hd), generator=gen,
                                           device=device, dtype=torch.bfloat16).unbind(0)
            scales = ()
        qkv = torch.randn((batch, (heads + 2 * kv_heads) * hd), generator=gen, device=device,
                          dtype=torch.bfloat16)
        positions = torch.randint(0, length, (batch,), generator=gen, device=device)
        positions[0] = length - 1
        tables = torch.randperm(pages, generator=gen, device=device)[:batch * 100].view(batch, 100)
        slots = tables[torch.arange(batch, device=device), positions // BLOCK] * BLOCK + positions % BLOCK
        angles = torch.arange(4096, device=device, dtype=torch.float64)[:, None] * \
            torch.rand(hd // 2, generator=gen, device=device, dtype=torch.float64)
        cos, sin = angles.cos().float(), angles.sin().float()
        def named(cache: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
            return dict(zip(("k_scale", "v_scale"), cache[2:]))

        ref_cache = tuple(t.clone() for t in (k_cache, v_cache, *scales))
        ref = torch_layers.paged_decode_attention(qkv, positions, slots, tables, *ref_cache[:2], cos,
                                                  sin, heads, **named(ref_cache)).float()
        for splits in (None, 1):
            cache = tuple(t.clone() for t in (k_cache, v_cache, *scales))
            torch.cuda.synchronize()
            got = torch_triton.paged_decode_attention(qkv, positions, slots, tables, *cache[:2], cos,
                                                      sin, heads, num_splits=splits, **named(cache)).float()
            torch.cuda.synchronize()
            err = float((got - ref).norm() / ref.norm())
            same_cache = all(torch.equal(a, b) for a, b in zip(cache, ref_cache))
            written = sum(int((a != b).sum()) for a, b in zip(cache, ref_cache))  # values unlike the gather version's
            key = (f"{'int8' if int8 else 'bf16'} K/V H{heads}/Hkv{kv_heads}/hd{hd}/B{batch}/"
                   f"splits={splits or 'auto'}")
            out[key] = {"rel_error": err, "cache_identical": same_cache, "cache_values_differing": written,
                        "finite": bool(torch.isfinite(got).all()),
                        "ok": err <= 1e-2 and same_cache and bool(torch.isfinite(got).all())}
            log(f"  decode kernel {key}: rel error {err:.2e}, cache identical {same_cache}")
    return out


def check_int8_kv_vs_reference(device: torch.device) -> dict[str, Any]:
    """int8 K/V through the whole bf16 runner (compiled, CUDA graphs, Triton decode) against the
    float64 reference with int8 K/V, step by step, same bf16-rounded weights; the float K/V
    reference's distance beside it, for scale."""
    out = {}
    for name in ("llama-gqa", "qwen2-tied"):
        config = config_from_dict(CHECK_CONFIGS[name])
        steps = check_schedule(config.vocab_size, seed=12)
        weights = numpy_weights(config, seed=11, bf16=True)
        ref = run_schedule(NumpyRunner(config, weights, dtype="float64", kv_cache_dtype="int8"), steps)
        unquantized = run_schedule(NumpyRunner(config, weights, dtype="float64"), steps)
        on_cuda = device.type == "cuda"
        fast = TorchRunner(config, weights, device=str(device), dtype="bfloat16", compile=name == "llama-gqa",
                           cuda_graphs=on_cuda, kv_cache_dtype="int8")
        ours = run_schedule(fast, steps)
        error = max(relative_error(a, b) for a, b in zip(ours, ref))
        out[name] = {"runner": fast.describe(), "max_rel_error": error,
                     "int8_vs_float_kv_reference": max(relative_error(a, b) for a, b in zip(ref, unquantized)),
                     "ok": error <= 2e-2}
        log(f"  int8 K/V bf16 runner vs float64 int8 reference {name}: max ‖Δ‖/‖ref‖ = {error:.2e}")
    return out


# ---------------------------------------------------------------- speed


def kernel_profile(step: Callable[[], Any], steps: int) -> dict[str, float]:
    """GPU time per step by kernel kind (µs), from the profiler over `steps` eager steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kind: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type != DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        name = event.key.lower()
        if "paged_decode" in name or "merge_splits" in name:
            kind = "decode attention (Triton)"
        elif any(word in name for word in ("gemm", "gemv", "nvjet", "cutlass", "sm90_", "xmma")):
            kind = "matrix products (cuBLAS)"
        elif name.startswith("triton_"):
            kind = "fused norms / activations (Inductor)"
        elif "memcpy" in name or "memset" in name:
            kind = "copies"
        else:
            kind = "other: " + event.key[:60]
        per_kind[kind] += us / steps
    return dict(sorted(per_kind.items(), key=lambda kv: -kv[1]))


def bench_decode(name: str, raw: dict[str, Any], bandwidth: float, device: torch.device,
                 prompt_len: int, decode_steps: int) -> dict[str, Any]:
    """Batch-1 decode of one random-weight shape: graph replay, engine-facing forward, eager."""
    config = config_from_dict(raw)
    log(f"bench {name}: building random bf16 weights on {device}")
    runner = TorchRunner(config, random_weights(config, device=str(device), dtype="bfloat16"),
                         device=str(device), dtype="bfloat16", compile=True)
    described = runner.describe()
    weight_bytes = runner.w.streamed_bytes()
    kv_token_bytes = config.kv_bytes_per_token(2)
    total = prompt_len + decode_steps + 32
    table = list(range(math.ceil(total / BLOCK)))
    kv = runner.new_kv_cache(len(table), BLOCK)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, prompt_len).tolist()
    t0 = time.perf_counter()
    logits = runner.forward(make_batch([(prompt, 0, table, False)], BLOCK), kv)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    position = prompt_len

    def decode_once() -> float:
        """One greedy decode step; returns the milliseconds spent in runner.forward alone."""
        nonlocal logits, position
        batch = make_batch([([int(logits[-1].argmax())], position, table, False)], BLOCK)
        t0 = time.perf_counter()
        logits = runner.forward(batch, kv)
        position += 1
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):  # compile + capture happen here
        decode_once()
    forward_ms = statistics.median(decode_once() for _ in range(decode_steps))
    context = position - decode_steps // 2  # median context over the timed steps

    graph, _ = kv.graphs[1].graphs[1] if kv.graphs and 1 in kv.graphs else (None, None)
    replay_ms = median_ms(graph.replay, 100, device) if graph is not None else float("nan")
    replay_context = position - 1  # the replay repeats the last staged step

    runner.cuda_graphs = False
    for _ in range(3):
        decode_once()
    eager_ms = median_ms(decode_once, 20, device)
    profile = kernel_profile(decode_once, 5) if device.type == "cuda" else {}

    def roofline(ms: float, ctx: int) -> dict[str, float]:
        bytes_read = weight_bytes + ctx * kv_token_bytes
        floor_ms = bytes_read / (bandwidth * 1e9) * 1e3
        return {"ms_per_token": ms, "tokens_per_s": 1e3 / ms, "context": ctx,
                "bytes_read_per_step": bytes_read, "roofline_ms": floor_ms,
                "roofline_tokens_per_s": 1e3 / floor_ms, "percent_of_roofline": 100 * floor_ms / ms}

    micro = {}
    if device.type == "cuda":
        micro = {"matrix_products": matrix_product_microbench(runner, device),
                 "decode_attention": attention_microbench(config, device, (context, 4096))}
    gemm_us = profile.get("matrix products (cuBLAS)", 0.0)
    result = {
        "config": raw, "runner": described, "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_token_bytes, "prompt_len": prompt_len,
        "prefill_ms_incl_first_use": prefill_ms,
        "graph_replay": roofline(replay_ms, replay_context),
        "forward_call": roofline(forward_ms, context),
        "eager_compiled_no_graphs": roofline(eager_ms, position),
        "kernel_us_per_step": profile,
        "kernel_us_total": sum(profile.values()),
        "matrix_product_bandwidth_GBps": weight_bytes / (gemm_us * 1e-6) / 1e9 if gemm_us else None,
        "microbench": micro,
    }
    return result


def graph_us_per_call(call: Callable[[int], Any], calls: int, device: torch.device) -> float:
    """Device µs per call(i), i = 0..calls-1, replayed from one CUDA graph (launch gaps included)."""
    for i in range(calls):  # warm-up: Triton compiles, cuBLAS picks its kernels
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    return median_ms(graph.replay, 20, device) * 1e3 / calls


def matrix_product_microbench(runner: TorchRunner, device: torch.device) -> dict[str, Any]:
    """Batch-1 products with each kind of weight, every layer's in turn (so L2 holds none)."""
    out = {}
    layers = runner.w.layers
    kinds = {name: [getattr(layer, name)[0] for layer in layers]
             for name in ("qkv", "o", "mlp_in", "mlp_out")}
    kinds["head"] = [runner.w.head] * 4
    for name, weights in kinds.items():
        x = torch.randn((1, weights[0].shape[1]), device=device, dtype=weights[0].dtype)
        us = graph_us_per_call(lambda i: torch.nn.functional.linear(x, weights[i]), len(weights),
                               device)
        nbytes = weights[0].numel() * weights[0].element_size()
        out[name] = {"shape": list(weights[0].shape), "us": us, "GBps": nbytes / (us * 1e-6) / 1e9}
        log(f"  matrix product {name} {list(weights[0].shape)}: {us:.1f} us, "
            f"{out[name]['GBps']:.0f} GB/s")
    return out


def attention_microbench(config: ModelConfig, device: torch.device,
                         contexts: tuple[int, ...]) -> dict[str, Any]:
    """Decode attention at batch 1, one call per layer's cache: Triton (auto / 1 split), torch."""
    from tinyinfer.runners import torch_layers, torch_triton

    heads, kv_heads, hd, layers = (config.num_heads, config.num_kv_heads, config.head_dim,
                                   config.num_layers)
    gen = torch.Generator(device=device).manual_seed(9)
    out = {}
    for ctx in contexts:
        pages = math.ceil(ctx / BLOCK)
        k_cache, v_cache = torch.randn((2, layers, pages, BLOCK, kv_heads, hd), generator=gen,
                                       device=device, dtype=torch.bfloat16).unbind(0)
        qkv = torch.randn((1, (heads + 2 * kv_heads) * hd), generator=gen, device=device,
                          dtype=torch.bfloat16)
        tables = torch.randperm(pages, generator=gen, device=device)[None, :]
        positions = torch.tensor([ctx - 1], device=device)
        slots = tables[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
        angles = torch.arange(ctx, device=device, dtype=torch.float64)[:, None] * \
            torch.rand(hd // 2, generator=gen, device=device, dtype=torch.float64)
        cos, sin = angles.cos().float(), angles.sin().float()
        variants = {
            "triton": lambda i: torch_triton.paged_decode_attention(
                qkv, positions, slots, tables, k_cache[i], v_cache[i], cos, sin, heads),
            "triton, 1 split": lambda i: torch_triton.paged_decode_attention(
                qkv, positions, slots, tables, k_cache[i], v_cache[i], cos, sin, heads, num_splits=1),
            "torch gather": lambda i: torch_layers.paged_decode_attention(
                qkv, positions, slots, tables, k_cache[i], v_cache[i], cos, sin, heads),
        }
        for name, call in variants.items():
            us = graph_us_per_call(call, layers, device)
            out[f"context {ctx}, {name}"] = us
            log(f"  decode attention, context {ctx}, {name}: {us:.1f} us per layer")
    return out


# ---------------------------------------------------------------- main


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
                            "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(card=props.name, memory_GiB=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


CHECKS = {"decode_kernel": check_decode_kernel, "bf16_vs_float64": check_bf16_vs_float64,
          "fp32_greedy": check_fp32_greedy, "graphs_vs_eager": check_graphs_vs_eager,
          "int8_kv_vs_reference": check_int8_kv_vs_reference}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (dry run)")
    parser.add_argument("--only", choices=["checks", "bench"], help="run one half only")
    parser.add_argument("--check", action="append", choices=sorted(CHECKS), default=None,
                        help="run only these checks (repeatable; default: all)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        log("no CUDA device: run with --smoke for a dry run on CPU")
        return 2
    out_path = Path(args.out) / "gpu_check.json"
    report: dict[str, Any] = {"environment": environment(device), "command": " ".join(sys.argv)}

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2, default=str))

    started = time.perf_counter()
    bandwidth = copy_bandwidth(device, 2**30 if not args.smoke else 2**24)
    report["copy_bandwidth_GBps"] = bandwidth
    log(f"device-to-device copy: {bandwidth:.0f} GB/s (read + write)")
    if args.only != "checks":  # the numbers first: each section is saved as it finishes
        bench = report.setdefault("bench", {})
        shapes = SMOKE_BENCH if args.smoke else BENCH_CONFIGS
        for name, raw in shapes.items():
            bench[name] = bench_decode(name, raw, bandwidth, device,
                                       prompt_len=40 if args.smoke else 512,
                                       decode_steps=8 if args.smoke else 128)
            save()
            gc.collect()  # the cache's graphs and the runner refer to each other
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.only != "bench":
        checks = report.setdefault("checks", {})
        for name, check in CHECKS.items():
            if args.check and name not in args.check:
                continue
            log(f"check {name}")
            checks[name] = check(device)
            save()
    report["seconds"] = time.perf_counter() - started
    save()
    print_summary(report)
    return 0


def print_summary(report: dict[str, Any]) -> None:
    env = report["environment"]
    print(f"\n{env.get('card', env['device'])}, torch {env['torch']}, copy bandwidth "
          f"{report['copy_bandwidth_GBps']:.0f} GB/s")
    for group, results in report.get("checks", {}).items():
        for name, r in results.items():
            if isinstance(r, dict):
                ok = r.get("ok", r.get("identical"))
                print(f"  check {group:16s} {name:40s} {'PASS' if ok else 'FAIL'}")
    print(f"\n{'shape':14s} {'path':26s} {'ms/token':>9s} {'tok/s':>8s} {'roofline':>9s} {'%':>6s}")
    for name, r in report.get("bench", {}).items():
        for path in ("graph_replay", "forward_call", "eager_compiled_no_graphs"):
            p = r[path]
            print(f"{name:14s} {path:26s} {p['ms_per_token']:9.3f} {p['tokens_per_s']:8.0f} "
                  f"{p['roofline_tokens_per_s']:9.0f} {p['percent_of_roofline']:6.1f}")
        for kind, us in r["kernel_us_per_step"].items():
            print(f"    {kind:50s} {us:8.1f} us/step")
        for kind, m in r["microbench"].get("matrix_products", {}).items():
            print(f"    product {kind:8s} {str(m['shape']):16s} {m['us']:8.1f} us {m['GBps']:6.0f} GB/s")
        for variant, us in r["microbench"].get("decode_attention", {}).items():
            print(f"    attention {variant:40s} {us:8.1f} us/layer")
    print(f"\nwall time {report['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
