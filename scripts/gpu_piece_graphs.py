"""Steps that no decode graph replays, with and without the layers' pieces (``torch_pieces``).

On one CUDA GPU, for each shape and format: a prompt's prefill of each token count (its last
row's logits), a draft model's catch-up on a prompt followed by greedy rounds (``launch_rounds``,
which takes such a step first), and a mixed step (a prompt's chunk beside decoding sequences).
Each runs with the pieces (the default) and without them (the layers launched one kernel at a
time, as before), in the same process: the logits of the two (largest difference relative to
the largest logit, and whether each row's argmax agrees), the median time the host takes to
launch the step and the time to its result, and the first call's time (compilation; with the
pieces, of the first such step of the process, every size's capture).

    PYTHONPATH=. python3 scripts/gpu_piece_graphs.py --out DIR [--cases llama-3-8b:bf16 ...]

A case is shape:format, the format bf16, int8, int4, int8+head or int4+head. Writes
DIR/piece_graphs.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tinyinfer.bench import shapes
from tinyinfer.runners.runner import Rounds, make_batch

PAGE = 16
CASES = ("llama-3-8b:bf16", "llama-3.2-1b:int4+head", "llama-3.2-1b:bf16")
TOKENS = (16, 17, 64, 128, 500)
FORMATS = ("bf16", "int8", "int4", "int8+head", "int4+head")


def timed(launch: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median ms from the call to its return (the host's launch) and to its result."""
    host, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        future = launch()
        launched = time.perf_counter()
        future.result()
        done = time.perf_counter()
        host.append(launched - start)
        wall.append(done - start)
    return {"host_ms": 1e3 * float(np.median(host)), "wall_ms": 1e3 * float(np.median(wall))}


def compare(ours: np.ndarray, eager: np.ndarray) -> dict[str, float | bool]:
    scale = float(np.abs(eager).max())
    return {"max_rel_diff": float(np.abs(ours - eager).max() / scale),
            "argmax_equal": bool((ours.argmax(-1) == eager.argmax(-1)).all())}


def checked_case(text: str) -> str:
    """A --cases entry, refused in one line unless it is shape:format with a format named above."""
    shape, colon, fmt = text.partition(":")
    if not (shape and colon and fmt in FORMATS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected shape:format, the format one of {', '.join(FORMATS)}")
    return text


def measure(case: str, repeats: int) -> dict[str, Any]:
    shape, fmt = case.split(":")
    quantize = None if fmt == "bf16" else fmt.removesuffix("+head")
    model, _ = shapes.shape_models(shape, "cuda", "bfloat16", quantize=quantize,
                                   quantize_head=fmt.endswith("+head"))
    runner = model.runner
    own = runner._piece_graphs

    def pieces(on: bool) -> None:
        runner._piece_graphs = own if on else (lambda rows: None)

    kv = runner.new_kv_cache(128, PAGE)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, 600).tolist()
    out: dict[str, Any] = {"case": case, "runner": runner.describe()}

    def both(name: str, launch: Callable[[], Any], logits: Callable[[], np.ndarray] | None) -> None:
        row: dict[str, Any] = {}
        results = {}
        for on in (False, True):
            pieces(on)
            torch.cuda.synchronize()
            start = time.perf_counter()
            launch().result()  # compile; with the pieces, the first step captures every size
            row["first_call_ms_" + ("pieces" if on else "eager")] = 1e3 * (time.perf_counter() - start)
            for _ in range(2):
                launch().result()
            row["pieces" if on else "eager"] = timed(launch, repeats)
            if logits is not None:
                results[on] = logits()
        pieces(True)
        if results:
            row["check"] = compare(results[True], results[False])
        row["host_speedup"] = row["eager"]["host_ms"] / row["pieces"]["host_ms"]
        row["wall_speedup"] = row["eager"]["wall_ms"] / row["pieces"]["wall_ms"]
        out[name] = row
        print(case, name, json.dumps(row), flush=True)

    with torch.no_grad():
        for tokens in TOKENS:
            pages = list(range(-(-tokens // PAGE)))
            batch = make_batch([(ids[:tokens], 0, pages, False)], PAGE)
            both(f"prefill_{tokens}", lambda b=batch: runner.launch_top(b, kv, 1),
                 lambda b=batch: runner.forward(b, kv))
        # a draft's catch-up on a 17-token prompt, then 3 greedy rounds (the speculative bench's)
        catch_up = make_batch([(ids[:17], 0, [0, 1, 2], False)], PAGE)
        rounds = Rounds(np.array([[17], [18], [19]]), np.array([[17], [18], [19]]))
        both("catch_up_17_then_3_rounds", lambda: runner.launch_rounds(catch_up, kv, rounds), None)
        # a 100-token chunk beside four decoding sequences (their 16-token prompts prefilled first)
        decoders = [(ids[100 + 16 * s:116 + 16 * s], 0, [40 + 2 * s, 41 + 2 * s], False) for s in range(4)]
        runner.forward(make_batch(decoders, PAGE), kv)
        mixed = make_batch([(ids[:100], 0, list(range(7)), False)]
                           + [([ids[300 + s]], 16, [40 + 2 * s, 41 + 2 * s], False) for s in range(4)], PAGE)
        both("mixed_100_plus_4_decodes", lambda: runner.launch_top(mixed, kv, 1),
             lambda: runner.forward(mixed, kv))
    del model, runner, kv
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="+", type=checked_case, default=list(CASES),
                        help="shape:format, e.g. llama-3-8b:bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_piece_graphs: needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cases": [measure(case, args.repeats) for case in args.cases]}
    (args.out / "piece_graphs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
