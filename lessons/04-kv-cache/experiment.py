"""Lesson 04 experiment: recompute vs KV cache as the output grows (C3); the cache's size (C4)."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

from lessons.support import (
    LLAMA2_70B, claim, heading, heldout_text, human_bytes, load_model, table, track,
)
from tinyinfer.config import config_from_dict

T = TypeVar("T")


def best_of(repeats: int, fn: Callable[[], T]) -> tuple[float, T]:
    """The shortest wall time of fn() over repeats (a busy machine only ever adds time), and its result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Time the student's two loops for growing n; evaluate their formula on real and published configs."""
    m = load_model(model)
    prompt = m.tokenizer.encode(heldout_text(2000))[:16]

    heading(f"your two loops on {m.name}, after a {len(prompt)}-token prompt (best of 2 runs)")
    rows, ratios = [], []
    for n in track((8, 16, 32) if quick else (8, 16, 32, 64, 128), "generation lengths"):
        slow, (slow_tokens, slow_work) = best_of(2, lambda: impl.generate_recompute(m, prompt, n))
        fast, (fast_tokens, fast_work) = best_of(2, lambda: impl.generate_cached(m, prompt, n))
        ratios.append(slow / fast)
        rows.append((n, slow_work, fast_work, f"{1e3 * slow:.0f} ms", f"{1e3 * fast:.0f} ms",
                     f"{slow / fast:.1f}x", "yes" if slow_tokens == fast_tokens else "NO"))
    print(table(("new tokens N", "computed: recompute", "computed: cache", "time: recompute",
                 "time: cache", "ratio", "same tokens"), rows))
    n_max, work_ratio = rows[-1][0], rows[-1][1] / rows[-1][2]
    # The verdict rests on the count (what C3 says: N reprocessings); the time shows what it costs here.
    grows = work_ratio > 1.5 * rows[0][1] / rows[0][2]
    claim("C3", f"for N={n_max}, recompute computed {rows[-1][1]:,} tokens vs {rows[-1][2]:,} with the "
          f"cache ({work_ratio:.0f}x, {rows[0][1] / rows[0][2]:.0f}x at N={rows[0][0]}) and took "
          f"{ratios[-1]:.1f}x the time ({ratios[0]:.1f}x at N={rows[0][0]})", grows,
          "each new token re-reads the whole sequence, so the waste grows with N"
          if grows else "the recomputed work did not grow with N")
    if ratios[-1] < work_ratio / 2:
        print(f"      note: time grew less than work ({ratios[-1]:.1f}x vs {work_ratio:.0f}x): recomputing "
              "N tokens is one parallel (prefill-like) pass, far cheaper per token than a decode step.")

    heading("KV cache size: your formula")
    big = config_from_dict(LLAMA2_70B)
    no_gqa = config_from_dict({**LLAMA2_70B, "num_key_value_heads": LLAMA2_70B["num_attention_heads"]})
    c = m.config
    rows = [("Llama-2-70B (GQA, 8 KV heads)", "32,768", "16-bit", human_bytes(impl.kv_cache_bytes(big, 32768, 2))),
            ("same without GQA (64 KV heads)", "32,768", "16-bit", human_bytes(impl.kv_cache_bytes(no_gqa, 32768, 2))),
            (f"{m.name} ({c.num_kv_heads} KV heads)", f"{c.max_model_len:,}", "float32",
             human_bytes(impl.kv_cache_bytes(c, c.max_model_len, 4)))]
    print(table(("model", "tokens", "precision", "KV cache"), rows))

    pages, block = 8, 16
    kv = m.runner.new_kv_cache(pages, block)
    allocated = sum(a.nbytes for a in kv.k + kv.v)
    predicted = impl.kv_cache_bytes(c, pages * block, 4)
    print(f"the engine's storage for {pages * block} tokens of {m.name}: {allocated:,} bytes allocated, "
          f"your formula says {predicted:,} ({'equal' if allocated == predicted else 'DIFFERENT'})")
    gb = impl.kv_cache_bytes(big, 32768, 2) / 1e9
    per_token = impl.kv_cache_bytes(big, 1, 2)
    claim("C4", f"{gb:.1f} GB for Llama-2-70B at 32K tokens, 16-bit", 10 <= gb <= 20,
          f"{big.num_layers} layers x {big.num_kv_heads} KV heads x {big.head_dim} dims x 2 (K and V) "
          f"x 2 bytes = {per_token / 1e3:.0f} KB per token; without GQA it would be {big.num_heads // big.num_kv_heads}x larger")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
