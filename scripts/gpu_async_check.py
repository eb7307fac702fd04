"""Asynchronous scheduling on a GPU: same tokens, and how close the engine comes to graph replay.

    PYTHONPATH=. python3 scripts/gpu_async_check.py --out $OUT [--shapes llama-3.2-1b,llama-3-8b] [--device cpu]

Per preset shape (random bf16 weights, one model per shape, everything in one process):

* check    greedy tokens with and without async scheduling, batch 1 and batch 4 (lengths
           differ, EOS ignored: both engines run the same batches), must be identical;
* latency  ``bench latency`` (prompt 128, 128 new tokens, 3 runs after a warm-up) without and
           with async scheduling: TPOT, tok/s and the device-idle share of wall time;
* replay   the runner's captured batch-1 decode graph replayed alone at the mean context
           (CUDA events, median of 50): the ceiling the engine's decode loop can reach.

Writes OUT/gpu_async_check.json after each part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import median_ms  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.bench.measure import measure_copy_bandwidth  # noqa: E402
from tinyinfer.engine import Engine  # noqa: E402
from tinyinfer.sampling import SamplingParams  # noqa: E402

PROMPT, NEW = 128, 128


def check(model, rng: np.random.Generator) -> dict:
    """Greedy tokens of the step-through engine and the asynchronous one, batch 1 and 4."""
    prompts = [rng.integers(0, model.config.vocab_size, int(n)).tolist() for n in (128, 40, 77, 9)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (48, 20, 33, 41)]
    outputs = {}
    for flag in (False, True):
        engine = Engine(model, detail="none", async_scheduling=flag)
        alone = engine.generate(prompts[:1], params[:1])
        together = engine.generate(prompts, params)
        outputs[flag] = [c.token_ids for c in alone + together]
    return {"identical": outputs[False] == outputs[True],
            "rows_equal": [a == b for a, b in zip(outputs[False], outputs[True])],
            "tokens": sum(len(t) for t in outputs[False])}


def replay(model) -> dict:
    """One request through the engine up to the mean context, then its batch-1 graph alone."""
    engine = Engine(model, detail="none", max_num_seqs=1)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, PROMPT).tolist()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW // 2, ignore_eos=True))
    decode = engine.kv_cache.graphs[1]  # one token per sequence
    graph, _ = decode.graphs[1]
    for _ in range(3):
        graph.replay()
    ms = median_ms(graph.replay, 50, torch.device("cuda"))
    return {"graph_replay_ms": ms, "tokens_per_s": 1e3 / ms, "context": PROMPT + NEW // 2}


def measure_shape(shape: str, device: str, bandwidth: float, results: dict, out: Path) -> None:
    """Every part for one preset shape, into results[shape], written out after each part."""
    row = results[shape]
    on_cuda = device == "cuda"
    model, _ = bs.shape_models(shape, device, "bfloat16" if on_cuda else "float32")
    parts = {
        "check": lambda: check(model, np.random.default_rng(0)),
        "latency_sync": lambda: bs.as_dict(bs.bench_latency(model, PROMPT, NEW, bandwidth)),
        "latency_async": lambda: bs.as_dict(bs.bench_latency(model, PROMPT, NEW, bandwidth,
                                                             async_scheduling=True)),
    }
    if on_cuda:
        parts["replay"] = lambda: replay(model)
    for name, part in parts.items():
        start = time.perf_counter()
        try:
            row[name] = part()
        except Exception:  # keep the other parts' numbers; record what failed
            row[name] = {"error": traceback.format_exc()}
        row[name + "_seconds"] = time.perf_counter() - start
        print(shape, name, json.dumps(row[name])[:600], flush=True)
        out.write_text(json.dumps(results, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run (no graphs to replay)")
    args = parser.parse_args()
    out = Path(args.out) / "gpu_async_check.json"
    on_cuda = args.device == "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if on_cuda else "cpu", "torch": torch.__version__,
                     "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    bandwidth = measure_copy_bandwidth(args.device)
    results["copy_bandwidth_bytes_per_s"] = bandwidth
    for shape in args.shapes.split(","):
        results[shape] = {}
        measure_shape(shape, args.device, bandwidth, results, out)
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
