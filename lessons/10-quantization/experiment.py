"""Lesson 10 experiment: weight memory by precision (C11); held-out quality of the bundled model
on your int8 and int4 weights (C12)."""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

import tinyinfer
from lessons.support import claim, heading, heldout_text, human_bytes, load_model, table
from tinyinfer.model import Model
from tinyinfer.simulate.memory import weight_group_size
from tinyinfer.simulate.model import model_preset, parameter_counts

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
GROUP = 128  # int4 weights per scale, the common default


def linear_names(m: Model) -> list[str]:
    """The transformer blocks' linear weights: what weight-only formats quantize."""
    return [f"layers.{i}.{name}.weight" for i in range(m.config.num_layers) for name in LINEARS]


def quantize_model(impl: ModuleType, m: Model, bits: int, group: int | None) -> tuple[int, float]:
    """Replace m's linear weights by the student's quantize -> dequantize.

    group None means one group per output row. Returns the bytes codes and scales take, and
    the relative error of all linear weights together, ||W - W'|| / ||W||.
    """
    stored, moved, norm = 0, 0.0, 0.0
    for name in linear_names(m):
        w = m.runner.w[name]  # [out, in]
        size = group or w.shape[1]
        codes, scales = impl.quantize(w, size, bits)
        stored += math.ceil(codes.size * bits / 8) + np.asarray(scales).nbytes
        m.runner.w[name] = np.asarray(impl.dequantize(codes, scales, size), dtype=w.dtype)
        moved += float(np.sum((m.runner.w[name] - w) ** 2))
        norm += float(np.sum(w.astype(np.float64) ** 2))
    return stored, math.sqrt(moved / norm)


def bits_per_byte(m: Model, ids: list[int], window: int) -> float:
    """Held-out next-token loss in bits per UTF-8 byte, over non-overlapping windows of tokens."""
    nats, nbytes = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        logits = m.logits(chunk[:-1]).astype(np.float64)  # [T, V]
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nats -= float(logp[np.arange(len(chunk) - 1), chunk[1:]].sum())
        nbytes += len(m.tokenizer.decode(chunk[1:]).encode("utf-8"))
    return nats / math.log(2) / nbytes


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Memory per precision for a 7B model and for the bundled one; quality on held-out text."""
    heading("C11: weight memory of Llama-2-7B, your weight_bytes")
    spec = model_preset("llama-2-7b")
    p = parameter_counts(spec)
    sizes = {bits: impl.weight_bytes(p.quantizable, p.kept, bits, weight_group_size(spec, precision, GROUP))
             for bits, precision in ((16, "bf16"), (8, "int8"), (4, "int4"))}
    print(table(("precision", "weights", "bits per parameter"),
                [(f"{bits}-bit" if bits == 16 else f"int{bits}", human_bytes(b), 8 * b / p.total)
                 for bits, b in sizes.items()]))
    print(f"{p.quantizable / p.total:.0%} of the parameters are quantized (the blocks' linear layers); "
          "embeddings, LM head and norms stay 16-bit")
    gb16, gb4 = sizes[16] / 1e9, sizes[4] / 1e9
    claim("C11", f"{gb16:.1f} GB at 16-bit, {gb4:.1f} GB at 4-bit (Llama-2-7B)",
          12 <= gb16 <= 16 and 3 <= gb4 <= 5,
          f"4 bits per weight plus an fp16 scale per {GROUP} weights ({16 / GROUP:.3f} bits), and 16-bit "
          "embeddings, head and norms")

    text = heldout_text(3000 if quick else 20000)
    window = 128 if quick else 256
    heading(f"C12: held-out bits per byte of the bundled model, {len(text):,} characters, windows of {window}")
    rows, scores = [], {}
    formats = (("float32 (reference)", None, None), ("int8 per row (yours)", 8, None),
               (f"int4 g{GROUP} (yours)", 4, GROUP), ("int4 per row (yours)", 4, None))
    for label, bits, group in formats:
        m = load_model(model)
        if bits:
            stored, error = quantize_model(impl, m, bits, group)
        else:
            stored, error = sum(m.runner.w[n].size * 2 for n in linear_names(m)), 0.0
        scores[label] = bits_per_byte(m, m.tokenizer.encode(text), window)
        rows.append((label, human_bytes(stored), f"{100 * error:.1f}%", scores[label]))
    engine_int4 = tinyinfer.load(model, quantize=f"int4-g{GROUP}")
    scores["engine"] = bits_per_byte(engine_int4, engine_int4.tokenizer.encode(text), window)
    rows.append((f"int4 g{GROUP} (the engine's)", "", "", scores["engine"]))
    base = scores["float32 (reference)"]
    print(table(("linear weights", "stored (float: at 16-bit)", "weight error", "bits per byte"),
                [(label, size, err, f"{bpb:.4f} ({100 * (bpb / base - 1):+.2f}%)") for label, size, err, bpb in rows]))
    yours = scores[f"int4 g{GROUP} (yours)"]
    print(f"your int4 and the engine's give {'the same' if abs(yours - scores['engine']) < 1e-6 else 'DIFFERENT'} "
          "bits per byte")
    loss = yours / base - 1
    coarse = scores["int4 per row (yours)"] / base - 1
    claim("C12", f"int4 in groups of {GROUP} changed held-out bits per byte by {100 * loss:+.2f}% (int8: "
          f"{100 * (scores['int8 per row (yours)'] / base - 1):+.2f}%, int4 per row: {100 * coarse:+.2f}%)",
          True if 0.05 <= loss <= 0.10 else (None if 0 < loss < 0.2 else False),
          "within the claimed range" if 0.05 <= loss <= 0.10 else
          "the weights moved (see the weight error column) but this model's predictions of unseen text "
          "hardly did: it tolerates that noise" if loss < 0.05 else
          "this model is more sensitive to 4-bit noise than the claim's rule of thumb")

if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
