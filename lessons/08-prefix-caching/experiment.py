"""Lesson 08 experiment: the engine's prefix cache runs on your page keys; TTFT with and without a hit (C17)."""

from __future__ import annotations

from types import ModuleType

import tinyinfer
from lessons.support import (
    claim,
    heading,
    heldout_text,
    load_model,
    plugged,
    table,
    track,
)
from tinyinfer import kv

BLOCK = 16


def first_token(engine: tinyinfer.Engine, prompt: list[int]) -> tuple[float, int]:
    """Time to first token (seconds) and prompt tokens served from the cache, for one request."""
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    done = engine.release(rid)
    return done.metrics.ttft, done.metrics.cached_tokens


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """For growing shared system prompts: TTFT cold vs after a previous request, on the student's keys."""
    m = load_model(model)
    ids = m.tokenizer.encode(heldout_text(12000))
    question_a, question_b = ids[-40:-20], ids[-20:]
    repeats = 2 if quick else 3
    sizes = (64, 256) if quick else (64, 256, 512, 896)

    heading(f"a shared system prompt, then a {len(question_b)}-token question (best of {repeats})")
    rows, speedups = [], []
    with plugged(kv, "page_hash", impl.page_key):
        for size in track(sizes, "system prompt sizes"):
            system = ids[:size]
            miss = min(first_token(tinyinfer.Engine(m, page_size=BLOCK), system + question_b)[0]
                       for _ in range(repeats))
            hits, cached = [], 0
            for _ in range(repeats):
                warm = tinyinfer.Engine(m, page_size=BLOCK)
                first_token(warm, system + question_a)  # someone asked before, with the same system prompt
                ttft, cached = first_token(warm, system + question_b)
                hits.append(ttft)
            hit = min(hits)
            seen = set(impl.prefix_keys(system + question_a, BLOCK))
            predicted = impl.reusable_tokens(system + question_b, seen, BLOCK)
            speedups.append(miss / hit)
            rows.append((size, f"{1e3 * miss:.0f} ms", f"{1e3 * hit:.0f} ms", f"{miss / hit:.1f}x",
                         cached, predicted))
    print(table(("system tokens", "TTFT cold", "TTFT cached", "speedup", "cached (engine)",
                 "cached (your prediction)"), rows))
    grows = speedups[-1] > speedups[0]
    faster = all(s > 1 for s in speedups)
    verdict = (True if grows else None) if faster else False
    claim("C17", f"TTFT {rows[-1][1]} cold vs {rows[-1][2]} with a {sizes[-1]}-token system prompt cached "
          f"({speedups[-1]:.1f}x); speedup {speedups[0]:.1f}x at {sizes[0]} tokens", verdict,
          "a hit skips the shared pages' prefill: only the question's tokens are computed, so the longer "
          "the shared prefix, the bigger the saving" if faster else
          "the measured TTFTs are within noise of each other; run without --quick")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
