"""Lesson 12 experiment: your splits against the engine's shards, the engine at TP=1 and TP=2 on this
CPU, and your cost model against decode recorded on 4 H200s (C2)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from types import ModuleType

import numpy as np
import torch.distributed as dist

import tinyinfer
from lessons.support import (
    LessonError,
    claim,
    heading,
    heldout_text,
    human_bytes,
    load_model,
    table,
)
from tinyinfer.config import ModelConfig
from tinyinfer.model import Model
from tinyinfer.runners.numpy_ref import embedding, linear, rms_norm, silu
from tinyinfer.runners.tp.shard import shard_weights
from tinyinfer.simulate.calibrate_tp import TPCalibration, calibrate_recorded
from tinyinfer.simulate.model import Efficiency, Scenario, model_preset, simulate
from tinyinfer.simulate.presets import Hardware
from tinyinfer.simulate.steps import rates
from tinyinfer.trace import StepTrace

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "tp_gpu_check_2026-11-26-h200x4.json"
RUNS = {"llama3_8b_tp1": "llama-3-8b", "llama3_8b_tp2": "llama-3-8b", "llama3_8b_tp4": "llama-3-8b",
        "llama2_70b_tp4": "llama-2-70b"}
SPLITS = {"q": "column_parallel", "k": "column_parallel", "v": "column_parallel", "gate": "column_parallel",
          "up": "column_parallel", "o": "row_parallel", "down": "row_parallel"}


def compare_splits(impl: ModuleType, config: ModelConfig, weights: dict[str, np.ndarray]
                   ) -> tuple[list[tuple], int, int]:
    """The student's 2-rank shards of every layer's linear weights against shard_weights.

    Returns layer 0's rows for a table, and how many weights matched out of how many.
    """
    engine = [shard_weights(config, weights, rank, 2) for rank in range(2)]
    rows, matched, total = [], 0, 0
    for name, weight in weights.items():
        parts = name.split(".")  # layers.3.q.weight
        if parts[0] != "layers" or parts[2] not in SPLITS:
            continue
        split = SPLITS[parts[2]]
        mine = [np.asarray(getattr(impl, split)(weight, rank, 2)) for rank in range(2)]
        same = all(np.array_equal(m, e[name]) for m, e in zip(mine, engine))
        matched, total = matched + same, total + 1
        if parts[1] == "0":
            rows.append((name, weight.shape, split.split("_")[0], mine[0].shape, mine[1].shape,
                         "yes" if same else "NO"))
    return rows, matched, total


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


def mlp_and_ring(impl: ModuleType, config: ModelConfig, weights: dict[str, np.ndarray],
                 ids: list[int]) -> list[tuple]:
    """Layer 0's MLP on real hidden states, split by the student's mlp_partials, summed by their ring."""
    p = "layers.0."
    x = rms_norm(embedding(weights["embed"], np.asarray(ids)), weights[p + "mlp_norm.weight"], config.norm_eps)
    gate, up, down = (weights[f"{p}{n}.weight"] for n in ("gate", "up", "down"))
    whole = linear(silu(linear(x, gate)) * linear(x, up), down)  # [T, D]
    rows = []
    for world in (w for w in (2, 4) if config.intermediate_size % w == 0):
        partials = impl.mlp_partials(x, gate, up, down, world)
        results, sent = impl.ring_all_reduce(partials)
        message = np.asarray(partials[0]).nbytes
        errors = (relative_error(partials[0], whole), relative_error(sum(partials), whole),
                  max(relative_error(r, whole) for r in results))
        rows.append((world, *(f"{e:.1e}" for e in errors), human_bytes(message), human_bytes(max(sent)),
                     human_bytes((world - 1) * message)))
    return rows


def generate(m: Model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[StepTrace]]:
    """Greedy completions of every prompt, batched, and every step's trace."""
    engine = tinyinfer.Engine(m)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    return [engine.release(i).token_ids for i in ids], traces


def decode_steps(traces: list[StepTrace]) -> list[StepTrace]:
    return [t for t in traces if t.decode_tokens and not t.prefill_tokens]


def median_ms(traces: list[StepTrace], key: str, rank: bool = False) -> float:
    return 1e3 * statistics.median((t.rank_timings if rank else t.timings)[key] for t in traces)


def rank_rows(traces: list[StepTrace]) -> list[tuple]:
    """Per rank: what it owns (from the page pool's view) and its median compute / all-reduce time."""
    def span(r: tuple[int, int]) -> str:
        return f"{r[0]}-{r[1] - 1}"
    rows = []
    for share in traces[-1].pool.ranks:
        k = f"rank{share.rank}"
        rows.append((share.rank, span(share.heads), span(share.kv_heads), span(share.mlp_units),
                     span(share.vocab_rows), f"{median_ms(traces, k + '_compute', True):.2f}",
                     f"{median_ms(traces, k + '_all_reduce', True):.2f}"))
    return rows


def on_this_cpu(impl: ModuleType, m: Model, quick: bool) -> None:
    """The engine at TP=1 and TP=2 (two processes, gloo): same logits, same text, and each rank's share."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise LessonError("this torch build has no gloo backend, which CPU tensor parallelism needs: "
                          "install the standard torch wheel for your platform")
    ids = m.tokenizer.encode(heldout_text(6000))
    prompts = [ids[i * 300:i * 300 + 24] for i in range(2 if quick else 4)]
    ref = tinyinfer.load(m.path, runner="torch", device="cpu")
    # time_collectives: each rank's all-reduces timed apart from its compute (off by default: on a
    # GPU the events cost time; here the host clock reads them)
    tp = tinyinfer.load(m.path, runner="torch", tensor_parallel=2, device="cpu", time_collectives=True)
    try:
        gap = float(np.abs(tp.logits(ids[:64]) - ref.logits(ids[:64])).max())
        runs = {name: generate(model, prompts, 8 if quick else 32) for name, model in (("TP=1", ref), ("TP=2", tp))}
        counted = tp.runner.last_timings[0].num_all_reduces
    finally:
        tp.runner.close()
    (one, one_traces), (two, two_traces) = runs["TP=1"], runs["TP=2"]
    print(f"logits of 64 held-out tokens, TP=2 vs TP=1: largest difference {gap:.1e}")
    print(f"greedy text of {len(prompts)} prompts: {'identical' if one == two else 'DIFFERENT'}; the first: "
          f"{m.tokenizer.decode(one[0])!r}")
    steps = decode_steps(two_traces)
    print(f"\nwho owns what (trace.pool.ranks) and median time per decode step (trace.rank_timings, "
          f"{len(steps)} steps of {len(prompts)} sequences):")
    print(table(("rank", "q heads", "KV heads", "MLP units", "vocab rows", "compute ms", "all-reduce ms"),
                rank_rows(steps)))
    yours = impl.all_reduce_count(m.config.num_layers, 2)
    print(f"all-reduces per step: the engine counted {counted}, your all_reduce_count({m.config.num_layers}, 2) "
          f"says {yours}{'' if yours == counted else ' -- they differ'}")
    single, split = median_ms(decode_steps(one_traces), "forward"), median_ms(steps, "forward")
    compute = statistics.mean(median_ms(steps, f"rank{r}_compute", True) for r in range(2))
    print(f"forward pass per decode step: TP=1 {single:.1f} ms, TP=2 {split:.1f} ms; each rank computed for "
          f"{compute / single:.0%} of a TP=1 step while holding half the weights. On this CPU both ranks share "
          f"the same {os.cpu_count()} cores and memory, a small model's step is mostly per-operation overhead that "
          "every rank pays in full (lesson 03), and every all-reduce crosses processes over TCP (gloo): here TP "
          "only adds communication.")


def recorded_runs() -> dict[str, dict]:
    """The batch-1 decode runs of the 4 x H200 recording (docs/tensor-parallel.md)."""
    if not RECORDED.is_file():
        raise LessonError(f"the recorded GPU runs ({RECORDED}) are missing: run the lesson from a tinyinfer "
                          "checkout (pip install -e .)")
    data = json.loads(RECORDED.read_text(encoding="utf-8"))
    return {key: data[key] for key in RUNS}


def predict(impl: ModuleType, config: ModelConfig, total_bytes: float, bandwidth: float, gpus: int,
            hw: Hardware, engine: Efficiency | None) -> float:
    """The student's step time on the recorded link; given this engine's fitted terms, with them too.

    This engine adds to each all-reduce a wait that grows with the step's all-reduce count and a
    fixed cost around it, and to each step a host overhead (tinyinfer/simulate/calibrate_tp.py).
    """
    latency = rates(hw, Efficiency(), gpus, "bf16").all_reduce_latency.value
    extra, overhead = 0.0, 0.0
    if engine is not None:
        extra = engine.all_reduce_wait * impl.all_reduce_count(config.num_layers, gpus) + engine.collective_overhead
        overhead = engine.step_overhead
    return overhead + impl.decode_step_time(total_bytes, bandwidth, gpus, config.num_layers,
                                            config.hidden_size * 2, latency + extra, hw.link_bandwidth)


def alone_us(cal: TPCalibration, gpus: int, message: int) -> float:
    """One all-reduce of about `message` bytes on `gpus` H200s, timed alone (NCCL replayed from a CUDA graph)."""
    point = min((p for p in cal.recorded.sweep if p.gpus == gpus), key=lambda p: abs(p.nbytes - message))
    return 1e6 * point.seconds


def gpu_table(impl: ModuleType, runs: dict[str, dict], cal: TPCalibration) -> list[tuple]:
    """Per recorded run: what was measured, one all-reduce in the step vs alone, your two predictions."""
    rows = []
    for key, name in RUNS.items():
        run, config = runs[key], model_preset(name).config
        n, total = run["tensor_parallel"], run["bytes_per_step"] * run["tensor_parallel"]
        wire, engine = (predict(impl, config, total, run["bandwidth"], n, cal.hardware, e)
                        for e in (None, cal.efficiency))
        each = "-"
        if n > 1:
            in_step = 1e3 * run["all_reduce_ms"] / impl.all_reduce_count(config.num_layers, n)
            each = f"{in_step:.0f} / {alone_us(cal, n, config.hidden_size * 2):.0f}"
        rows.append((f"{model_preset(name).title} TP={n}", f"{run['decode_tokens_per_s']:.1f}",
                     f"{run['tpot_p50_ms']:.2f}", f"{run['all_reduce_ms']:.2f}" if n > 1 else "-", each,
                     f"{1e3 * wire:.2f}", f"{1e3 * engine:.2f}"))
    return rows


def sweep(impl: ModuleType, name: str, total_bytes: float, cal: TPCalibration) -> tuple[list[tuple], int, int]:
    """Your step time on 1-8 H200s, wire only and with this engine; your best count for each."""
    spec, hw = model_preset(name), cal.hardware
    bandwidth = cal.efficiency.bandwidth * hw.memory_bandwidth
    rows, wire, engine = [], {}, {}
    for n in (1, 2, 4, 8):
        sim = simulate(Scenario.of(spec, hw, prompt_tokens=512, output_tokens=128, num_gpus=n))
        fits = sim.max_concurrent.value > 0  # the weights leave room for at least one sequence's KV
        times = [predict(impl, spec.config, total_bytes, bandwidth, n, hw, e) for e in (None, cal.efficiency)]
        rows.append((n, "yes" if fits else "no", f"{1e3 * times[0]:.2f}", f"{1e3 * times[1]:.2f}"))
        if fits:
            wire[n], engine[n] = times
    return rows, impl.best_gpu_count(wire), impl.best_gpu_count(engine)


def gpu_runs(impl: ModuleType, runs: dict[str, dict], cal: TPCalibration) -> None:
    """Recorded decode on 4 H200s next to the student's cost model, wire only and with this engine."""
    e, hw = cal.efficiency, cal.hardware
    print(table(("run (bf16, batch 1)", "tok/s", "ms/token", "all-reduce ms", "each all-reduce, us: in step / alone",
                 "yours: wire only", "yours: this engine"), gpu_table(impl, runs, cal)))
    print(f"wire: {1e6 * hw.link_latency:.2f} us + 2 (N - 1) x {1e6 * hw.link_hop_latency:.2f} us latency, "
          f"{hw.link_bandwidth / 1e9:.0f} GB/s (fitted to NCCL alone). This engine adds "
          f"{1e6 * e.all_reduce_wait:.2f} us x (all-reduces in the step) + {1e6 * e.collective_overhead:.1f} us "
          f"to each all-reduce and {1e3 * e.step_overhead:.2f} ms to each step (fitted to the 8B runs; the 70B "
          "run is held out).")
    speed = {key: run["decode_tokens_per_s"] for key, run in runs.items()}
    print(f"So TP=2 and TP=4 run the 8B at {speed['llama3_8b_tp2'] / speed['llama3_8b_tp1']:.2f}x and "
          f"{speed['llama3_8b_tp4'] / speed['llama3_8b_tp1']:.2f}x the speed of one GPU: its all-reduces cost "
          "several times the wire, and the host's work per step does not shrink with N. What TP buys here is "
          f"capacity: a 70B model that fits no single card decodes at {speed['llama2_70b_tp4']:.0f} tok/s on four "
          "(docs/tensor-parallel.md, 'Reading the numbers').")


def more_gpus(impl: ModuleType, runs: dict[str, dict], cal: TPCalibration) -> None:
    """The student's step time and best GPU count for the 8B and the 70B on 1-8 H200s."""
    for key, name in (("llama3_8b_tp1", "llama-3-8b"), ("llama2_70b_tp4", "llama-2-70b")):
        total = runs[key]["bytes_per_step"] * runs[key]["tensor_parallel"]
        rows, best_wire, best_engine = sweep(impl, name, total, cal)
        print(f"\n{model_preset(name).title} ({human_bytes(total)} read per step): your best_gpu_count -> "
              f"{best_wire} on the wire alone, {best_engine} with this engine")
        print(table(("GPUs", "fits", "wire only ms", "this engine ms"), rows))


def bandwidth_claim(runs: dict[str, dict]) -> None:
    """C2 from the recordings: the share of each step that reading the rank's bytes explains."""
    share = {key: run["bytes_per_step"] / run["bandwidth"] / (run["tpot_p50_ms"] / 1e3) for key, run in runs.items()}
    claim("C2", f"Llama-3-8B on one H200 spends {share['llama3_8b_tp1']:.0%} of its decode step reading weights "
          f"and KV at copy bandwidth; split over 2 and 4 GPUs {share['llama3_8b_tp2']:.0%} and "
          f"{share['llama3_8b_tp4']:.0%}; Llama-2-70B on 4 GPUs {share['llama2_70b_tp4']:.0%} (recorded 2026-11-26)",
          None, "on one GPU decode is bandwidth-bound, so splitting the reads could speed it up N-fold; sharded, "
          "this engine's step is set by all-reduces and host work, not by the bytes each GPU reads")


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Splits on real weights; the engine at TP=1 and TP=2 here; the recorded GPUs against your cost model."""
    m = load_model(model)
    weights, config = m.runner.w, m.config

    heading("your column / row splits against the engine's shard_weights (the real weights, 2 ranks)")
    rows, matched, total = compare_splits(impl, config, weights)
    print(table(("weight", "shape", "split", "rank 0 keeps", "rank 1 keeps", "same as engine"), rows))
    print(f"{matched} of {total} linear weights of the {config.num_layers} layers split exactly as the engine's")

    heading("layer 0's MLP split by your mlp_partials, summed by your ring_all_reduce (16 held-out tokens)")
    ids = m.tokenizer.encode(heldout_text(2000))[:16]
    print(table(("ranks", "rank 0's partial alone: error", "sum of partials: error", "your ring: error",
                 "message", "each rank sent", "via rank 0: it sends"), mlp_and_ring(impl, config, weights, ids)))
    print("One partial alone is far from the answer; their sum is it: one all-reduce per MLP. Your ring has every "
          "rank send 2 (N - 1) / N of the message; gathering on rank 0 and sending the sum back makes rank 0 "
          "send N - 1 messages.")

    heading("the engine on this CPU: the model at TP=1 and at TP=2 (two processes, gloo)")
    on_this_cpu(impl, m, quick)

    heading("the GPUs: decode recorded on 4 NVIDIA H200 (2026-11-26) next to your decode_step_time")
    runs, cal = recorded_runs(), calibrate_recorded(RECORDED)
    gpu_runs(impl, runs, cal)
    heading("where adding GPUs stops helping (your model, H200s, best = fewest GPUs within 5% of the fastest)")
    more_gpus(impl, runs, cal)
    bandwidth_claim(runs)
    print("\nSee each rank's share and time step by step: tinyinfer tui --tensor-parallel 2")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
