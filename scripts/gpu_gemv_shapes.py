"""The fused one-row products at every shape a decode step runs them, tensor-parallel shards
included, on one GPU: how close each streams to the copy bandwidth, and which tiles do best.

    PYTHONPATH=. python3 scripts/gpu_gemv_shapes.py --out $OUT --label NAME
        [--parts products,chains,sweep,steps] [--families tp4,tp2,1b,8b] [--sweep-seconds 150]

Families: ``1b`` and ``8b`` are the llama-3.2-1b and llama-3-8b shapes on one GPU, ``tp2`` and
``tp4`` one rank's shard of the llama-3-8b shape at TP=2 and TP=4 (q|k|v, gate|up and the LM
head split by rows, o and down by columns). Each product takes the prologue and epilogue the
runner gives it there (the shards' o product plain, their gate|up with the residual add).

* products  each product at the runner's tiles (``pick_config``), 32 weights in turn (the LM
            head: 4) replayed from one CUDA graph, so L2 serves none and each kernel starts
            under the previous one's tail as in a step (CUDA events, median of 20 replays):
            microseconds and TB/s of weights, cuBLAS (``F.linear``, no prologue) beside it;
* chains    a step's products alone, in order: q|k|v, o, gate|up, down for 32 layers, then the
            LM head, in one CUDA graph: milliseconds and TB/s of the step's weights;
* sweep     each product under many tiles (outputs per program, inputs per step, split K,
            warps, tiles in flight; or those of --tiles), each checked against the runner's
            tiles' output and timed as in ``products``; then the chains again at each
            product's fastest tiles;
* steps     the 1b and 8b families' batch-1 decode step through the runner (CUDA graph replay,
            ``gpu_fuse_check.step_variant``).

Only ``gemv``'s public contract is used outside ``sweep``, so the same script measures an older
checkout (``--label``) beside this one in the same call. Writes OUT/gpu_gemv_shapes_LABEL.json.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import multiprocessing
import random
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import graph_us_per_call  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.bench.measure import measure_copy_bandwidth  # noqa: E402
from tinyinfer.runners import torch_triton_gemv as gemv  # noqa: E402
from tinyinfer.runners import triton_env  # noqa: E402

LAYERS, HEADS = 32, 4  # weights a graph cycles through: a model's layers, and LM heads
EPS = 1e-5


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def family_products(family: str) -> dict[str, tuple[int, int, str]]:
    """Each product's (outputs, inputs, kind) in a family; gated products' outputs are gate|up's
    rows (2F), as the runner holds them."""
    world = {"1b": 1, "8b": 1, "tp2": 2, "tp4": 4}[family]
    config, _ = bs.shape_config("llama-3.2-1b" if family == "1b" else "llama-3-8b", 1024)
    d, hd = config.hidden_size, config.head_dim
    q, kv, f = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    shard = world > 1
    return {
        "qkv": ((q + 2 * kv) // world, d, "qkv"),
        "o": (d, q // world, "o" if shard else "o_add"),
        "gate|up": (2 * f // world, d, "gateup_res" if shard else "gateup"),
        "down": (d, f // world, "down"),
        "head": (config.vocab_size // world, d, "head"),
    }


class Inputs:
    """One decode row's activations for every product of a family (bf16, fixed addresses)."""

    def __init__(self, d: int, widest: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn((1, d), generator=g, device=device).to(torch.bfloat16)
        self.residual = torch.randn((1, d), generator=g, device=device).to(torch.bfloat16)
        self.norm = (1 + 0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
        self.wide = torch.randn((1, widest), generator=g, device=device).to(torch.bfloat16)
        self.total = torch.empty_like(self.x)


def product_call(kind: str, k: int, inputs: Inputs) -> Callable[..., torch.Tensor]:
    """call(weight, config) -> output: the product as the runner calls it for this kind."""
    x, r, nw, tot, wide = inputs.x, inputs.residual, inputs.norm, inputs.total, inputs.wide[:, :k]
    calls = {
        "qkv": lambda w, c: gemv.gemv(x, w, norm=nw, residual=r, sum_out=tot, eps=EPS, config=c),
        "o": lambda w, c: gemv.gemv(wide, w, config=c),
        "o_add": lambda w, c: gemv.gemv(wide, w, add=x, config=c),
        "gateup": lambda w, c: gemv.gemv(x, w, norm=nw, eps=EPS, gated=True, config=c),
        "gateup_res": lambda w, c: gemv.gemv(x, w, norm=nw, residual=r, sum_out=tot, eps=EPS, gated=True,
                                             config=c),
        "down": lambda w, c: gemv.gemv(wide, w, config=c),
        "head": lambda w, c: gemv.gemv(x, w, norm=nw, residual=r, sum_out=tot, eps=EPS,
                                       out_dtype=torch.float32, config=c),
    }
    return calls[kind]


TILES: list[tuple[int, ...]] = []  # --tiles: the sweep tries these alone


def candidates(n: int, k: int, gated: bool, limit: int, seed: int) -> list[tuple[int, ...]]:
    """Tiles to try: (block_n, block_k, split_k, num_warps, ahead), each program's tile 8-64
    elements a thread, split K only where the outputs give few tiles; at most ``limit``, a
    seeded sample (or those of --tiles that fit: block_k within the inputs)."""
    if TILES:
        return [t for t in TILES if t[1] <= k][:limit]
    rows = n // 2 if gated else n
    out = []
    for warps in (4, 8):
        for bn in (4, 8, 16):
            for bk in (128, 256, 512, 1024, 2048):
                per_thread = bn * bk * (2 if gated else 1) // (32 * warps)
                if bk > k or (bk == 128 and not gated) or not 8 <= per_thread <= 64:
                    continue
                tiles, blocks = math.ceil(rows / bn), math.ceil(k / bk)
                for split in (1, 2, 4, 8):
                    if split > 1 and (blocks % split or tiles > 1024 or tiles * split > 4096):
                        continue
                    for ahead in (1, 2):
                        if ahead == 1 or (blocks // split >= 2 and per_thread <= 32):
                            out.append((bn, bk, split, warps, ahead))
    random.Random(seed).shuffle(out)
    return out[:limit]


def bandwidth_row(us: float, nbytes: int) -> dict:
    return {"us": round(us, 3), "TBps": round(nbytes / (us * 1e-6) / 1e12, 3)}


def family_weights(products: dict, device: torch.device) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(1)
    return {name: [(0.02 * torch.randn((n, k), generator=g, device=device)).to(torch.bfloat16)
                   for _ in range(HEADS if name == "head" else LAYERS)]
            for name, (n, k, _) in products.items()}


def time_product(call: Callable, ws: list[torch.Tensor], config, device: torch.device) -> float:
    return graph_us_per_call(lambda i: call(ws[i], config), len(ws), device)


def time_chain(calls: dict[str, Callable], ws: dict[str, list[torch.Tensor]], configs: dict,
               device: torch.device) -> float:
    """Milliseconds of a step's products in order (32 layers, then the head), one CUDA graph."""
    def step(_: int) -> None:
        for layer in range(LAYERS):
            for name in ("qkv", "o", "gate|up", "down"):
                calls[name](ws[name][layer], configs.get(name))
        calls["head"](ws["head"][0], configs.get("head"))
    return graph_us_per_call(step, 1, device) / 1e3


def _compile_one(task: tuple) -> tuple[str, float]:
    """In a worker process: launch one product once at its real sizes, so that Triton compiles
    it into the shared cache the timing process then loads from."""
    family, name, config = task
    start = time.perf_counter()
    try:
        device = torch.device("cuda")
        n, k, kind = family_products(family)[name]
        w = torch.empty((n, k), dtype=torch.bfloat16, device=device)
        product_call(kind, k, _worker_inputs(family, device))(w, gemv.Config(*config))
        torch.cuda.synchronize()
        return "ok", time.perf_counter() - start
    except Exception as error:  # the timing process runs it again and records the error
        return repr(error)[:200], time.perf_counter() - start


_inputs: dict[str, Inputs] = {}


def _worker_inputs(family: str, device: torch.device) -> Inputs:
    if family not in _inputs:
        products = family_products(family)
        _inputs[family] = Inputs(products["head"][1], max(k for _, k, _ in products.values()), device)
    return _inputs[family]


def precompile(tasks: list[tuple], workers: int, seconds: float) -> dict:
    """Compile every (family, product, config) in worker processes, in parallel."""
    start = time.perf_counter()
    done, failed = 0, 0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.imap_unordered(_compile_one, tasks)
        while True:
            try:
                status, _ = results.next(timeout=max(1.0, seconds - (time.perf_counter() - start)))
            except StopIteration:
                break
            except multiprocessing.TimeoutError:
                log(f"precompile: time is up after {done} kernels")
                pool.terminate()
                break
            done += 1
            failed += status != "ok"
    return {"kernels": done, "failed": failed, "seconds": round(time.perf_counter() - start, 1)}


def run_family(family: str, parts: list[str], device: torch.device, deadline: float,
               per_product: int) -> dict:
    products = family_products(family)
    inputs = _worker_inputs(family, device)
    ws = family_weights(products, device)
    calls = {name: product_call(kind, k, inputs) for name, (n, k, kind) in products.items()}
    out: dict = {"products": {}}
    total_bytes = sum(w.numel() * 2 for name in ("qkv", "o", "gate|up", "down") for w in ws[name]) + \
        ws["head"][0].numel() * 2
    for name, (n, k, kind) in products.items():
        nbytes = n * k * 2
        row = {"shape": [n, k], "kind": kind, "MB": round(nbytes / 1e6, 2)}
        row["runner"] = bandwidth_row(time_product(calls[name], ws[name], None, device), nbytes)
        gated, norm = kind.startswith("gateup"), kind in ("qkv", "head")
        by = inspect.signature(gemv.pick_config).parameters  # tiles by kind, or (earlier) by shape too
        row["runner_tiles"] = list(gemv.pick_config(gated, norm) if "norm" in by else
                                   gemv.pick_config(n // 2 if gated else n, k, gated))
        x, copies = inputs.wide[:, :k], ws[name]
        row["cublas"] = bandwidth_row(
            graph_us_per_call(lambda i, x=x, copies=copies: F.linear(x, copies[i]), len(copies), device), nbytes)
        log(f"{family} {name} {[n, k]}: runner {row['runner']}, cublas {row['cublas']}")
        out["products"][name] = row
    if "chains" in parts or "sweep" in parts:
        ms = time_chain(calls, ws, {}, device)
        out["chain"] = {"runner_ms": round(ms, 4), "runner_TBps": round(total_bytes / (ms * 1e-3) / 1e12, 3),
                        "GB": round(total_bytes / 1e9, 3)}
        log(f"{family} chain: {out['chain']}")
    if "sweep" in parts:
        best = {}
        for name, (n, k, kind) in products.items():
            gated = kind.startswith("gateup")
            row = out["products"][name]
            ref = calls[name](ws[name][0], None).float()
            tried = {}
            for config in candidates(n, k, gated, per_product, seed=zlib.crc32(f'{family} {name}'.encode())):
                if time.perf_counter() > deadline:
                    tried["stopped"] = "sweep time is up"
                    break
                label = "x".join(map(str, config))
                try:
                    cfg = gemv.Config(*config)
                    got = calls[name](ws[name][0], cfg).float()
                    err = float((got - ref).norm() / ref.norm())
                    tried[label] = {**bandwidth_row(time_product(calls[name], ws[name], cfg, device), n * k * 2),
                                    "rel_err_vs_runner": round(err, 6)}
                except Exception as error:
                    tried[label] = {"error": repr(error)[:200]}
            ok = {lab: v for lab, v in tried.items() if isinstance(v, dict) and "us" in v
                  and v["rel_err_vs_runner"] < 2e-2}
            row["sweep"] = dict(sorted(tried.items(), key=lambda kv: kv[1].get("us", 1e9) if isinstance(kv[1], dict) else 1e9))
            if ok:
                label = min(ok, key=lambda lab: ok[lab]["us"])
                best[name] = gemv.Config(*map(int, label.split("x")))
                row["best"] = {"tiles": label, **ok[label]}
                log(f"{family} {name}: best {label} {ok[label]} (runner {row['runner']}, {len(tried)} tried)")
        ms = time_chain(calls, ws, best, device)
        again = time_chain(calls, ws, {}, device)
        out["chain"].update({"best_ms": round(ms, 4), "best_TBps": round(total_bytes / (ms * 1e-3) / 1e12, 3),
                             "runner_ms_again": round(again, 4)})
        log(f"{family} chain: {out['chain']}")
    del ws
    gc.collect()
    torch.cuda.empty_cache()
    return out


def steps(shape: str, device: torch.device) -> dict:
    from gpu_fuse_check import step_variant

    from tinyinfer.runners.torch_weights import random_weights

    config, _ = bs.shape_config(shape, 1024)
    weights = random_weights(config, str(device), "bfloat16")
    result = step_variant(config, weights, "triton", "on", device)
    result.pop("first_decode_logits", None)
    result["kernels"] = result["kernels"][:12]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="this")
    parser.add_argument("--parts", default="products,chains")
    parser.add_argument("--families", default="tp4,tp2,1b,8b")
    parser.add_argument("--sweep-seconds", type=float, default=150.0)
    parser.add_argument("--per-product", type=int, default=64, help="sweep: tiles tried per product")
    parser.add_argument("--compile-seconds", type=float, default=60.0, help="sweep: precompiling's limit")
    parser.add_argument("--compile-workers", type=int, default=14)
    parser.add_argument("--tiles", default="", help="sweep: these tiles only, e.g. 4x1024x1x8x1,4x256x1x4x1 "
                        "(outputs x inputs x split x warps x ahead)")
    args = parser.parse_args()
    TILES.extend(tuple(map(int, t.split("x"))) for t in args.tiles.split(",") if t)
    device = torch.device("cuda")
    parts, families = args.parts.split(","), args.families.split(",")
    out_path = Path(args.out) / f"gpu_gemv_shapes_{args.label}.json"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": __import__("triton").__version__, "command": " ".join(sys.argv),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "label": args.label,
                     "gemv_module": gemv.__file__}
    bandwidth = measure_copy_bandwidth("cuda")
    results["copy_TBps_2GiB"] = round(bandwidth / 1e12, 3)
    log(f"{results['device']}: copy {bandwidth / 1e12:.3f} TB/s, {gemv.__file__}")
    if "sweep" in parts:
        tasks = [(f, name, c) for f in families for name, (n, k, kind) in family_products(f).items()
                 for c in candidates(n, k, kind.startswith("gateup"), args.per_product,
                                     seed=zlib.crc32(f'{f} {name}'.encode()))]
        results["precompile"] = precompile(tasks, args.compile_workers, args.compile_seconds)
        log(f"precompile: {results['precompile']}")
    deadline = time.perf_counter() + args.sweep_seconds
    for i, family in enumerate(families):
        if "products" in parts or "chains" in parts or "sweep" in parts:
            start = time.perf_counter()
            # each family gets an equal share of what is left of the sweep's time
            share = time.perf_counter() + (deadline - time.perf_counter()) / (len(families) - i)
            try:
                results[family] = run_family(family, parts, device, share, args.per_product)
            except Exception:
                results[family] = {"error": traceback.format_exc()}
                log(results[family]["error"])
            results[family]["seconds"] = round(time.perf_counter() - start, 1)
            out_path.write_text(json.dumps(results, indent=1))
    if "steps" in parts:
        for shape in ("llama-3.2-1b", "llama-3-8b"):
            start = time.perf_counter()
            try:
                results[f"steps {shape}"] = steps(shape, device)
            except Exception:
                results[f"steps {shape}"] = {"error": traceback.format_exc()}
                log(results[f"steps {shape}"]["error"])
            results[f"steps {shape}"]["seconds"] = round(time.perf_counter() - start, 1)
            gc.collect()
            torch.cuda.empty_cache()
            out_path.write_text(json.dumps(results, indent=1))
    out_path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    # kernels timed alone launch as a runner's steps launch them (programmatic dependent launch
    # where the card has it); each runner built here applies its own pdl option inside
    with triton_env.dependent_launch(True):
        sys.exit(main())
