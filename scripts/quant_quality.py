"""Held-out quality and size of a model in every weight format (claims C11, C12).

Scores the held-out works of the bundled model (see docs/model-card.md) with tinyinfer's own
runners, the same way scripts/train_bundled.py scores them with transformers: each work after
the end-of-text token, windows of `--context` tokens advancing by half a window.

    python scripts/quant_quality.py                      # every format, the full held-out text
    python scripts/quant_quality.py --max-bytes 20000    # a quick look
    python scripts/quant_quality.py --json results.json
    python scripts/quant_quality.py --model smollm2 --max-bytes 20000   # a real model's GGUF file

A GGUF file's rows: its weights as stored (Q4_1 kept as int4-g32-min), those weights as fp32
(dequantized: the float weights the file was made from are not in it), and tinyinfer's own
formats made from those fp32 weights. Rows named "+head" quantize the token embedding and LM head
too (``--quantize-head``; a GGUF file's as stored: its own Q8_0 embedding kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # bundled_corpus, and tinyinfer without installing it

import bundled_corpus as corpus  # noqa: E402
from bundled_eval import TextScore  # noqa: E402

import tinyinfer  # noqa: E402
import tinyinfer.config  # noqa: E402
import tinyinfer.model  # noqa: E402
from tinyinfer.quant import (  # noqa: E402
    QuantConfig,
    is_quantized_name,
    quantize_weights,
    save_quantized,
    weights_nbytes,
)
from tinyinfer.runners.numpy_ref import NumpyRunner  # noqa: E402
from tinyinfer.weights import load_weights  # noqa: E402

WEIGHT_FORMATS = ("int8", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym", "int4-g128-asym",
                  "int8+head", "int4-g128+head")
GGUF_FORMATS = ("int8", "int4-g32", "int4-g128", "int8+head", "int4-g128+head")


@dataclass(frozen=True)
class Row:
    """One format's held-out score and its bytes."""

    format: str
    runner: str
    nats: float
    tokens: int
    bytes: int
    linear_bytes: int  # the blocks' linear weights: codes + scales + zero points, or floats
    disk_bytes: int  # model.safetensors in this format
    kv_bytes_per_token: int  # K and V of one token, all layers
    seconds: float

    @property
    def bits_per_byte(self) -> float:
        return TextScore(self.nats, self.tokens, self.bytes).bits_per_byte

    @property
    def perplexity(self) -> float:
        return TextScore(self.nats, self.tokens, self.bytes).perplexity


def nll(logits: np.ndarray, targets: list[int]) -> float:
    """Summed negative log-likelihood in nats.  logits: [n, V], targets: n ids."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=-1))
    return float((log_z - x[np.arange(len(targets)), targets]).sum())


def score_work(model: tinyinfer.Model, ids: list[int], eot_id: int, context: int) -> float:
    """Nats to predict every token of one work after `<|endoftext|>`, in half-overlapping windows."""
    seq = [eot_id, *ids]
    stride = context // 2
    total = 0.0
    for first in range(1, len(seq), stride):
        end = min(first + stride, len(seq))  # score targets seq[first:end]
        window = seq[max(0, end - 1 - context):end - 1]
        total += nll(model.logits(window)[-(end - first):], seq[first:end])
    return total


def held_out_texts(max_bytes: int | None) -> list[str]:
    """The bundled model's held-out works, cleaned exactly as for training."""
    split = corpus.load_split(None, corpus.DEFAULT_TARBALL, corpus.DEFAULT_TEST_WORKS, corpus.DEFAULT_DEV_WORKS)
    texts = list(split.test.values())
    if max_bytes is not None:
        per_work = max_bytes // len(texts)
        texts = [t.encode("utf-8")[:per_work].decode("utf-8", errors="ignore") for t in texts]
    return texts


def gguf_variants(source: str) -> list[tuple[str, str, str, Callable[[], tinyinfer.Model]]]:
    """The rows of a GGUF file: as stored, dequantized to fp32, and requantized from that."""
    def requantized(fmt: str) -> tinyinfer.Model:
        model = tinyinfer.load(source, quantize="none")
        model.runner = NumpyRunner(model.config, quantize_weights(model.runner.w, QuantConfig.parse(fmt)))
        return model

    stored = tinyinfer.model.open_checkpoint(source).gguf.kept_format()
    rows: list[tuple[str, str, str, Callable[[], tinyinfer.Model]]] = [
        ("fp32", "fp32", "numpy", lambda: tinyinfer.load(source, quantize="none")),
        (f"GGUF as stored ({stored.name if stored else 'floats'})", "gguf", "numpy",
         lambda: tinyinfer.load(source)),
    ]
    if stored is not None:
        rows.append((f"GGUF as stored + head ({stored.name}+head)", "gguf", "numpy",
                     lambda: tinyinfer.load(source, quantize_head=True)))
    for fmt in GGUF_FORMATS:
        rows.append((fmt, fmt, "numpy", lambda fmt=fmt: requantized(fmt)))
    return rows


def linear_bytes(weights: dict) -> int:
    """Bytes of the blocks' linear weights as they are held (codes, scales, offsets; or floats)."""
    return weights_nbytes({name: w for name, w in weights.items() if is_quantized_name(name)})


def format_bytes(source: str, fmt: str, folder: Path) -> tuple[int, int]:
    """(linear-layer bytes, checkpoint bytes) of the model in a format, measured on written files.

    fp32 and bf16 checkpoints hold every tensor in that dtype; quantized ones keep their
    floats (embeddings, norms) in bf16, the bundled model's dtype.
    """
    path, _ = tinyinfer.model.resolve_source(source)
    config = tinyinfer.config.load_config(path)
    weights = load_weights(path, config)
    if fmt in ("fp32", "bf16"):
        folder.mkdir(parents=True)
        floats = {name: torch.from_numpy(np.array(w, np.float32)) for name, w in weights.items()}
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        save_file({name: w.to(dtype) for name, w in floats.items()}, str(folder / "model.safetensors"))
        linear = sum(dtype.itemsize * w.size for name, w in weights.items() if is_quantized_name(name))
    else:
        qconfig = QuantConfig.parse(fmt)
        quantized = quantize_weights(weights, qconfig)
        save_quantized(folder, quantized, qconfig, float_dtype="bfloat16")
        linear = linear_bytes(quantized)
    return linear, (folder / "model.safetensors").stat().st_size


def variants(source: str, runner: str) -> list[tuple[str, str, str, Callable[[], tinyinfer.Model]]]:
    """(row name, weight format, runner, loader) for every row of the table."""
    device = None if runner == "numpy" else "cpu"
    rows: list[tuple[str, str, str, Callable[[], tinyinfer.Model]]] = [
        ("fp32", "fp32", "numpy", lambda: tinyinfer.load(source)),
        ("bf16", "bf16", "torch", lambda: tinyinfer.load(source, runner="torch", device="cpu", dtype="bfloat16")),
    ]
    for fmt in WEIGHT_FORMATS:
        rows.append((fmt, fmt, runner, lambda fmt=fmt: tinyinfer.load(source, runner=runner, device=device,
                                                                      quantize=fmt)))

    rows.append(("fp32 + int8 KV", "fp32", "numpy", lambda: tinyinfer.load(source, kv_cache_dtype="int8")))
    rows.append(("int8 KV (torch)", "fp32", "torch", lambda: tinyinfer.load(source, runner="torch", device="cpu",
                                                                          kv_cache_dtype="int8")))
    return rows


def measure(source: str, runner: str, context: int, max_bytes: int | None, only: list[str] | None) -> list[Row]:
    """Score every variant on the same held-out ids."""
    texts = held_out_texts(max_bytes)
    base = tinyinfer.load(source)
    eot_id = base.eos_token_ids[0]
    works = [base.tokenizer.encode(t) for t in texts]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in works)
    c = base.config
    print(f"held-out: {len(texts)} works, {n_bytes:,} bytes, {n_tokens:,} tokens; context {context}",
          file=sys.stderr)
    rows = []
    is_gguf = base.path.suffix == ".gguf"
    with tempfile.TemporaryDirectory() as scratch:
        for name, fmt, runner_name, load in (gguf_variants(source) if is_gguf else variants(source, runner)):
            if only and name not in only:
                continue
            model = load()
            start = time.perf_counter()
            nats = sum(score_work(model, ids, eot_id, context) for ids in works)
            seconds = time.perf_counter() - start
            if is_gguf:  # the file is the only checkpoint: its size, for the row stored as it
                linear = linear_bytes(model.runner.w)
                disk = base.path.stat().st_size if fmt == "gguf" else 0
            else:
                linear, disk = format_bytes(source, fmt, Path(scratch) / name.replace(" ", "_"))
            kv = model.runner.info.kv_bytes_per_token(c)  # int8 K/V: codes plus float16 scales
            row = Row(name, runner_name, nats, n_tokens, n_bytes, linear, disk, kv, seconds)
            rows.append(row)
            print(f"{name:<16} {row.bits_per_byte:.4f} bits/byte  perplexity {row.perplexity:.3f}  "
                  f"({seconds:.0f} s)", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    """Markdown table: score, loss relative to fp32, bytes."""
    base = next((r for r in rows if r.format == "fp32"), rows[0])
    lines = ["| format | runner | bits/byte | perplexity | Δ bits/byte | Δ perplexity | "
             "linear weights | checkpoint | KV / token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d_bpb = r.bits_per_byte / base.bits_per_byte - 1
        d_ppl = r.perplexity / base.perplexity - 1
        lines.append(f"| {r.format} | {r.runner} | {r.bits_per_byte:.4f} | {r.perplexity:.3f} | "
                     f"{d_bpb:+.2%} | {d_ppl:+.2%} | {r.linear_bytes / 1e6:.2f} MB | "
                     f"{f'{r.disk_bytes / 1e6:.2f} MB' if r.disk_bytes else '–'} | "
                     f"{r.kv_bytes_per_token:,} B |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled",
                        help="model name, folder or GGUF file (default: bundled)")
    parser.add_argument("--runner", choices=("numpy", "torch"), default="numpy",
                        help="runner for the quantized rows (default: numpy, the reference)")
    parser.add_argument("--context", type=int, default=512, help="scoring window (default: 512)")
    parser.add_argument("--max-bytes", type=int, default=None, help="cut the held-out text (quick runs)")
    parser.add_argument("--only", nargs="+", default=None, help="score only these formats")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.runner, args.context, args.max_bytes, args.only)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**asdict(r), "bits_per_byte": r.bits_per_byte, "perplexity": r.perplexity} for r in rows],
            indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
