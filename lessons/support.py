"""What experiments and checkers share: models, held-out text, claims, timing, small tables."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import tinyinfer
from tinyinfer.config import config_from_dict
from tinyinfer.display.progress import track  # noqa: F401  (experiments count their loops with it)
from tinyinfer.display.tables import human_bytes, table  # noqa: F401  (experiments print with them)
from tinyinfer.model import BUNDLED, Model
from tinyinfer.runners.numpy_ref import NumpyRunner

DATA = Path(__file__).parent / "data"

# The field's claims (paraphrased from the project's claim list) that lessons measure.
CLAIMS = {
    "C1": "prefill handles the prompt in parallel and is compute-bound; it sets time-to-first-token",
    "C2": "decode makes one token per step and is memory-bandwidth-bound; it sets tokens/s",
    "C3": "without a KV cache, generating N tokens reprocesses the sequence N times",
    "C4": "a 70B model's KV cache at 32K tokens of context takes 10-20 GB",
    "C5": "a good interactive time-to-first-token is 200-500 ms; over 2 s feels slow",
    "C6": "decode speed: 5-15 tok/s on CPU, 30-80 on a consumer GPU, 100+ on a datacenter GPU",
    "C7": "batching multiplies total throughput: 50 tok/s for one user becomes ~500 tok/s for 20",
    "C8": "continuous batching gives 2-4x the throughput of static batching",
    "C9": "contiguous KV pre-allocation wastes 60-80% of the memory; paging brings it under 5%",
    "C10": "speculative decoding with a well-matched draft is 2-3x faster with the same output",
    "C11": "a 7B model needs ~14 GB at 16-bit and ~4 GB at 4-bit",
    "C12": "4-bit quantization loses roughly 5-10% quality",
    "C14": "one H100 gives ~40 tok/s to one request and serves 20+ users at acceptable latency",
    "C15": "a 70B model costs about 10x the compute per token of a 7B model",
    "C16": "output tokens cost more than input tokens: decode is serial, prefill parallel",
    "C17": "prefix caching avoids reprocessing a shared system prompt",
    "C19": "English text is about 3-4 characters per token",
    "C20": "self-hosting pays off only above some utilisation",
}


# Published config.json fields of two checkpoints the claims talk about.
LLAMA2_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "vocab_size": 32000, "max_position_embeddings": 4096}
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000, "max_position_embeddings": 4096}


class LessonError(Exception):
    """Something a student can fix (a missing model, an unfinished exercise): said plainly."""


def claim(claim_id: str, measured: str, agrees: bool | None, why: str = "") -> None:
    """Print a measurement next to the claim it tests, and whether they agree."""
    verdict = {True: "agrees", False: "DISAGREES", None: "partly agrees"}[agrees]
    print(f"\n[{claim_id}] claim:    {CLAIMS[claim_id]}")
    print(f"      measured: {measured}")
    print(f"      verdict:  {verdict}" + (f" -- {why}" if why else ""))


def heading(text: str) -> None:
    """Print a section heading."""
    print(f"\n== {text} ==")


# ---------------------------------------------------------------- models and text


def load_model(name: str = "bundled", runner: str = "numpy") -> Model:
    """Load a model for an experiment, or say plainly why the bundled one is missing."""
    folder = BUNDLED.get(name)
    if folder is not None and not (folder / "config.json").is_file():
        raise LessonError(
            f"the bundled model '{name}' is not installed ({folder} has no config.json). "
            "Reinstall tinyinfer, or pass --model with a Hugging Face Llama-family folder.")
    return tinyinfer.load(name, runner=runner)


def draft_name(model: str) -> str | None:
    """The draft model that goes with a target: bundled-draft, or a sibling '<folder>-draft'."""
    if model == "bundled":
        return "bundled-draft" if (BUNDLED["bundled-draft"] / "config.json").is_file() else None
    sibling = Path(f"{str(model).rstrip('/')}-draft")
    return str(sibling) if (sibling / "config.json").is_file() else None


def heldout_text(max_chars: int | None = None) -> str:
    """Shakespeare the bundled model never trained on: Macbeth and Twelfth Night, from Act I.

    Cleaned like the training text (speaker lines as "NAME:"); cut at a line end.
    """
    text = (DATA / "heldout.txt").read_text(encoding="utf-8")
    if max_chars is not None and len(text) > max_chars:
        text = text[: text.rindex("\n", 0, max_chars) + 1]
    return text


def tiny_config(vocab_size: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, max_len: int = 256):
    """A small Llama-shaped ModelConfig for checkers: every feature, seconds to run."""
    return config_from_dict({
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_len, "tie_word_embeddings": False,
    })


def tiny_model(seed: int = 0, **config: Any) -> Model:
    """A random Llama on the reference runner, built in memory (no files, no tokenizer)."""
    c = tiny_config(**config)
    rng = np.random.default_rng(seed)
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"embed": (c.vocab_size, d), "final_norm.weight": (d,), "lm_head": (c.vocab_size, d)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
                       p + "q.weight": (q, d), p + "k.weight": (kv, d), p + "v.weight": (kv, d),
                       p + "o.weight": (d, q), p + "gate.weight": (f, d), p + "up.weight": (f, d),
                       p + "down.weight": (d, f)})
    weights = {name: (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                      else rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
               for name, shape in shapes.items()}
    weights["embed"] *= math.sqrt(d)
    return Model(config=c, runner=NumpyRunner(c, weights), path=Path("."), name="tiny")


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Spread:
    """One quantity measured several times: its median and its range (a busy machine widens it)."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def said(self, fmt: str = ".2f", unit: str = "") -> str:
        """'1.23x (1.10-1.31 over 3 runs)'."""
        return (f"{self.median:{fmt}}{unit} ({self.low:{fmt}}-{self.high:{fmt}}{unit} over "
                f"{len(self.values)} runs)")


def ratios(num: Spread, den: Spread) -> Spread:
    """num / den run by run: repeats that ran side by side shared the machine's mood."""
    return Spread(tuple(a / b for a, b in zip(num.values, den.values)))


def busy_warning() -> str | None:
    """A warning when other work keeps this machine's cores busy, so timings run slow and noisy."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # not measurable here (Windows has no load average)
        return None
    if load <= 0.75 * cores:
        return None
    return (f"warning: this machine is busy (load average {load:.1f} on {cores} cores): times below "
            "are slower and noisier than on a quiet machine. Verdicts rest on counts (passes, "
            "steps, bytes) where a count exists; times are medians of repeated runs.")


def median_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (the machine may be busy)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_machine() -> tuple[float, float]:
    """This machine's float32 matmul FLOP/s and memory bandwidth (bytes/s), measured now."""
    n = 1024
    a = np.ones((n, n), np.float32)
    flops = 2 * n ** 3 / median_seconds(lambda: a @ a, 3)
    src = np.ones(32 * 2 ** 20, np.float32)  # 128 MB: larger than the caches
    dst = np.empty_like(src)
    bandwidth = 2 * src.nbytes / median_seconds(lambda: np.copyto(dst, src), 3)  # read + write
    return flops, bandwidth


@contextmanager
def plugged(target: Any, name: str, value: Any) -> Iterator[None]:
    """Put ``value`` in the place of ``target.name`` inside the block: how student code joins the
    engine. Only at a plug point the stage declares (its ``PLUG_POINTS``: functions it calls by
    name), so a refactor of the engine fails here, loudly, rather than leaving the student's code
    silently unused."""
    if name not in target.PLUG_POINTS:
        raise LessonError(f"{target.__name__}.{name} is not a plug point of the engine "
                          f"(those are {', '.join(target.PLUG_POINTS)}): the course and the engine "
                          "are out of step; reinstall tinyinfer")
    saved = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, saved)
