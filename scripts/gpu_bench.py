"""Every GPU benchmark of the engine in one invocation (for a lent H100/H200).

    PYTHONPATH=. python3 scripts/gpu_bench.py --out $OUT [--only latency,throughput,...]

Sections (each writes its results to OUT/gpu_bench.json as soon as it finishes, so a run cut
short keeps what it measured):

* latency     batch-1 TTFT / TPOT / % of memory roofline for the bench presets (C2, C6, C14)
* throughput  256 requests, lengths uniform in 100..1024, vs transformers generate (C13)
* batching    continuous vs static, paged vs contiguous on the GPU (C7, C8, C9)
* speculative bundled target/draft pair, and prompt lookup on a large random-weight target (C10)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from tinyinfer.bench import shapes as bs
from tinyinfer.bench.measure import measure_copy_bandwidth
from tinyinfer.bench import workloads as bench
from tinyinfer.model import load
from tinyinfer.speculative import DraftModelDrafter, PromptLookupDrafter

SECTIONS = ("latency", "throughput", "batching", "speculative")


def latency(results: dict) -> None:
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


def throughput(results: dict) -> None:
    model, peer = bs.shape_models("llama-3.2-1b", "cuda", "bfloat16", with_peer=True)
    workload = bs.offline_workload(256, model.config.vocab_size)
    ours = bs.bench_throughput(model, workload[:16], max_num_seqs=16)  # warm-up: compile, graphs
    ours = bs.bench_throughput(model, workload, max_num_seqs=256)
    theirs = bs.peer_throughput(peer, workload, batch_size=64)
    print(bs.throughput_table([ours, theirs]), flush=True)
    results["throughput"] = [bs.as_dict(ours), bs.as_dict(theirs)]


def batching(results: dict) -> None:
    model, _ = bs.shape_models("llama-3.2-1b", "cuda", "bfloat16", max_len=1024)
    bench.bench_batching(model, num_requests=16, max_num_seqs=16)  # warm-up
    rows = bench.bench_batching(model, num_requests=200, max_num_seqs=16)
    print(bench.batching_table(rows), flush=True)
    results["batching"] = json.loads(bench.to_json(rows))


def speculative(results: dict) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=",".join(SECTIONS))
    args = parser.parse_args()
    out = Path(args.out) / "gpu_bench.json"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d")}
    for section in args.only.split(","):
        start = time.perf_counter()
        print(f"== {section}", flush=True)
        try:
            globals()[section](results)
        except Exception:  # keep the other sections' numbers; record what failed
            results[f"{section}_error"] = traceback.format_exc()
            print(results[f"{section}_error"], file=sys.stderr, flush=True)
        results[f"{section}_seconds"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
