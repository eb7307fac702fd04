"""Every GPU benchmark of the engine in one invocation (for a lent H100/H200).

    PYTHONPATH=. python3 scripts/gpu_bench.py --out $OUT [--only latency,throughput,...]

Sections (each writes its results to OUT/gpu_bench.json as soon as it finishes, so a run cut
short keeps what it measured):

* latency     batch-1 TTFT / TPOT / % of memory roofline for the bench presets (C2, C6, C14)
* throughput  256 requests, lengths uniform in 100..1024, vs transformers generate (C13)
* batching    continuous vs static, paged vs contiguous on the GPU (C7, C8, C9)
* speculative bundled target/draft pair, and prompt lookup on a large random-weight target (C10)
* kv_cache    bf16 vs int8 K/V: decode at batch 32 over 4096-token contexts, llama-3-8b shape
              (KV memory measured from the allocator; step time by graph replay and forward call;
              decode attention alone per layer). ``--kv-shape/--kv-batch/--kv-prompt/--kv-new``
              change the sizes (a CPU dry run: --kv-shape gpt2 --kv-batch 2 --kv-prompt 64 --kv-new 6).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import median_ms  # noqa: E402

from tinyinfer.bench import shapes as bs
from tinyinfer.bench.measure import measure_copy_bandwidth
from tinyinfer.bench import workloads as bench
from tinyinfer.model import load
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.torch_weights import random_weights
from tinyinfer.speculative import DraftModelDrafter, PromptLookupDrafter

SECTIONS = ("latency", "throughput", "batching", "speculative", "kv_cache")


def latency(results: dict, args: argparse.Namespace) -> None:
    bandwidth = measure_copy_bandwidth("cuda")
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    rows = []
    for name in ("gpt2", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3-8b"):
        model, peer = bs.shape_models(name, "cuda", "bfloat16", with_peer=name == "llama-3.2-1b")
        rows.append(bs.as_dict(bs.bench_latency(model, 512, 128, bandwidth=bandwidth)))
        if peer is not None:
            rows.append(bs.as_dict(bs.peer_latency(peer, model.config.vocab_size, 512, 128)))
        print(bs.latency_table([bs.LatencyResult(**r) for r in rows[-2 if peer else -1:]]), flush=True)
        del model, peer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    results["latency"] = rows


def throughput(results: dict, args: argparse.Namespace) -> None:
    model, peer = bs.shape_models("llama-3.2-1b", "cuda", "bfloat16", with_peer=True)
    workload = bs.offline_workload(256, model.config.vocab_size)
    ours = bs.bench_throughput(model, workload[:16], max_num_seqs=16)  # warm-up: compile, graphs
    ours = bs.bench_throughput(model, workload, max_num_seqs=256)
    theirs = bs.peer_throughput(peer, workload, batch_size=64)
    print(bs.throughput_table([ours, theirs]), flush=True)
    results["throughput"] = [bs.as_dict(ours), bs.as_dict(theirs)]


def batching(results: dict, args: argparse.Namespace) -> None:
    model, _ = bs.shape_models("llama-3.2-1b", "cuda", "bfloat16", max_len=1024)
    bench.bench_batching(model, num_requests=16, max_num_seqs=16)  # warm-up
    rows = bench.bench_batching(model, num_requests=200, max_num_seqs=16)
    print(bench.batching_table(rows), flush=True)
    results["batching"] = json.loads(bench.to_json(rows))


def speculative(results: dict, args: argparse.Namespace) -> None:
    rows = []
    target, draft = load("bundled", runner="torch"), load("bundled-draft", runner="torch")
    for k in (2, 4, 6):
        r = bench.bench_speculative(target, DraftModelDrafter(draft),
                                    bench.speculative_prompts(target, "continue"), 128, k)
        rows.append({"model": "bundled", **json.loads(bench.to_json(r))})
        print(rows[-1], flush=True)
    r = bench.bench_speculative(target, PromptLookupDrafter(),
                                bench.speculative_prompts(target, "rewrite"), 128, 4)
    rows.append({"model": "bundled", "task": "rewrite", **json.loads(bench.to_json(r))})
    print(rows[-1], flush=True)
    big, _ = bs.shape_models("llama-3-8b", "cuda", "bfloat16")
    r = bench.bench_speculative(big, PromptLookupDrafter(), bench.speculative_prompts(big, "rewrite", 4),
                                128, 4)
    rows.append({"model": "llama-3-8b (random)", "task": "rewrite", **json.loads(bench.to_json(r))})
    print(rows[-1], flush=True)
    results["speculative"] = rows


def cuda_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of fn() by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    return median_ms(fn, repeats, torch.device("cuda"))


def kv_cache(results: dict, args: argparse.Namespace) -> None:
    """bf16 and int8 K/V on the same random weights, one after the other in this process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    page = 16
    config, _ = bs.shape_config(args.kv_shape, args.kv_prompt + args.kv_new + page)
    bandwidth = measure_copy_bandwidth(device)
    rows = []
    for kv_cache_dtype in ("auto", "int8"):
        rows.append(decode_at_context(config, kv_cache_dtype, args.kv_batch, args.kv_prompt,
                                      args.kv_new, page, device, bandwidth))
        r = rows[-1]
        print(f"{args.kv_shape} K/V {r['kv_cache_dtype']}: batch {r['batch']}, context {r['context']}, "
              f"KV allocated {r['kv_allocated_bytes'] / 1e9:.2f} GB, step {r['graph_replay_ms']:.2f} ms "
              f"(replay) / {r['forward_ms']:.2f} ms (forward), roofline {r['roofline_ms']:.2f} ms, "
              f"attention {r['attention_us_per_layer']:.1f} us/layer", flush=True)
        gc.collect()  # the cache's graphs and the runner refer to each other
        if device == "cuda":
            torch.cuda.empty_cache()
    base, int8 = rows
    results["kv_cache"] = {
        "shape": args.kv_shape, "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows,
        "kv_memory_ratio": int8["kv_allocated_bytes"] / base["kv_allocated_bytes"],
        "step_speedup_replay": base["graph_replay_ms"] / int8["graph_replay_ms"],
        "step_speedup_forward": base["forward_ms"] / int8["forward_ms"],
        "attention_speedup": base["attention_us_per_layer"] / int8["attention_us_per_layer"],
    }


def decode_at_context(config, kv_cache_dtype: str, batch: int, prompt: int, new: int, page: int,
                      device: str, bandwidth: float) -> dict[str, Any]:
    """Prefill `batch` random prompts of `prompt` tokens one by one, then decode them together
    for `new` greedy steps (compiled, CUDA graphs: the runner's defaults); time the steps."""
    from tinyinfer.runners import torch_triton

    on_cuda = device == "cuda"
    runner = TorchRunner(config, random_weights(config, device, "bfloat16"), device=device,
                         dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    per_seq = math.ceil((prompt + new) / page)
    if on_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    kv = runner.new_kv_cache(batch * per_seq, page)
    tensor_bytes = sum(t.nbytes for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None)
    allocated = torch.cuda.memory_allocated() - before if on_cuda else tensor_bytes
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    tokens = []
    for b in range(batch):
        ids = rng.integers(0, config.vocab_size, prompt).tolist()
        top = runner.forward_top(make_batch([(ids, 0, tables[b], False)], page), kv, 1)
        tokens.append(int(top.ids[0, 0]))
    prefill_s = time.perf_counter() - t0
    step_ms, finite = [], True
    for i in range(new):
        entries = [([tokens[b]], prompt + i, tables[b], False) for b in range(batch)]
        t0 = time.perf_counter()
        top = runner.forward_top(make_batch(entries, page), kv, 1)  # greedy, as the engine asks
        step_ms.append(1e3 * (time.perf_counter() - t0))
        tokens = top.ids[:, 0].tolist()
        finite = finite and bool(np.isfinite(top.values).all() and np.isfinite(top.logsumexp).all())
    warm = min(3, new - 1)  # the first steps compile and capture
    replay_ms = attention_us = float("nan")
    if on_cuda and kv.graphs and 1 in kv.graphs:
        decode = kv.graphs[1]  # one token per sequence
        graph, _ = decode.graphs[decode.padded_size(batch)]
        replay_ms = cuda_ms(graph.replay, 20)  # the last step again: same K/V rewritten
        attention_us = attention_per_layer(runner, kv, torch_triton, batch, prompt + new - 1, tables, page)
    context = prompt + new // 2
    kv_read = batch * context * runner.info.kv_bytes_per_token(config)
    weights = runner.info.weight_bytes
    row = {
        "kv_cache_dtype": runner.kv_cache_dtype, "runner": runner.describe(), "batch": batch,
        "prompt": prompt, "new_tokens": new, "context": context,
        "kv_allocated_bytes": allocated, "kv_tensor_bytes": tensor_bytes,
        "kv_bytes_per_token": runner.info.kv_bytes_per_token(config), "weight_bytes": weights,
        "prefill_s": prefill_s, "forward_ms": statistics.median(step_ms[warm:]),
        "graph_replay_ms": replay_ms, "attention_us_per_layer": attention_us,
        "kv_bytes_read_per_step": kv_read, "roofline_ms": 1e3 * (weights + kv_read) / bandwidth,
        "tokens_per_s_replay": batch * 1e3 / replay_ms, "finite_logits": finite,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if on_cuda else 0,
    }
    kv.graphs = None
    return row


def attention_per_layer(runner: TorchRunner, kv, torch_triton, batch: int, position: int,
                        tables: list[list[int]], page: int) -> float:
    """The Triton decode attention alone: µs per layer, every layer's cache in turn (so L2 holds
    none), replayed from one CUDA graph; each call rewrites the last token's K/V."""
    c = runner.config
    device = runner.device
    gen = torch.Generator(device=device).manual_seed(3)
    qkv = torch.randn((batch, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim), generator=gen,
                      device=device, dtype=runner.dtype)
    positions = torch.full((batch,), position, device=device)
    table = torch.tensor(tables, device=device)
    slots = table[:, position // page] * page + position % page

    def layer(i: int) -> torch.Tensor:
        return torch_triton.paged_decode_attention(qkv, positions, slots, table, kv.k[i], kv.v[i],
                                                   runner.cos, runner.sin, c.num_heads,
                                                   **kv.layer_scales(i))

    for i in range(c.num_layers):  # compile the kernel for these shapes
        layer(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(c.num_layers):
            layer(i)
    return 1e3 * cuda_ms(graph.replay, 20) / c.num_layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--kv-shape", default="llama-3-8b", help="kv_cache: the preset shape")
    parser.add_argument("--kv-batch", type=int, default=32, help="kv_cache: sequences decoding")
    parser.add_argument("--kv-prompt", type=int, default=4096, help="kv_cache: prompt tokens")
    parser.add_argument("--kv-new", type=int, default=32, help="kv_cache: decode steps timed")
    args = parser.parse_args()
    out = Path(args.out) / "gpu_bench.json"
    results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "command": " ".join(sys.argv),
                     "date": time.strftime("%Y-%m-%d")}
    for section in args.only.split(","):
        start = time.perf_counter()
        print(f"== {section}", flush=True)
        try:
            globals()[section](results, args)
        except Exception:  # keep the other sections' numbers; record what failed
            results[f"{section}_error"] = traceback.format_exc()
            print(results[f"{section}_error"], file=sys.stderr, flush=True)
        results[f"{section}_seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
