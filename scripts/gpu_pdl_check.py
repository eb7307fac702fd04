"""Programmatic dependent launch on and off: same logits, and the batch-1 decode step's speed.

    PYTHONPATH=. python scripts/gpu_pdl_check.py --out $OUT     # JSON to $OUT/gpu_pdl_check.json
    PYTHONPATH=. python scripts/gpu_pdl_check.py --smoke        # tiny shape, any device: a dry run

For each shape and format (llama-3.2-1b and llama-3-8b, bf16 and int4-g128 with the quantized
LM head, the runner's CUDA defaults otherwise), two runners on the same random weights, one with
``pdl=False`` and one with ``pdl=True``, run the same prompt of 128 tokens and then 12 decode
steps fed the same tokens (the first compiles and captures, the rest replay the CUDA graph);
every step's logits must be equal bit for bit. Then the batch-1 decode graph of each is replayed,
in turn three times (CUDA events, median of 60 replays each), against the roofline: the bytes a
step reads (weights streamed + K/V at the context) over a 2 GiB device-to-device copy. The
quantized formats, whose steps run compiled glue (the 8B's layers, the quantized heads), add
"on, Inductor's too": the runner's PDL, and Inductor's kernels built with its own
(``triton.enable_pdl``), which the runner does not ask for; with --attention, where the layers
run the compiled glue (int4 wider than 2048), "on, attention too": the decode attention launched
with it there too (the runner launches it so only beside its fused products).
"""

from __future__ import annotations

import argparse
import functools
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
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import BENCH_CONFIGS, BLOCK, SMOKE_BENCH, copy_bandwidth, environment, log, median_ms  # noqa: E402
from gpu_quant_bench import bench_weights, decode_products, split_variant  # noqa: E402

from tinyinfer.config import config_from_dict  # noqa: E402
from tinyinfer.runners.runner import make_batch  # noqa: E402
from tinyinfer.runners.torch_fast import TorchRunner  # noqa: E402

PROMPT = 128
STEPS = 12


def run_steps(runner: TorchRunner, prompt: list[int], fed: list[int] | None) -> tuple[list[np.ndarray], Any, int]:
    """The prompt, then STEPS decode steps fed ``fed`` (None: the runner's own argmax) ->
    (every step's logits, the K/V cache, the last position)."""
    table = list(range(math.ceil((PROMPT + STEPS + 16) / BLOCK)))
    kv = runner.new_kv_cache(len(table), BLOCK)
    logits = [runner.forward(make_batch([(prompt, 0, table, False)], BLOCK), kv)]
    position = len(prompt)
    for step in range(STEPS):
        token = int(logits[-1][-1].argmax()) if fed is None else fed[step]
        logits.append(runner.forward(make_batch([([token], position, table, False)], BLOCK), kv))
        position += 1
    return logits, kv, position


def variant_runner(config: Any, weights: dict[str, Any], fmt: str, pdl: bool, device: torch.device) -> TorchRunner:
    _, kernel = split_variant(fmt)
    return TorchRunner(config, weights, device=str(device), dtype="bfloat16" if device.type == "cuda" else None,
                       quant_kernel=kernel, decode_products=decode_products(fmt),
                       pdl=pdl if device.type == "cuda" else None)


def shape_format(name: str, raw: dict[str, Any], fmt: str, bandwidth: float, device: torch.device,
                 args_attention: bool = False) -> dict[str, Any]:
    torch._dynamo.reset()
    config = config_from_dict(raw)
    weights = bench_weights(config, split_variant(fmt)[0], device)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, PROMPT).tolist()
    runners = {"off": variant_runner(config, weights, fmt, False, device),
               "on": variant_runner(config, weights, fmt, True, device)}
    inductor = {}  # variants whose compiled glue Inductor builds with its own PDL (triton.enable_pdl)
    if fmt != "bf16":  # the quantized steps run compiled glue (the 8B's layers, the quantized heads)
        runners["on, Inductor's too"] = variant_runner(config, weights, fmt, True, device)
        inductor["on, Inductor's too"] = {"triton.enable_pdl": True}
        on = runners["on"]
        if args_attention and on.decode_products == "torch" and on.decode_attention_kind == "triton":
            from tinyinfer.runners import torch_triton

            extra = variant_runner(config, weights, fmt, True, device)
            extra.decode_attention = functools.partial(torch_triton.paged_decode_attention, pdl=True)
            runners["on, attention too"] = extra
    del weights
    ref, kv, position = run_steps(runners["off"], prompt, None)
    fed = [int(step[-1].argmax()) for step in ref[:-1]]
    runs: dict[str, Any] = {"off": (runners["off"], kv, position)}
    result: dict[str, Any] = {"model": name, "format": fmt, "variants": {}}
    for key, runner in runners.items():
        logits = ref
        if key != "off":
            try:
                with torch._inductor.config.patch(inductor.get(key, {})):  # it compiles at the first decode step
                    logits, kv, position = run_steps(runner, prompt, fed)
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                result["variants"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"FAILED {name} {fmt} pdl {key}: {type(exc).__name__}: {exc}")
                continue
            runs[key] = (runner, kv, position)
        same = [bool(np.array_equal(a, b)) for a, b in zip(logits, ref)]
        result["variants"][key] = {"runner": runner.describe(), "steps_bit_identical_to_off": sum(same),
                                   "steps": len(same), "max_abs_diff": max(float(np.abs(a - b).max())
                                                                           for a, b in zip(logits, ref))}
        log(f"{name} {fmt} pdl {key}: {sum(same)}/{len(same)} steps' logits bit-identical to pdl off")
    weight_bytes = runners["off"].w.streamed_bytes()
    kv_token_bytes = config.kv_bytes_per_token(2)
    replays: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(3):
        for key, (runner, kv, position) in runs.items():
            graphs = kv.graphs[1] if kv.graphs and 1 in kv.graphs else None
            if graphs is None or 1 not in graphs.graphs:
                continue
            replays[key].append(median_ms(graphs.graphs[1][0].replay, 60, device))
    for key, times in replays.items():
        if not times:
            continue
        ms = statistics.median(times)
        context = runs[key][2] - 1
        floor_ms = (weight_bytes + context * kv_token_bytes) / (bandwidth * 1e9) * 1e3
        result["variants"][key].update(replay_ms=ms, replay_ms_each=times, tokens_per_s=1e3 / ms,
                                       percent_of_roofline=100 * floor_ms / ms, roofline_ms=floor_ms,
                                       context=context)
    result["streamed_weight_bytes"] = weight_bytes
    off = result["variants"]["off"].get("replay_ms")
    for key, v in result["variants"].items():
        if off and "replay_ms" in v:
            v["speedup_vs_off"] = off / v["replay_ms"]
            log(f"{name} {fmt} pdl {key}: replay {v['replay_ms']:.4f} ms ({v['tokens_per_s']:.1f} tok/s, "
                f"{v['percent_of_roofline']:.1f} % of roofline), {v['speedup_vs_off']:.3f}x off")
    runs.clear()
    runners.clear()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_pdl_check.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on any device (dry run)")
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3-8b"], choices=list(BENCH_CONFIGS))
    parser.add_argument("--formats", nargs="+", default=["bf16", "int4-g128+head@auto"])
    parser.add_argument("--attention", action="store_true",
                        help="where the layers run the compiled glue, also the decode attention with it")
    parser.add_argument("--budget-s", type=float, default=330.0, help="start no new shape after this many seconds")
    args = parser.parse_args()
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {"environment": environment(device),
                              "inductor_pdl": "triton.enable_pdl" in torch._inductor.config.get_config_copy()}
    report["bandwidth_GBps"] = copy_bandwidth(device, 2**24 if args.smoke else 2**31)
    log(f"{report['environment']}; copy {report['bandwidth_GBps']:.0f} GB/s; Inductor's triton.enable_pdl: "
        f"{report['inductor_pdl']}")
    out = Path(args.out) / "gpu_pdl_check.json"
    report["results"] = []
    configs = SMOKE_BENCH if args.smoke else {k: BENCH_CONFIGS[k] for k in args.shapes}
    for name, raw in configs.items():
        for fmt in args.formats:
            if time.perf_counter() - start > args.budget_s:
                log(f"skipped {name} {fmt}: past the {args.budget_s:.0f} s budget")
                continue
            try:
                report["results"].append(shape_format(name, raw, fmt, report["bandwidth_GBps"], device,
                                                        args.attention))
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                report.setdefault("errors", []).append(f"{name} {fmt}: {type(exc).__name__}: {exc}")
                log(f"FAILED {name} {fmt}: {type(exc).__name__}: {exc}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    report["seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"{report['environment'].get('card', device)}, torch {torch.__version__}, copy "
          f"{report['bandwidth_GBps']:.0f} GB/s")
    print(f"{'model':<14} {'format':<22} {'pdl':<18} {'identical':>9} {'replay ms':>9} {'tok/s':>7} "
          f"{'% roof':>6} {'vs off':>6}")
    for r in report["results"]:
        for key, v in r["variants"].items():
            if "error" in v:
                print(f"{r['model']:<14} {r['format']:<22} {key:<18} {v['error'][:200]}")
                continue
            print(f"{r['model']:<14} {r['format']:<22} {key:<18} "
                  f"{v['steps_bit_identical_to_off']:>4}/{v['steps']:<4} {v.get('replay_ms', float('nan')):>9.4f} "
                  f"{v.get('tokens_per_s', float('nan')):>7.1f} {v.get('percent_of_roofline', float('nan')):>6.1f} "
                  f"{v.get('speedup_vs_off', float('nan')):>6.3f}")
    for error in report.get("errors", []):
        print(f"error: {error}")
    return 0 if not report.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
