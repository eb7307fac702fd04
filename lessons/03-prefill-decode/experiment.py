"""Lesson 03 experiment: prefill vs decode on the real engine (C1, C2, C16), with a roofline."""

from __future__ import annotations

from types import ModuleType

import tinyinfer
from lessons.support import (
    Spread,
    claim,
    heading,
    heldout_text,
    load_model,
    measure_machine,
    ratios,
    table,
    track,
)
from tinyinfer.model import Model
from tinyinfer.trace import StepTrace

REPEATS = 3  # runs per prompt length: C1's verdict reads the median


def run_prompt(model: Model, prompt: list[int], new_tokens: int) -> list[StepTrace]:
    """Traces of one greedy request (the whole prompt fits in one step's token budget)."""
    engine = tinyinfer.Engine(model, max_num_batched_tokens=max(512, len(prompt)))
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=new_tokens,
                                                              ignore_eos=True))
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    engine.release(rid)
    return traces


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Intensity vs machine balance, then measured TTFT and tokens/s split with the student's phase_times."""
    m = load_model(model)
    c = m.config
    flops, bandwidth = measure_machine()
    balance = flops / bandwidth

    heading("this machine, measured now")
    print(f"matmul {flops / 1e9:.1f} GFLOP/s (float32), memory {bandwidth / 1e9:.1f} GB/s "
          f"-> balance {balance:.1f} FLOPs per byte")
    print("A step whose intensity is below the balance waits on memory; above it, on arithmetic.")

    heading(f"arithmetic intensity of the MLP's up projection ({c.hidden_size} -> {c.intermediate_size}, float32)")
    rows = []
    for t in (1, 8, 64, 512):
        ai = impl.arithmetic_intensity(t, c.hidden_size, c.intermediate_size, 4)
        rows.append((t, impl.linear_flops(t, c.hidden_size, c.intermediate_size),
                     impl.linear_bytes(t, c.hidden_size, c.intermediate_size, 4), ai,
                     "compute" if ai > balance else "memory"))
    print(table(("tokens in the step", "FLOPs", "bytes", "FLOPs/byte", "bound by"), rows))

    ids = m.tokenizer.encode(heldout_text(8000))
    lengths = (16, 128) if quick else (16, 64, 256, 512)
    new_tokens = 12 if quick else 32
    heading(f"the engine: one request per prompt length, greedy, each length run {REPEATS} times")
    measured: dict[int, list] = {n: [] for n in lengths}
    for _ in track(range(REPEATS), "rounds over the prompt lengths"):
        for n in lengths:  # interleaved, so a busy spell slows every length alike
            measured[n].append(impl.phase_times(run_prompt(m, ids[:n], new_tokens)))
    rows, results = [], []
    for n in lengths:
        ttft = Spread(tuple(p.prefill_seconds for p in measured[n]))
        prefill = Spread(tuple(p.prefill_tokens / p.prefill_seconds for p in measured[n]))
        decode = Spread(tuple(p.decode_tokens / p.decode_seconds for p in measured[n]))
        ratio = ratios(prefill, decode)
        results.append((n, prefill.median, decode.median, ratio))
        rows.append((n, f"{1e3 * ttft.median:.0f} ms", prefill.median, decode.median,
                     f"{1e3 / decode.median:.1f} ms", f"{1e3 / prefill.median:.2f} ms",
                     f"{ratio.median:.1f}x ({ratio.low:.1f}-{ratio.high:.1f})"))
    print(table(("prompt tokens", "TTFT", "prefill tok/s", "decode tok/s", "per output token",
                 "per prompt token", "prefill/decode per token"), rows))
    print(f"medians of {REPEATS} runs on this machine; the last column's range is run to run")

    n, prefill_rate, decode_rate, last = results[-1]
    per_length = [r.median for _, _, _, r in results]
    best = max(per_length)
    attention = 4 * n * n * c.num_heads * c.head_dim * c.num_layers  # QK^T and AV over the full square
    share = attention / (attention + 2 * n * c.num_parameters)
    why = ("prefill computes all prompt tokens in one pass, reusing each weight for every token"
           if last.median >= 5 else
           f"prefill per token got slower as the prompt grew ({results[0][1]:,.0f} -> {prefill_rate:,.0f} tok/s): "
           f"attention's work grows with the square of the prompt (about {100 * share:.0f}% of the FLOPs at "
           f"{n} tokens), and the reference runner computes it with np.einsum, which is no BLAS matmul; "
           "lesson 02's timing table shows attention's share of the time")
    claim("C1", f"prefill {best:.0f}x faster per token than decode at best, {last.said('.1f', 'x')} with a "
          f"{n}-token prompt; TTFT grows with the prompt ({rows[0][1]} -> {rows[-1][1]}, medians)",
          True if last.median >= 5 else (None if best >= 5 else False), why)
    claim("C16", f"an output token costs {prefill_rate / decode_rate:.0f}x the time of a prompt token "
          f"({1e3 / decode_rate:.1f} ms vs {1e3 / prefill_rate:.2f} ms, {n}-token prompt)", decode_rate < prefill_rate,
          "each output token needs its own pass over all the weights; prompt tokens share one")

    weight_bytes = 4 * c.num_parameters  # the reference runner computes in float32
    kv_bytes = c.kv_bytes_per_token(4) * (n + new_tokens // 2)
    roofline = bandwidth / (weight_bytes + kv_bytes)
    decode_ai = impl.arithmetic_intensity(1, c.hidden_size, c.intermediate_size, 4)
    share = decode_rate / roofline
    step_ms, read_ms = 1e3 / decode_rate, 1e3 * (weight_bytes + kv_bytes) / bandwidth
    claim("C2", f"decode reads {(weight_bytes + kv_bytes) / 1e6:.0f} MB per token: the bandwidth roofline "
          f"allows {roofline:,.0f} tok/s, measured {decode_rate:,.0f} tok/s ({100 * share:.0f}%); "
          f"intensity {decode_ai:.2f} FLOPs/byte vs balance {balance:.1f}",
          True if decode_ai < balance and share >= 0.5 else (None if decode_ai < balance else False),
          "memory-bound as claimed" if share >= 0.5 else
          f"the arithmetic is memory-bound (intensity far below balance), but a step of {step_ms:.1f} ms "
          f"spends only {read_ms:.1f} ms reading memory: the rest is per-step overhead of a Python "
          "engine on a small model. A large model on a GPU (torch runner, CUDA graphs) gets close "
          "to the roofline")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
