"""The batch-invariant row products (runners/torch_triton_rows.py) on a GPU: exactness, then speed.

    PYTHONPATH=. python3 scripts/gpu_rows_check.py --out $OUT [--parts check,steps,products]
                                                   [--shapes llama-3.2-1b,llama-3-8b]

* check     each layer function of the row kernel against torch_layers' on random bf16 inputs
            of each shape's sizes at 1, 2, 5, 16 and 17 rows (relative error), and every row of
            each product computed M rows at a time against the same row alone, bit for bit
            (cuBLAS's F.linear beside it, for comparison); the matrix-vector kernels' layer
            functions at 2 rows (their few-row program) against torch_layers' too;
* steps     per shape, a runner on random weights: plain decode steps of one token each against
            one verification step of the same 5 tokens on a copy of the cache (logits bit for
            bit?), for decode_products "triton" (the verification through the few-row program, and
            through the row kernel) and with batch_invariant; and the CUDA-graph replay times (CUDA
            events, median of 100) of a 1-row and a 5-row step;
* batches   plain decode steps of 1, 2, 4, 8 and 16 sequences (one token each): CUDA-graph
            replay times (median of 50) through the fused products (1 row: the matrix-vector
            kernel; 2 rows: its few-row program, or the row kernel; 4..16: the row kernel) against
            decode_products "torch" (cuBLAS);
* products  each product of a shape (every layer's weight in turn from one CUDA graph, so L2
            serves none; prologues and epilogues as in the runner): cuBLAS at 1 and 5 rows, the
            matrix-vector kernel at 1 row and its few-row program at 2 rows (other tiles too),
            the row kernel at 1, 2, 5, 16, 17 rows and other tiles.

Writes OUT/gpu_rows_check.json after each part.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import graph_us_per_call, median_ms  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.runners import torch_layers as L  # noqa: E402
from tinyinfer.runners import torch_triton_gemv as gemv  # noqa: E402
from tinyinfer.runners import torch_triton_rows as rows  # noqa: E402
from tinyinfer.runners import triton_env  # noqa: E402
from tinyinfer.runners.runner import make_batch  # noqa: E402
from tinyinfer.runners.torch_fast import TorchRunner  # noqa: E402
from tinyinfer.runners.torch_weights import random_weights  # noqa: E402

PAGE, PROMPT = 16, 128
ROW_COUNTS = (1, 2, 5, 16, 17)
FEW_COUNTS = (2,)  # rows through the few-row program (torch_triton_gemv.FEW_ROWS)


def log(message: str) -> None:
    print(message, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def sizes(shape: str) -> dict[str, int]:
    config, _ = bs.shape_config(shape, 1024)
    return dict(d=config.hidden_size, f=config.intermediate_size, vocab=config.vocab_size,
                qkv=(config.num_heads + 2 * config.num_kv_heads) * config.head_dim)


def products(s: dict[str, int], g: torch.Generator, device: torch.device) -> dict:
    """Each product kind as the runner calls it: (weight, keyword arguments given x [M, K])."""
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(torch.bfloat16)

    d, f = s["d"], s["f"]
    nw = (1 + rand(d, scale=0.1).float()).to(torch.bfloat16)
    return {
        "qkv": (rand(s["qkv"], d, scale=0.02), lambda x: dict(norm=nw, residual=torch.ones_like(x),
                                                               sum_out=torch.empty_like(x), eps=1e-5)),
        "o": (rand(d, d, scale=0.02), lambda x: dict(add=torch.ones_like(x))),
        "gate|up": (rand(2 * f, d, scale=0.02), lambda x: dict(norm=nw, eps=1e-5, gated=True)),
        "down": (rand(d, f, scale=0.02), lambda x: {}),
        "head": (rand(s["vocab"], d, scale=0.02), lambda x: dict(
            norm=nw, residual=torch.ones_like(x), sum_out=torch.empty_like(x), eps=1e-5,
            out_dtype=torch.float32)),
    }


def check(shape: str, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    s = sizes(shape)
    d, f = s["d"], s["f"]
    out: dict = {}

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=g, device=device) * scale).to(torch.bfloat16)

    nw = (1 + rand(d, scale=0.1).float()).to(torch.bfloat16)
    wq, wo = rand(s["qkv"], d, scale=0.02), rand(d, d, scale=0.02)
    wi, wd, head = rand(2 * f, d, scale=0.02), rand(d, f, scale=0.02), rand(s["vocab"], d, scale=0.02)

    def against_torch_layers(fns, m: int) -> dict:
        """A fused module's layer functions (``rows`` or ``gemv``) at m rows against torch_layers'."""
        x, r, attn = rand(m, d), rand(m, d), rand(m, d)
        got_x, got = fns.attention_input(x, r, nw, None, wq, None, 1e-5)
        ref_x, ref = L.attention_input(x, r, nw, None, wq, None, 1e-5)
        row = {"attention_input": rel(got, ref), "sum_equal": bool(torch.equal(got_x, ref_x))}
        got_x, got = fns.mlp_block(x, attn, wo, None, nw, None, wi, None, wd, None, 1e-5, True)
        ref_x, ref = L.mlp_block(x, attn, wo, None, nw, None, wi, None, wd, None, 1e-5, True)
        row.update(mlp_x=rel(got_x, ref_x), mlp_out=rel(got, ref))
        row["final_logits"] = rel(fns.final_logits(x, r, nw, None, head, 1e-5),
                                  L.final_logits(x, r, nw, None, head, 1e-5))
        return row

    for m in ROW_COUNTS:
        out[f"rows {m}: vs torch_layers"] = against_torch_layers(rows, m)
    # bit identity: M rows at once against each row alone (and cuBLAS for comparison)
    identical, cublas_identical = {}, {}
    for name, (w, extra) in products(s, g, device).items():
        k = w.shape[1]
        x17 = rand(17, k)
        alone = [rows.rows_product(x17[i:i + 1], w, **extra(x17[i:i + 1])) for i in range(17)]
        lin_alone = [F.linear(x17[i:i + 1], w) for i in range(17)]
        for m in ROW_COUNTS[1:]:
            together = rows.rows_product(x17[:m], w, **extra(x17[:m]))
            identical[f"{name} M={m}"] = all(torch.equal(together[i], alone[i][0]) for i in range(m))
            lin = F.linear(x17[:m], w)
            cublas_identical[f"{name} M={m}"] = all(torch.equal(lin[i], lin_alone[i][0]) for i in range(m))
    for m in FEW_COUNTS:
        out[f"few rows {m}: vs torch_layers"] = against_torch_layers(gemv, m)
    out["rows_bit_identical_to_alone"] = identical
    out["cublas_rows_bit_identical_to_alone"] = cublas_identical
    out["ok"] = all(identical.values()) and all(
        v["attention_input"] < 2e-2 and v["mlp_out"] < 2e-2 and v["final_logits"] < 2e-2 and v["sum_equal"]
        for key, v in out.items() if key.startswith(("rows ", "few rows ")))
    log(f"check {shape}: ok {out['ok']}; row kernel bit-identical {sum(identical.values())}/{len(identical)}, "
        f"cuBLAS {sum(cublas_identical.values())}/{len(cublas_identical)}")
    log(json.dumps({k: v for k, v in out.items() if k.startswith(("rows ", "few rows "))}))
    return out


def step_variant(config, weights, products_choice: str, invariant: bool, device: torch.device,
                 few_rows: bool = True) -> dict:
    """Plain 1-token steps vs one 5-token verification of the same tokens (bit identity of the
    logits), then graph replay times of the 1-row and the 5-row step. ``few_rows`` False: steps of
    2..16 rows through the row kernel, as before the few-row program."""
    runner = TorchRunner(config, weights, device=str(device), dtype="bfloat16",
                         decode_products=products_choice, batch_invariant=invariant)
    if not few_rows:
        runner.few_rows = 1
    table = list(range(math.ceil((PROMPT + 40) / PAGE)))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, PROMPT).tolist()
    follow = np.random.default_rng(1).integers(0, config.vocab_size, 5).tolist()
    plain_kv, verify_kv = runner.new_kv_cache(len(table), PAGE), runner.new_kv_cache(len(table), PAGE)
    for kv in (plain_kv, verify_kv):
        runner.forward(make_batch([(prompt, 0, table, False)], PAGE), kv)
    plain = np.concatenate([runner.forward(make_batch([([t], PROMPT + i, table, False)], PAGE), plain_kv)
                            for i, t in enumerate(follow)])
    verify = runner.forward(make_batch([(follow, PROMPT, table, True)], PAGE), verify_kv)
    # once more, now that both graphs are captured: replayed steps against replayed steps
    plain2 = np.concatenate([runner.forward(make_batch([([t], PROMPT + i, table, False)], PAGE), plain_kv)
                             for i, t in enumerate(follow)])
    verify2 = runner.forward(make_batch([(follow, PROMPT, table, True)], PAGE), verify_kv)
    result = {"decode_products": runner.decode_products, "batch_invariant": invariant, "few_rows": runner.few_rows,
              "verify_equals_plain": bool(np.array_equal(plain, verify)),
              "verify_equals_plain_replayed": bool(np.array_equal(plain2, verify2)),
              "max_abs_diff": float(np.abs(plain2 - verify2).max()),
              "same_argmax": bool((plain2.argmax(-1) == verify2.argmax(-1)).all())}
    for q, kv in ((1, plain_kv), (5, verify_kv)):
        graph, _ = kv.graphs[q].graphs[1]
        for _ in range(5):
            graph.replay()
        result[f"replay_ms_q{q}"] = median_ms(graph.replay, 100, device)
    result["replay_ms_q1_again"] = median_ms(plain_kv.graphs[1].graphs[1][0].replay, 100, device)
    log(f"  {products_choice} invariant={invariant}: {json.dumps(result)}")
    del runner, plain_kv, verify_kv
    return result


def steps(shape: str, device: torch.device) -> dict:
    config, _ = bs.shape_config(shape, 1024)
    weights = random_weights(config, str(device), "bfloat16")
    out = {}
    for choice, invariant, few in (("triton", False, True), ("triton", False, False), ("triton", True, True),
                                   ("triton", False, True)):
        name = f"{choice}{' batch_invariant' if invariant else ''}{'' if few else ' row kernel'}"
        name += " again" if name in out else ""
        try:
            out[name] = step_variant(config, weights, choice, invariant, device, few)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            log(out[name]["error"])
        gc.collect()
        torch.cuda.empty_cache()
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    return out


BATCHES = (1, 2, 4, 8, 16)


def batches(shape: str, device: torch.device) -> dict:
    """Replay times of plain decode steps of 1..16 sequences, fused products against cuBLAS."""
    config, _ = bs.shape_config(shape, 1024)
    weights = random_weights(config, str(device), "bfloat16")
    pages = math.ceil((PROMPT + 8) / PAGE)
    prompts = np.random.default_rng(2).integers(0, config.vocab_size, (max(BATCHES), PROMPT)).tolist()
    out = {}
    for choice in ("triton", "triton row kernel", "torch"):
        runner = TorchRunner(config, weights, device=str(device), dtype="bfloat16",
                             decode_products=choice.split()[0])
        if choice == "triton row kernel":
            runner.few_rows = 1  # 2..16 rows through the row kernel, as before the few-row program
        kv = runner.new_kv_cache(pages * max(BATCHES), PAGE)
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(max(BATCHES))]
        for prompt, table in zip(prompts, tables):
            runner.forward(make_batch([(prompt, 0, table, False)], PAGE), kv)
        times = {}
        for size in BATCHES:
            entries = [([prompts[i][-1]], PROMPT, tables[i], False) for i in range(size)]
            for _ in range(2):  # the first captures the graph
                runner.forward(make_batch(entries, PAGE), kv)
            graphs = kv.graphs[1]
            graph, _ = graphs.graphs[graphs.padded_size(size)]
            for _ in range(5):
                graph.replay()
            times[size] = median_ms(graph.replay, 50, device)
        out[choice] = {"decode_products": runner.decode_products, "replay_ms": times}
        log(f"  {choice}: {json.dumps(times)}")
        del runner, kv
        gc.collect()
        torch.cuda.empty_cache()
    out["triton / torch"] = {b: out["triton"]["replay_ms"][b] / out["torch"]["replay_ms"][b] for b in BATCHES}
    out["triton / row kernel"] = {b: out["triton"]["replay_ms"][b] / out["triton row kernel"]["replay_ms"][b]
                                  for b in BATCHES}
    del weights
    gc.collect()
    torch.cuda.empty_cache()
    return out


CANDIDATES = [  # (outputs, inputs, split, warps, stages) tried at 1 and 5 rows
    (16, 512, 1, 4, 0), (32, 256, 1, 4, 0), (64, 128, 1, 4, 0), (16, 256, 1, 4, 3), (16, 512, 1, 4, 3),
    (32, 256, 1, 4, 3), (64, 128, 1, 4, 3), (32, 128, 1, 4, 4), (64, 64, 1, 4, 4), (32, 256, 1, 8, 3),
    (16, 512, 2, 4, 0), (16, 256, 2, 4, 3), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4), (64, 64, 2, 4, 4),
    (64, 64, 4, 4, 4), (64, 128, 2, 4, 3), (64, 128, 2, 4, 0), (128, 64, 2, 4, 4), (64, 64, 3, 4, 4)]


FEW_CANDIDATES = [  # (outputs, inputs, warps) of the few-row program at 2 rows
    (4, 1024, 4), (2, 1024, 4), (8, 512, 4), (4, 512, 4), (2, 2048, 4), (4, 2048, 8), (8, 1024, 8)]


def product_times(shape: str, device: torch.device, sweep: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(1)
    s = sizes(shape)
    out = {}
    for name, (w0, extra) in products(s, g, device).items():
        gated = name == "gate|up"
        copies = 4 if name == "head" else 16
        ws = [w0] + [torch.randn_like(w0, dtype=torch.float32).mul_(0.02).to(torch.bfloat16) for _ in range(copies - 1)]
        n, k = w0.shape
        nbytes = n * k * 2
        row: dict = {"shape": [n, k], "bytes": nbytes,
                     "default": list(rows.pick_config(n // 2 if gated else n, k, gated))}
        xs = {m: torch.randn((m, k), generator=g, device=device).to(torch.bfloat16) for m in (1, 2, 5, 16, 17)}
        args = {m: extra(xs[m]) for m in xs}

        def record(label: str, call) -> None:
            try:
                us = graph_us_per_call(call, copies, device)
                row[label] = {"us": round(us, 2), "TBps": round(nbytes / (us * 1e-6) / 1e12, 3)}
            except Exception as error:  # a tile that does not compile: say so, go on
                row[label] = repr(error)[:300]

        record("cublas M=1", lambda i: F.linear(xs[1], ws[i]))
        record("cublas M=5", lambda i: F.linear(xs[5], ws[i]))
        record("gemv M=1", lambda i: gemv.gemv(xs[1], ws[i], **args[1]))
        for m in FEW_COUNTS:
            record(f"few M={m}", lambda i, m=m: gemv.gemv(xs[m], ws[i], **args[m]))
            if sweep:
                for bn, inputs, warps in FEW_CANDIDATES:
                    cfg = gemv.Config(bn, inputs, num_warps=warps)
                    record(f"few M={m} {cfg.block_n}x{cfg.block_k} warps {warps}",
                           lambda i, m=m, cfg=cfg: gemv.gemv(xs[m], ws[i], **args[m], config=cfg))
        for m in (1, 2, 5, 16, 17):
            record(f"rows M={m}", lambda i, m=m: rows.rows_product(xs[m], ws[i], **args[m]))
        if sweep:
            for bn, bk, split, warps, stages in CANDIDATES:
                cfg = rows.Config(bn, bk, split, warps, stages)
                for m in (1, 5):
                    record(f"rows M={m} {bn}x{bk} split {split} warps {warps} stages {stages}",
                           lambda i, m=m: rows.rows_product(xs[m], ws[i], **args[m], config=cfg))
        record("gemv M=1 again", lambda i: gemv.gemv(xs[1], ws[i], **args[1]))
        record("rows M=1 again", lambda i: rows.rows_product(xs[1], ws[i], **args[1]))
        best = {m: min(((v["us"], label) for label, v in row.items()
                        if isinstance(v, dict) and label.startswith(f"rows M={m}")), default=None)
                for m in (1, 5)}
        best.update({f"few {m}": min(((v["us"], label) for label, v in row.items()
                                      if isinstance(v, dict) and label.startswith(f"few M={m}")), default=None)
                     for m in FEW_COUNTS})
        log(f"products {shape} {name} {[n, k]}: " + ", ".join(
            f"{label} {v['us']}" for label, v in row.items() if isinstance(v, dict) and "x" not in label)
            + f"; best rows: {best}")
        out[name] = row
        del ws, w0
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="check,steps,products", help="any of check,steps,batches,products")
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--no-sweep", action="store_true", help="products: the default tiles only")
    args = parser.parse_args()
    device = torch.device("cuda")
    out = Path(args.out) / "gpu_rows_check.json"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "command": " ".join(sys.argv),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log(f"{results['device']}, torch {results['torch']}, triton {results['triton']}")
    jobs = []
    for part in args.parts.split(","):
        for shape in args.shapes.split(","):
            job = {"check": lambda s=shape: check(s, device),
                   "steps": lambda s=shape: steps(s, device),
                   "batches": lambda s=shape: batches(s, device),
                   "products": lambda s=shape: product_times(s, device, not args.no_sweep)}[part]
            jobs.append((f"{part} {shape}", job))
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
    return 0


if __name__ == "__main__":
    # kernels timed alone launch as a runner's steps launch them (programmatic dependent launch
    # where the card has it); each runner built here applies its own pdl option inside
    with triton_env.dependent_launch(True):
        sys.exit(main())
