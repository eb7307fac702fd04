"""Lesson 03 experiment: prefill vs decode on the real engine (C1, C2, C16), with a roofline."""

from __future__ import annotations

from types import ModuleType

import tinyinfer
from lessons.support import (
    claim,
    heading,
    heldout_text,
    load_model,
    measure_machine,
    table,
    track,
)
from tinyinfer.model import Model
from tinyinfer.trace import StepTrace


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

    heading("the engine: one request per prompt length, greedy")
    ids = m.tokenizer.encode(heldout_text(8000))
    lengths = (16, 128) if quick else (16, 64, 256, 512)
    new_tokens = 12 if quick else 32
    rows, results = [], []
    for n in track(lengths, "prompt lengths"):
        phases = impl.phase_times(run_prompt(m, ids[:n], new_tokens))
        prefill_rate = phases.prefill_tokens / phases.prefill_seconds
        decode_rate = phases.decode_tokens / phases.decode_seconds
        results.append((n, phases, prefill_rate, decode_rate))
        rows.append((n, f"{1e3 * phases.prefill_seconds:.0f} ms", prefill_rate, decode_rate,
                     f"{1e3 / decode_rate:.1f} ms", f"{1e3 / prefill_rate:.2f} ms"))
    print(table(("prompt tokens", "TTFT", "prefill tok/s", "decode tok/s", "per output token",
                 "per prompt token"), rows))

    n, phases, prefill_rate, decode_rate = results[-1]
    ratios = [p / d for _, _, p, d in results]
    best = max(ratios)
    attention = 4 * n * n * c.num_heads * c.head_dim * c.num_layers  # QK^T and AV over the full square
    share = attention / (attention + 2 * n * c.num_parameters)
    why = ("prefill computes all prompt tokens in one pass, reusing each weight for every token"
           if ratios[-1] >= 5 else
           f"prefill per token got slower as the prompt grew ({results[0][2]:,.0f} -> {prefill_rate:,.0f} tok/s): "
           f"attention's work grows with the square of the prompt (about {100 * share:.0f}% of the FLOPs at "
           f"{n} tokens), and the reference runner computes it with np.einsum, which is no BLAS matmul; "
           "lesson 02's timing table shows attention's share of the time")
    claim("C1", f"prefill {best:.0f}x faster per token than decode at best, {ratios[-1]:.0f}x with a "
          f"{n}-token prompt; TTFT grows with the prompt ({rows[0][1]} -> {rows[-1][1]})",
          True if ratios[-1] >= 5 else (None if best >= 5 else False), why)
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
          f"the arithmetic is memory-bound (intensity far below balance), but a {step_ms:.1f} ms step "
          f"spends only {read_ms:.1f} ms reading memory: the rest is per-step overhead of a Python "
          "engine on a small model. A large model on a GPU (torch runner, CUDA graphs) gets close "
          "to the roofline")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
