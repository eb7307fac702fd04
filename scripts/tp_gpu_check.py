"""Tensor parallelism on GPUs in one short invocation (2+ GPUs, NCCL).

    PYTHONPATH=. python3 scripts/tp_gpu_check.py --out DIR [--tp 2]

1. correctness: the bundled model at TP=N in float32 against one GPU (TP=1): logits and
   greedy tokens;
2. speed: batch-1 decode of the llama-3-8b shape (random weights, bf16) at TP=N, with each
   rank's all-reduce time from the step trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import tinyinfer
from tinyinfer.bench_shapes import shape_config
from tinyinfer.tp_launch import load_tensor_parallel, load_tensor_parallel_random


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                     "date": time.strftime("%Y-%m-%d"), "tp": args.tp}
    out = Path(args.out) / "tp_gpu_check.json"

    ref = tinyinfer.load("bundled", runner="torch", device="cuda", dtype="float32")
    tp = load_tensor_parallel("bundled", tensor_parallel=args.tp, device="cuda", dtype="float32")
    ids = ref.tokenizer.encode("ROMEO:\nO, she doth teach the torches to burn bright!")
    a, b = ref.logits(ids), tp.logits(ids)
    results["bundled_fp32_logits_rel_err"] = float(np.abs(a - b).max() / np.abs(a).max())
    greedy = tinyinfer.SamplingParams(temperature=0, max_tokens=48)
    same = [tinyinfer.Engine(ref).generate([p], greedy)[0].token_ids ==
            tinyinfer.Engine(tp).generate([p], greedy)[0].token_ids
            for p in ("ROMEO:", "JULIET:", "HAMLET:")]
    results["bundled_fp32_greedy_identical"] = all(same)
    tp.runner.close()
    print(results, flush=True)
    out.write_text(json.dumps(results, indent=2))

    config, _ = shape_config("llama-3-8b", 2048)
    big = load_tensor_parallel_random(config, tensor_parallel=args.tp, device="cuda",
                                      dtype="bfloat16", name="llama-3-8b")
    engine = tinyinfer.Engine(big, max_num_seqs=1, detail="none")
    rng = np.random.default_rng(0)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for run in range(2):
        engine.add_request(rng.integers(0, config.vocab_size, 512).tolist(), params)
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            trace = engine.step()
            steps.append((time.perf_counter() - t, trace.timings))
    decode = steps[1:]
    tpot = statistics.median(s for s, _ in decode)
    results["llama3_8b_tp_decode_tokens_per_s"] = 1 / tpot
    results["llama3_8b_tp_tpot_ms"] = 1e3 * tpot
    for rank in range(args.tp):
        results[f"rank{rank}_all_reduce_ms"] = 1e3 * statistics.median(
            t[f"rank{rank}_all_reduce"] for _, t in decode)
        results[f"rank{rank}_compute_ms"] = 1e3 * statistics.median(
            t[f"rank{rank}_compute"] for _, t in decode)
    big.runner.close()
    print(results, flush=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
