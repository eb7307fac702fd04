"""The fused batch-1 decode products on a GPU: correctness, where a step's time goes, and tiles.

    PYTHONPATH=. python3 scripts/gpu_fuse_check.py --out $OUT [--shapes llama-3.2-1b,llama-3-8b]
                                                   [--parts check,steps,tiles] [--variants torch:off,triton:on]
                                                   [--tile-shapes llama-3.2-1b,llama-3-8b]

* check  the fused products (``torch_triton_gemv``) against torch's (cuBLAS) on random bf16
         inputs at the 1B shape's sizes (relative error), 1 and 3 rows;
* steps  per shape, per variant (--variants: decode_products "torch" / "triton", programmatic
         dependent launch "off" / "on" where the runner uses it): the batch-1 decode step
         replayed from its CUDA graph (CUDA events,
         median of 100 at context ~192), and a profile of 20 replays: each kernel's name, count
         and time per step, their sum against the replay time (the rest: gaps between kernels;
         negative where kernels overlap), and the first decode step's logits against the first
         variant's;
* tiles  each product of a shape (--tile-shapes; every layer's weight in turn, from one CUDA
         graph, so L2 serves none) by cuBLAS and by the Triton kernel under several tile choices;
* check decode attention: gpu_check's check of the Triton decode kernel against the gather
         version (with --parts check).

Writes OUT/gpu_fuse_check.json after each part.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import check_decode_kernel, graph_us_per_call, median_ms  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.bench.measure import measure_copy_bandwidth  # noqa: E402
from tinyinfer.runners import torch_triton_gemv as gemv  # noqa: E402
from tinyinfer.runners import triton_env  # noqa: E402
from tinyinfer.runners.runner import make_batch  # noqa: E402
from tinyinfer.runners.torch_fast import TorchRunner  # noqa: E402
from tinyinfer.runners.torch_weights import random_weights  # noqa: E402

PAGE, PROMPT, DECODE = 16, 128, 64


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def check(device: torch.device) -> dict:
    """Each fused function against torch_layers' on random bf16 inputs of the 1B shape."""
    from tinyinfer.runners import torch_layers as L

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(torch.bfloat16)

    out = {}
    for m in (1, 3):
        d, f, qkv = 2048, 8192, 3072
        x, r, attn = rand(m, d), rand(m, d), rand(m, d)
        nw = (1 + rand(d, scale=0.1).float()).to(torch.bfloat16)
        wq, wo, wi, wd = rand(qkv, d, scale=0.02), rand(d, d, scale=0.02), rand(2 * f, d, scale=0.02), rand(d, f, scale=0.02)
        head = rand(128256, d, scale=0.02)
        got_x, got = gemv.attention_input(x, r, nw, None, wq, None, 1e-5)
        ref_x, ref = L.attention_input(x, r, nw, None, wq, None, 1e-5)
        out[f"rows {m}: attention_input"] = {"qkv": rel(got, ref), "sum_equal": bool(torch.equal(got_x, ref_x))}
        got_x, got = gemv.mlp_block(x, attn, wo, None, nw, None, wi, None, wd, None, 1e-5, True)
        ref_x, ref = L.mlp_block(x, attn, wo, None, nw, None, wi, None, wd, None, 1e-5, True)
        out[f"rows {m}: mlp_block"] = {"x": rel(got_x, ref_x), "out": rel(got, ref)}
        got = gemv.final_logits(x, r, nw, None, head, 1e-5)
        out[f"rows {m}: final_logits"] = {"logits": rel(got, L.final_logits(x, r, nw, None, head, 1e-5)),
                                          "dtype": str(got.dtype)}
        # split K, forced: the same product as one split
        one = gemv.gemv(attn, wo, config=gemv.Config(16, 256, 1))
        split = gemv.gemv(attn, wo, config=gemv.Config(16, 256, 4))
        out[f"rows {m}: split 4 vs 1"] = rel(split, one)
    log(f"check: {json.dumps(out)}")
    return out


def step_variant(config, weights, products: str, pdl: str, device: torch.device) -> dict:
    """Batch-1 decode through one variant: graph replay time and a profile of its kernels.
    pdl: "on" or "off" (the runner's pdl option: programmatic dependent launch of the Triton kernels)."""
    runner = TorchRunner(config, weights, device=str(device), dtype="bfloat16", decode_products=products,
                         pdl=pdl == "on")
    table = list(range(math.ceil((PROMPT + DECODE + 8) / PAGE)))
    kv = runner.new_kv_cache(len(table), PAGE)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, PROMPT).tolist()
    logits = runner.forward(make_batch([(prompt, 0, table, False)], PAGE), kv)
    first = None
    for i in range(DECODE):
        token = int(logits[-1].argmax())
        logits = runner.forward(make_batch([([token], PROMPT + i, table, False)], PAGE), kv)
        if i == 0:
            first = logits.copy()
    graph, _ = kv.graphs[1].graphs[1]
    for _ in range(5):
        graph.replay()
    replay_ms = median_ms(graph.replay, 100, device)
    again_ms = median_ms(graph.replay, 100, device)
    from torch.profiler import ProfilerActivity, profile

    steps = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[event.name[:90]]
            k[0] += 1 / steps
            k[1] += getattr(event, "device_time_total", 0.0) / steps
    rows = sorted(({"kernel": n, "per_step": round(c, 2), "us_per_step": round(t, 2)}
                   for n, (c, t) in kernels.items()), key=lambda r: -r["us_per_step"])
    kernel_us = sum(r["us_per_step"] for r in rows)
    launches = sum(r["per_step"] for r in rows)
    result = {"decode_products": runner.decode_products, "pdl": pdl, "replay_ms": replay_ms,
              "replay_ms_again": again_ms, "tokens_per_s": 1e3 / replay_ms,
              "weight_bytes": runner.w.streamed_bytes(), "context": PROMPT + DECODE,
              "kernel_us_per_step": kernel_us, "kernels_per_step": launches,
              "gap_us_per_step": 1e3 * replay_ms - kernel_us, "kernels": rows[:40],
              "first_decode_logits": first}
    log(f"  {products:6s} pdl={pdl}: replay {replay_ms:.4f} / {again_ms:.4f} ms, kernels {kernel_us:.0f} us "
        f"in {launches:.0f} launches, gaps {1e3 * replay_ms - kernel_us:.0f} us")
    del runner, kv, graph
    return result


def steps(shape: str, device: torch.device, bandwidth: float, chosen: str) -> dict:
    config, _ = bs.shape_config(shape, 1024)
    weights = random_weights(config, str(device), "bfloat16")
    variants = {}
    for products, pdl in (v.split(":") for v in chosen.split(",")):
        name = f"{products}, pdl {pdl}"
        try:
            variants[name] = step_variant(config, weights, products, pdl, device)
        except Exception:
            variants[name] = {"error": traceback.format_exc()}
            log(variants[name]["error"])
        gc.collect()
        torch.cuda.empty_cache()
    base = next(iter(variants.values()), {}).get("first_decode_logits")
    for v in variants.values():
        logits = v.pop("first_decode_logits", None)
        if base is not None and logits is not None:
            v["first_logits_rel_diff_vs_torch"] = float(np.linalg.norm(logits - base) / np.linalg.norm(base))
        if "replay_ms" in v:
            kv_bytes = (PROMPT + DECODE) * config.kv_bytes_per_token(2)
            v["roofline_pct"] = 100 * (v["weight_bytes"] + kv_bytes) / bandwidth / (v["replay_ms"] * 1e-3)
    return variants


TILE_SHAPES = {  # per model shape: each product's [out, in], gated, and the tiles to try
    "llama-3.2-1b": {
        "qkv": (3072, 2048, False, [(16, 256, 1), (16, 256, 2), (8, 256, 2), (8, 512, 1), (32, 256, 2), (16, 512, 2)]),
        "o": (2048, 2048, False, [(16, 256, 2), (16, 256, 4), (8, 256, 2), (8, 512, 1), (32, 256, 4), (8, 256, 4)]),
        "gate|up": (16384, 2048, True, [(8, 256, 1), (4, 256, 1), (16, 256, 1), (8, 512, 1), (8, 128, 1)]),
        "down": (2048, 8192, False, [(16, 256, 4), (8, 256, 4), (16, 512, 2), (8, 512, 2), (4, 512, 2)]),
        "head": (128256, 2048, False, [(16, 256, 1), (8, 256, 1), (32, 256, 1), (16, 512, 1), (8, 512, 1)]),
    },
    "llama-3-8b": {
        "qkv": (6144, 4096, False, [(16, 256, 2), (16, 512, 1), (8, 256, 1), (8, 512, 2)]),
        "o": (4096, 4096, False, [(16, 256, 4), (8, 256, 2), (16, 512, 1), (8, 512, 2)]),
        "gate|up": (28672, 4096, True, [(8, 256, 1), (16, 128, 1), (4, 256, 1)]),
        "down": (4096, 14336, False, [(16, 256, 4), (8, 256, 4), (16, 512, 2), (8, 512, 2)]),
        "head": (128256, 4096, False, [(16, 256, 1), (16, 512, 1)]),
    },
}


def tiles(shape: str, device: torch.device) -> dict:
    """Each product of a shape by cuBLAS and by the Triton kernel at its default tiles and
    others, every weight of 16 (the head: 4) in turn from one CUDA graph."""
    g = torch.Generator(device=device).manual_seed(1)
    out = {}
    for name, (n, k, gated, candidates) in TILE_SHAPES[shape].items():
        copies = 4 if name == "head" else 16
        ws = [torch.randn((n, k), generator=g, device=device).to(torch.bfloat16) for _ in range(copies)]
        nbytes = n * k * 2
        x = torch.randn((1, k), generator=g, device=device).to(torch.bfloat16)
        row = {"shape": [n, k], "bytes": nbytes}

        def record(label: str, us: float) -> None:
            row[label] = {"us": round(us, 2), "TBps": round(nbytes / (us * 1e-6) / 1e12, 3)}

        record("cublas", graph_us_per_call(lambda i: F.linear(x, ws[i]), copies, device))
        row["default"] = list(gemv.pick_config(gated))
        record("triton default", graph_us_per_call(lambda i: gemv.gemv(x, ws[i], gated=gated), copies, device))
        for bn, bk, split in candidates:
            for warps in (4, 8) if gated else (4,):
                cfg = gemv.Config(bn, bk, split, warps)
                try:
                    us = graph_us_per_call(lambda i: gemv.gemv(x, ws[i], gated=gated, config=cfg), copies, device)
                    record(f"triton {bn}x{bk} split {split} warps {warps}", us)
                except Exception as error:  # a tile that does not compile: say so, go on
                    row[f"triton {bn}x{bk} split {split} warps {warps}"] = repr(error)[:200]
        record("cublas again", graph_us_per_call(lambda i: F.linear(x, ws[i]), copies, device))
        record("triton default again", graph_us_per_call(lambda i: gemv.gemv(x, ws[i], gated=gated), copies, device))
        best = min((v["us"], label) for label, v in row.items() if isinstance(v, dict))
        log(f"tiles {shape} {name}: cublas {row['cublas']['us']} us, triton default {row['triton default']['us']} us, "
            f"best {best[1]} {best[0]} us")
        out[name] = row
        del ws
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--parts", default="check,steps,tiles")
    parser.add_argument("--variants", default="torch:off,triton:off,triton:on,torch:on",
                        help="steps: decode_products:pdl pairs")
    parser.add_argument("--tile-shapes", default="llama-3.2-1b")
    args = parser.parse_args()
    device = torch.device("cuda")
    out = Path(args.out) / "gpu_fuse_check.json"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "command": " ".join(sys.argv),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "inductor_pdl_options": [n for n in dir(torch._inductor.config.triton) if "pdl" in n]}
    results["copy_bandwidth_bytes_per_s"] = bandwidth = measure_copy_bandwidth("cuda")
    log(f"{results['device']}, copy {bandwidth / 1e12:.3f} TB/s, inductor PDL options {results['inductor_pdl_options']}")
    parts = args.parts.split(",")
    jobs = []
    if "check" in parts:
        jobs.append(("check", lambda: check(device)))
        jobs.append(("check decode attention", lambda: check_decode_kernel(device)))
    if "steps" in parts:
        jobs += [(f"steps {s}", lambda s=s: steps(s, device, bandwidth, args.variants)) for s in args.shapes.split(",")[:1]]
    if "tiles" in parts:
        jobs += [(f"tiles {s}", lambda s=s: tiles(s, device)) for s in args.tile_shapes.split(",")]
    if "steps" in parts:
        jobs += [(f"steps {s}", lambda s=s: steps(s, device, bandwidth, args.variants)) for s in args.shapes.split(",")[1:]]
    for name, job in jobs:
        start = time.perf_counter()
        log(f"== {name}")
        try:
            results[name] = job()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            log(results[name]["error"])
        results[name + " seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=2))
    summary = {k: {v: (r.get("replay_ms"), r.get("roofline_pct"), r.get("kernels_per_step"), r.get("gap_us_per_step"))
                   for v, r in results[k].items() if isinstance(r, dict)}
               for k in results if k.startswith("steps ") and not k.endswith("seconds")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    # kernels timed alone launch as a runner's steps launch them (programmatic dependent launch
    # where the card has it); each runner built here applies its own pdl option inside
    with triton_env.dependent_launch(True):
        sys.exit(main())
