"""Lesson 13 experiment: your chunked prefill on the bundled model; then what a step's token
budget does to the requests decoding when a long prompt arrives."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import ModuleType

import numpy as np

import tinyinfer
from lessons.support import Spread, heading, heldout_text, load_model, table
from tinyinfer.model import Model
from tinyinfer.trace import StepTrace

REPEATS = 3  # timed runs per budget, interleaved


@dataclass(frozen=True)
class Arrival:
    """One run: three requests decoding, a long prompt arriving at step 3."""

    traces: tuple[StepTrace, ...]
    long_id: str
    seconds: tuple[float, ...]  # wall time of each step
    outputs: tuple[tuple[int, ...], ...]  # every request's tokens, in arrival order


def arrival(m: Model, decoders: list[list[int]], long_prompt: list[int], budget: int,
            new_tokens: int) -> Arrival:
    engine = tinyinfer.Engine(m, max_num_batched_tokens=budget, enable_prefix_caching=False)
    keep = tinyinfer.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rids = [engine.add_request(prompt, keep) for prompt in decoders]
    traces, seconds, long_id = [], [], ""
    while engine.has_unfinished():
        if len(traces) == 3:
            long_id = engine.add_request(long_prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True))
        start = time.perf_counter()
        traces.append(engine.step())
        seconds.append(time.perf_counter() - start)
    outputs = tuple(tuple(engine.completion(r).token_ids) for r in [*rids, long_id])
    return Arrival(tuple(traces), long_id, tuple(seconds), outputs)


def facts(run: Arrival) -> dict[str, float]:
    """From the traces: the largest step a decoding request waited on and the long prompt's
    steps to first token; from the clock: the longest gap between two tokens of a decoding
    request, and the long prompt's time to first token."""
    decoding = [i for i, t in enumerate(run.traces) if any(p.kind == "decode" for p in t.seqs)]
    arrived = next(i for i, t in enumerate(run.traces) if any(p.request_id == run.long_id for p in t.seqs))
    first = next(i for i, t in enumerate(run.traces)
                 if any(p.request_id == run.long_id and p.token_id is not None for p in t.seqs))
    return {"largest step": max(run.traces[i].num_batched_tokens for i in decoding),
            "steps to first token": first - arrived + 1,
            "longest gap": max(run.seconds[i] for i in decoding),
            "ttft": sum(run.seconds[arrived:first + 1])}


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Your chunked prefill against one pass; then a long prompt with a large and a small budget."""
    m = load_model(model)
    ids = m.tokenizer.encode(heldout_text(20000))
    long_len, new_tokens = (128, 12) if quick else (768, 24)

    heading(f"your prefill_chunked on the bundled model: a {long_len}-token passage")
    prompt = ids[:long_len]
    whole = m.logits(prompt)[-1]
    rows = []
    for chunk in (16, 64, 256):
        got = impl.prefill_chunked(m, prompt, chunk)
        rows.append((chunk, len(impl.chunk_ranges(long_len, chunk)), f"{float(np.abs(got - whole).max()):.1e}",
                     "yes" if int(np.argmax(got)) == int(np.argmax(whole)) else "NO"))
    print(table(("chunk", "forward passes", "largest logit difference from one pass", "same next token"), rows))

    budgets = (long_len + 64, 64)
    heading(f"3 requests decoding; a {long_len}-token prompt arrives at step 4 (budgets {budgets[0]} "
            f"and {budgets[1]} tokens per step, each run {REPEATS} times)")
    decoders = [ids[2000 + 100 * i:2000 + 100 * i + 16] for i in range(3)]
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in budgets}
    outputs = set()
    for _ in range(REPEATS):
        for b in budgets:
            done = arrival(m, decoders, ids[:long_len], b, new_tokens)
            runs[b].append(facts(done))
            outputs.add(done.outputs)
    rows = []
    for b in budgets:
        first = runs[b][0]  # the counts are the same in every repeat
        plan = impl.prefill_per_step(long_len, 3, b)
        gap = Spread(tuple(r["longest gap"] for r in runs[b]))
        ttft = Spread(tuple(r["ttft"] for r in runs[b]))
        rows.append((b, int(first["largest step"]), int(first["steps to first token"]), len(plan),
                     f"{1e3 * gap.median:.0f} ms ({1e3 * gap.low:.0f}-{1e3 * gap.high:.0f})",
                     f"{1e3 * ttft.median:.0f} ms ({1e3 * ttft.low:.0f}-{1e3 * ttft.high:.0f})"))
    print(table(("budget", "largest step (tokens)", "steps to its first token", "your plan: steps",
                 "longest token gap of the others", "its time to first token"), rows))
    print("counts come from the step traces, the same on every run; times are this machine's, "
          f"median (range) of {REPEATS} runs")
    big, small = (runs[b][0] for b in budgets)
    print(f"\nWith a {budgets[1]}-token budget the decoding requests never wait on a step of more than "
          f"{int(small['largest step'])} tokens (instead of {int(big['largest step'])}); the long prompt's first "
          f"token takes {int(small['steps to first token'])} steps instead of {int(big['steps to first token'])}. "
          + ("Every request's output is the same either way." if len(outputs) == 1 else
             "The outputs DIFFER between budgets: chunking must not change a token."))


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
