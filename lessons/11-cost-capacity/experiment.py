"""Lesson 11 experiment: users per GPU, model size and the self-hosting break-even, from the simulator
(C6, C14, C15, C20) — and the simulator against this machine."""

from __future__ import annotations

import time
from types import ModuleType

import tinyinfer
from lessons.support import (
    claim,
    heading,
    heldout_text,
    load_model,
    measure_machine,
    table,
)
from tinyinfer.simulate.model import (
    Efficiency,
    Hardware,
    Scenario,
    model_preset,
    parameter_counts,
    simulate,
)
from tinyinfer.simulate.presets import model_from_folder

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
FLOOR = 20.0  # tokens/s per user: faster than anyone reads, the bar for "acceptable" here
API_PRICE = 0.20  # $ per million tokens: an assumed API price for an 8B-class open model
E = Efficiency()
ROOFLINE = (f"{100 * E.bandwidth:.0f}% of peak bandwidth, {100 * E.compute:.0f}% of peak FLOP/s, "
            + ("no per-step overhead" if E.step_overhead == 0 else f"{1e3 * E.step_overhead:.1f} ms per step"))


def capacity(impl: ModuleType, model: str, hardware: str, precision: str) -> tuple[list[tuple], int, float, float]:
    """A batch sweep: rows per batch, the student's users served, single-user tok/s, TTFT."""
    sims = {b: simulate(Scenario.of(model, hardware, weight_precision=precision, batch=b,
                                    prompt_tokens=1000, output_tokens=500)) for b in BATCHES}
    one = sims[1]
    sc = one.scenario
    cap = impl.max_concurrent(sc.hardware.memory_bytes, sc.memory_utilization, one.weight_memory.value,
                              one.kv_bytes_per_token.value, sc.prompt_tokens + sc.output_tokens)
    speeds = {b: s.user_tokens_per_second.value for b, s in sims.items()}
    users = impl.users_served(speeds, cap, FLOOR)
    # a batch past what fits shows no speed: the simulator would run only cap of its requests at once
    rows = [(b, s.user_tokens_per_second.value, s.decode_throughput.value, "yes") if b <= cap
            else (b, None, None, f"no ({cap} fit)") for b, s in sims.items()]
    return rows, users, speeds[1], one.ttft.value


def this_machine(quick: bool, model: str) -> tuple[float, float, float]:
    """Simulator prediction vs engine measurement of decode tok/s for the bundled model here."""
    m = load_model(model)
    flops, bandwidth = measure_machine()
    here = Hardware("this-machine", "this machine (measured)", {"fp32": flops, "bf16": flops}, bandwidth,
                    8e9, 0.0)
    predicted = simulate(Scenario.of(model_from_folder(m.path), here, weight_precision="fp32",
                                     kv_precision="fp32", prompt_tokens=16, output_tokens=32))
    engine = tinyinfer.Engine(m)
    prompt = m.tokenizer.encode(heldout_text(500))[:16]
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=12 if quick else 32,
                                                              ignore_eos=True))
    engine.step()  # prefill
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    measured = steps / (time.perf_counter() - start)
    engine.release(rid)
    return predicted.user_tokens_per_second.value, measured, bandwidth


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Four simulator studies with the student's formulas, then the simulator against this machine."""
    heading(f"C14: users one H100 serves at >= {FLOOR:.0f} tok/s each (prompt 1000, answer 500 tokens)")
    studies = {}
    for name, precision in (("llama-3-8b", "bf16"), ("llama-3-70b", "int4")):
        rows, users, single, ttft = capacity(impl, name, "h100-sxm", precision)
        studies[name] = (users, single, ttft)
        print(f"\n{model_preset(name).title} at {precision}: your users_served -> {users} users")
        print(table(("batch", "tok/s per user", "tok/s total", "fits in memory"), rows))
    users, single, ttft = studies["llama-3-70b"]
    claim("C14", f"a 70B model (Llama-3-70B, int4) on one H100: {single:.0f} tok/s for one request, "
          f"{users} users at >= {FLOOR:.0f} tok/s each, TTFT {1e3 * ttft:.0f} ms (simulated)",
          20 <= single <= 80 and users >= 20,
          f"decode reads the 4-bit weights once per step for the whole batch; assumptions: {ROOFLINE}, "
          "no queueing")

    heading("C15: compute per token, 70B vs 7B")
    small, big = (parameter_counts(model_preset(n)).active for n in ("llama-2-7b", "llama-2-70b"))
    ratio = impl.flops_per_token(big) / impl.flops_per_token(small)
    print(f"Llama-2-7B: {impl.flops_per_token(small) / 1e9:.1f} GFLOP/token, "
          f"Llama-2-70B: {impl.flops_per_token(big) / 1e9:.1f} GFLOP/token")
    claim("C15", f"{ratio:.1f}x the FLOPs per token", 8 <= ratio <= 12,
          f"FLOPs per token are 2 x parameters: {big / 1e9:.1f}B / {small / 1e9:.1f}B parameters")

    heading("C6: one user's decode speed by hardware (Llama-2-7B, int4, simulated)")
    expected = {"laptop-cpu": (5, 15), "rtx-4090": (30, 80), "h100-sxm": (100, float("inf"))}
    rows, inside = [], []
    for hw, (low, high) in expected.items():
        s = simulate(Scenario.of("llama-2-7b", hw, weight_precision="int4", prompt_tokens=500, output_tokens=200))
        speed = s.user_tokens_per_second.value
        inside.append(low <= speed <= high)
        rows.append((s.scenario.hardware.title, speed, f"{low}-{high}" if high < float("inf") else f"{low}+"))
    print(table(("hardware", "tok/s (one user)", "claimed"), rows))
    claim("C6", "; ".join(f"{r[0].split(' (')[0]}: {r[1]:.0f} tok/s" for r in rows),
          True if all(inside) else (None if any(inside) else False),
          "decode speed is memory bandwidth divided by the bytes read per token" + (
              "" if all(inside) else f"; the simulator gives upper bounds ({ROOFLINE}) while the claim's "
              "ranges describe typical real runs, which land below them: the last section shows how far "
              "below on this machine"))

    heading(f"C20: self-hosting Llama-3-8B on an H100 (batch 64) vs an API at ${API_PRICE:.2f} per million tokens")
    full = simulate(Scenario.of("llama-3-8b", "h100-sxm", batch=64))
    sc = full.scenario
    tokens = sc.batch * (sc.prompt_tokens + sc.output_tokens)
    rows = [(f"{100 * u:.0f}%", f"${impl.cost_per_million_tokens(sc.price, full.e2e_latency.value, tokens, u):.3f}")
            for u in (0.05, 0.1, 0.25, 0.5, 1.0)]
    print(table(("utilization", "$ per million tokens"), rows))
    at_full = impl.cost_per_million_tokens(sc.price, full.e2e_latency.value, tokens, 1.0)
    crossover = impl.breakeven_utilization(at_full, API_PRICE)
    claim("C20", f"self-hosting costs ${at_full:.3f} per million tokens at full use; it beats ${API_PRICE:.2f} "
          f"above {100 * crossover:.0f}% utilization (GPU at ${sc.price:.2f}/h, API price assumed)",
          0 < crossover < 1,
          "idle hours are paid for too: cost per token = cost at full use / utilization")

    heading("the simulator vs this machine (the bundled model, batch 1, float32)")
    predicted, measured, bandwidth = this_machine(quick, model)
    print(f"roofline from measured bandwidth ({bandwidth / 1e9:.1f} GB/s): {predicted:,.0f} tok/s; "
          f"the engine measured {measured:,.0f} tok/s ({100 * measured / predicted:.0f}%)")
    print("The gap is per-step overhead the roofline leaves out (Python, one small model); the simulator "
          "has an Efficiency.step_overhead knob that calibration fits for exactly this.")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
