"""Lesson 07 experiment: throughput vs batch size (C7); static vs continuous batching (C8)."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.support import claim, heading, heldout_text, load_model, table
from tinyinfer.bench import workloads as bench


def prompts(ids: list[int], n: int, length: int) -> list[tuple[int, ...]]:
    """n different held-out passages of the same length."""
    return [tuple(ids[i * length:(i + 1) * length]) for i in range(n)]


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Measure the batching claims on the engine; set the student's step model beside them."""
    m = load_model(model)
    ids = m.tokenizer.encode(heldout_text(20000))

    users, tokens = (8, 12) if quick else (16, 32)
    heading(f"C7: {users} requests of {tokens} tokens each, with at most B running at once")
    same = [bench.Request(p, tokens) for p in prompts(ids, users, 16)]
    rows, rates, step_s = [], {}, {}
    for b in (1, 4, 8) if quick else (1, 2, 4, 8, 16):
        r = bench.run_workload(m, same, f"B={b}", max_num_seqs=b, enable_prefix_caching=False)
        rates[b], step_s[b] = r.tokens_per_second, r.seconds / r.steps
        rows.append((b, r.steps, f"{1e3 * step_s[b]:.0f} ms", r.tokens_per_second,
                     f"{r.tokens_per_second / rates[1]:.1f}x", r.tokens_per_second / r.mean_running))
    print(table(("B (max running)", "steps", "time per step", "total tok/s", "vs B=1", "tok/s per user"), rows))
    b = max(rates)
    gain, cost = rates[b] / rates[1], step_s[b] / step_s[1]
    claim("C7", f"{gain:.1f}x the total throughput with {b} requests batched ({rates[1]:.0f} -> {rates[b]:.0f} "
          f"tok/s); a step with {b} sequences took {cost:.1f}x as long as a step with one",
          True if gain >= b / 2 else (None if gain > 1.2 else False),
          "one pass over the weights serves the whole batch" if gain >= b / 2 else
          "batching helps, but a batched step is not free here: per-sequence work (attention, run "
          "sequence by sequence in the reference runner, and sampling) grows with the batch, and at "
          "32-bit a batch of B has an intensity of about B/2 FLOPs per byte, past a CPU's balance point "
          "(lesson 03) at small B. A GPU's balance (~300 FLOPs/byte) keeps big batches nearly free")

    n, slots, typical, cap = (16, 4, 10, 64) if quick else (64, 16, 40, 400)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(typical), 1.0, n), 2, cap).astype(int).tolist()
    heading(f"C8: {n} requests, answers of {min(lengths)}-{max(lengths)} tokens, at most {slots} running")
    varied = [bench.Request(p, k) for p, k in zip(prompts(ids, n, 16), lengths)]
    results = {mode: bench.run_workload(m, varied, mode, batching=mode, max_num_seqs=slots,
                                        enable_prefix_caching=False)
               for mode in ("static", "continuous")}
    predicted = {mode: impl.simulate_batching(lengths, slots, mode) for mode in results}
    print(table(("batching", "steps (engine)", "steps (yours)", "mean running", "total tok/s"),
                [(mode, r.steps, len(predicted[mode]), r.mean_running, r.tokens_per_second)
                 for mode, r in results.items()]))
    measured = results["continuous"].tokens_per_second / results["static"].tokens_per_second
    yours = impl.predicted_speedup(lengths, slots)
    print(f"speedup: measured {measured:.2f}x, your prediction {yours:.2f}x (equal-cost steps)")
    claim("C8", f"continuous batching gave {measured:.2f}x the throughput of static batching "
          f"(your step model predicts {yours:.2f}x)", True if 2 <= measured <= 4 else (None if measured > 1 else False),
          "the gain comes from refilling slots that static batching leaves idle"
          + ("" if 2 <= measured <= 4 else "; it grows with the spread of answer lengths and with the "
             "number of slots, and shrinks when a full step costs more than a half-empty one"))


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
