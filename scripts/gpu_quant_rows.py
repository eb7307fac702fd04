"""Decode steps of a few rows with int8 / int4 weights on a CUDA GPU: through the fused products'
row axis against the compiled functions, bf16 beside them.

    PYTHONPATH=. python3 scripts/gpu_quant_rows.py --out DIR    # DIR/gpu_quant_rows.json
        [--cases llama-3-8b:int8 llama-3-8b:bf16 ...]

For each preset shape and format (random codes, the LM head quantized too) a runner steps batches
of b sequences with q new tokens each (b = 1..8 at q = 1: decoding; q = 2 and 5 for one sequence:
a draft's catch-up, a verification of 4 guesses), each step captured once as a CUDA graph, then
replayed alone: the median of 50 replays timed with CUDA events. Where the fused products run,
``few1`` runs steps of two or more rows through the compiled functions (the unfused products,
whose matrix units take up to 16 rows a tile) and ``few8`` through the fused products (a program
per row, a tile's rows side by side) up to 8 rows; the runner's default is ``few_rows``
(torch_fast.QUANT_FEW_ROWS). bf16, and quantized layers that stay unfused, run their default.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_spec_bench import replay_ms  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.runners.runner import make_batch  # noqa: E402

CASES = (("llama-3.2-1b", "int4"), ("llama-3.2-1b", "int8"), ("llama-3-8b", "int8"), ("llama-3-8b", "int4"),
         ("llama-3-8b", None), ("llama-3.2-1b", None))
STEPS = ((1, 1), (1, 2), (2, 1), (3, 1), (1, 5), (4, 1), (8, 1))  # (sequences, tokens each)


def steps_ms(runner) -> dict:
    """Each STEPS batch's replay time on a fresh K/V cache (every sequence at position 100)."""
    kv = runner.new_kv_cache(64, 16)
    out = {}
    for seqs, tokens in STEPS:
        entries = [([3] * tokens, 100, list(range(i * 8, i * 8 + 8)), True) for i in range(seqs)]
        batch = make_batch(entries, 16)
        for _ in range(2):  # compile, then capture
            runner.launch_top(batch, kv, 1).result()
        graphs = kv.graphs[tokens]
        out[f"b{seqs}_q{tokens}_ms"] = replay_ms(graphs, graphs.padded_size(seqs))
    return out


def case(text: str) -> tuple[str, str | None]:
    """A --cases entry, "shape:format" ("llama-3-8b:int8"; bf16: unquantized) -> (shape, format)."""
    shape, colon, fmt = text.partition(":")
    if not colon or not shape or not fmt:
        raise argparse.ArgumentTypeError(f"{text!r}: expected shape:format, e.g. llama-3-8b:int8")
    return shape, None if fmt == "bf16" else fmt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="a folder (made if missing) for gpu_quant_rows.json")
    parser.add_argument("--cases", nargs="+", type=case, default=list(CASES),
                        help="shape:format pairs to run, bf16 for unquantized weights (default: CASES)")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "gpu_quant_rows.json"
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "date": time.strftime("%Y-%m-%d"), "rows": {}}
    for shape, fmt in args.cases:
        model, _ = bs.shape_models(shape, "cuda", "bfloat16", quantize=fmt, quantize_head=fmt is not None)
        runner = model.runner
        label = f"{shape} {fmt + '+head' if fmt else 'bf16'}"
        row = {"decode_products": runner.decode_products, "few_rows": runner.few_rows}
        # few8 differs from few1 only where the fused products run (not the unfused 8B int4 layers)
        for few in ((1, 8) if fmt and runner.decode_products == "triton" else (runner.few_rows,)):
            runner.few_rows = few
            row[f"few{few}"] = steps_ms(runner)
            gc.collect()
            torch.cuda.empty_cache()
        results["rows"][label] = row
        print(label, json.dumps(row), flush=True)
        path.write_text(json.dumps(results, indent=2))
        del model, runner
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
