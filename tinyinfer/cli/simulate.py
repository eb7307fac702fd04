"""`tinyinfer simulate`: the roofline simulator as a table, a batch sweep plot, or a calibration."""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from tinyinfer.cli.common import (
    add_alias,
    add_json,
    add_threads_arg,
    positive_int,
    write_json,
)
from tinyinfer.display.bars import BarColumn, bar_table
from tinyinfer.simulate.model import (
    ASSUMPTIONS,
    HARDWARE,
    KV_PRECISIONS,
    MODEL_CONFIGS,
    WEIGHT_PRECISIONS,
    Efficiency,
    Scenario,
    Simulation,
    SimulationError,
    model_preset,
    parameter_counts,
    simulate,
    sweep,
)
from tinyinfer.simulate.quantity import format_value

DEFAULT_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `simulate` subcommand on the CLI's subparsers."""
    p = subparsers.add_parser(
        "simulate", help="predict memory, latency, throughput and cost of a model on hardware",
        description="Roofline cost model: every number comes with the formula that produced it. "
                    "Presets: --list. Assumptions: docs/simulator.md.")
    p.add_argument("--model", default="llama-3-8b", help="model preset or a folder with config.json")
    p.add_argument("--hardware", default="h100", help="hardware preset")
    p.add_argument("--weights", default="bf16", choices=tuple(WEIGHT_PRECISIONS), help="weight precision")
    p.add_argument("--kv", default="bf16", choices=tuple(KV_PRECISIONS), help="KV cache precision")
    p.add_argument("--max-num-seqs", type=positive_int, default=1, metavar="N",
                   help="concurrent sequences (the batch)")
    add_alias(p, "--batch", "max_num_seqs", type=positive_int)
    p.add_argument("--prompt-tokens", type=positive_int, default=1024, metavar="N",
                   help="prompt tokens per sequence")
    add_alias(p, "--prompt", "prompt_tokens", type=positive_int)
    p.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                   help="tokens generated per sequence")
    add_alias(p, "--output", "max_tokens", type=positive_int)
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="total tokens per sequence; sets the prompt to context - max tokens "
                        "(default: none, --prompt-tokens)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                   help="devices the model is split over")
    add_alias(p, "--gpus", "tensor_parallel", type=positive_int)
    p.add_argument("--num-draft", type=int, default=0, metavar="K",
                   help="speculative draft tokens per step (0 = off)")
    add_alias(p, "--spec-k", "num_draft", type=int)
    p.add_argument("--acceptance", type=float, default=0.7, help="draft acceptance rate")
    p.add_argument("--draft-model", default=None, help="draft model preset (default: free drafts, "
                                                       "as with prompt lookup)")
    p.add_argument("--price", type=float, default=None, help="$ per device-hour (default: the preset's)")
    p.add_argument("--utilization", type=float, default=1.0, help="share of paid hours spent serving")
    p.add_argument("--api-price", type=float, default=None,
                   help="an API's $ per million tokens, for the break-even utilization (C20)")
    p.add_argument("--compute-efficiency", type=float, default=Efficiency.compute,
                   help="share of peak FLOP/s reached")
    p.add_argument("--attention-efficiency", type=float, default=Efficiency.attention,
                   help="share of peak FLOP/s prefill attention reaches")
    p.add_argument("--bandwidth-efficiency", type=float, default=Efficiency.bandwidth,
                   help="share of peak bandwidth reached")
    p.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed host cost per step")
    p.add_argument("--prefill-seq-overhead-ms", type=float, default=0.0,
                   help="host cost per prompt in a prefill step")
    p.add_argument("--sample-ns", type=float, default=0.0,
                   help="host sampling cost per vocabulary entry per sequence, in ns (0: sampled on the GPU)")
    p.add_argument("--all-reduce-wait-us", type=float, default=0.0,
                   help="what each all-reduce adds beyond the wire, per all-reduce of the step, in µs "
                        "(0: an ideal engine)")
    p.add_argument("--collective-overhead-us", type=float, default=0.0,
                   help="time a sharded step spends per all-reduce outside it, in µs")
    p.add_argument("--group-size", type=positive_int, default=128, help="int4 weights per scale")
    p.add_argument("--explain", action="append", default=[], metavar="NAME",
                   help="show how a number was derived, e.g. tpot or kv_per_sequence ('all': every row)")
    p.add_argument("--sweep", choices=("batch",), default=None,
                   help="plot throughput and latency against batch size (--max-num-seqs) "
                        "(default: none, one table)")
    p.add_argument("--values", default=None, help="comma-separated sweep values (default: 1,2,4..512)")
    p.add_argument("--list", action="store_true", help="list model and hardware presets")
    p.add_argument("--tui", action="store_true",
                   help="turn the knobs in a terminal UI (starts from these flags)")
    add_json(p, "every number with its derivation", nargs="?", const="-")  # bare --json: stdout, as before
    p.add_argument("--calibrate", nargs="?", const="", default=None, metavar="RECORDED_JSON",
                   help="measure this device and the engine on it, fit efficiencies, compare; with a "
                        "JSON file of scripts/tp_gpu_check.py, fit the link and the engine's "
                        "tensor-parallel terms to those recorded runs instead (no device needed)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="with --calibrate RECORDED_JSON: fit the runs its _async stages made with "
                        "asynchronous scheduling instead of the step-by-step ones")
    p.add_argument("--device", default=None, help="torch device for --calibrate (default: cuda if any)")
    add_threads_arg(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Carry out `tinyinfer simulate` with parsed arguments; returns the exit status."""
    if args.list:
        print(presets_table())
        return 0
    if args.calibrate:
        from tinyinfer.simulate.calibrate_tp import (
            calibrate_recorded,
            tensor_parallel_report,
        )

        print(tensor_parallel_report(calibrate_recorded(args.calibrate, args.async_scheduling)))
        return 0
    if args.async_scheduling:
        raise SimulationError("--async-scheduling picks runs of a recording: give it with "
                              "--calibrate RECORDED_JSON")
    if args.calibrate is not None:
        from tinyinfer.bench.measure import calibrate
        from tinyinfer.simulate.calibrate import calibration_report

        result = calibrate(args.device)
        print(calibration_report(result))
        return 0
    scenario = scenario_from_args(args)
    if args.tui:
        from tui.simulator_app import SimulatorApp

        SimulatorApp(scenario).run()
        return 0
    if args.sweep:
        values = _parse_values(args.values) if args.values else DEFAULT_SWEEP
        sims = sweep(scenario, args.sweep, values)
        if args.json:
            write_json(args.json, json.dumps([simulation_json(s) for s in sims], indent=1))
            return 0
        print(_header(scenario, with_batch=False))
        print(sweep_plot(sims))
        return 0
    sim = simulate(scenario)
    if args.json:
        write_json(args.json, json.dumps(simulation_json(sim), indent=1))
        return 0
    names = [q.name for _, q in sim.rows()] if "all" in args.explain else args.explain
    explained = [sim.quantity(name).explain() for name in names]  # unknown names fail first
    print(_header(scenario))
    print(simulation_table(sim))
    for text in explained:
        print()
        print(text)
    return 0


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The Scenario the command-line flags describe."""
    prompt = args.prompt_tokens
    if args.context is not None:
        prompt = args.context - args.max_tokens
        if prompt < 1:
            raise SimulationError(f"--context {args.context} leaves no prompt after --max-tokens "
                                  f"{args.max_tokens}: raise the context or lower the max tokens")
    efficiency = Efficiency(args.compute_efficiency, args.attention_efficiency, args.bandwidth_efficiency,
                            args.step_overhead_ms / 1e3, args.prefill_seq_overhead_ms / 1e3, args.sample_ns / 1e9,
                            args.all_reduce_wait_us / 1e6, args.collective_overhead_us / 1e6)
    return Scenario.of(args.model, args.hardware, weight_precision=args.weights, kv_precision=args.kv,
                       batch=args.max_num_seqs, prompt_tokens=prompt, output_tokens=args.max_tokens,
                       num_gpus=args.tensor_parallel, spec_k=args.num_draft, spec_acceptance=args.acceptance,
                       draft_model=args.draft_model, efficiency=efficiency, price_per_hour=args.price,
                       utilization=args.utilization, api_price_per_million=args.api_price,
                       group_size=args.group_size)


def _parse_values(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SimulationError(f"--values takes comma-separated integers, e.g. 1,8,64; got {text}") from None


def _header(s: Scenario, with_batch: bool = True) -> str:
    gpus = f"{s.num_gpus} x " if s.num_gpus > 1 else ""
    batch = f" · batch {s.batch}" if with_batch else ""
    return (f"{s.model.title} on {gpus}{s.hardware.title} · weights {s.weight_precision} · KV "
            f"{s.kv_precision}{batch} · prompt {s.prompt_tokens} + output {s.output_tokens} tokens")


def simulation_json(sim: Simulation) -> dict[str, Any]:
    """Every number with its derivation, the notes, and the scenario's main knobs, for --json."""
    s = sim.scenario
    knobs = {"model": s.model.name, "hardware": s.hardware.name, "hardware_title": s.hardware.title,
             "weights": s.weight_precision, "kv": s.kv_precision, "batch": s.batch,
             "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens, "gpus": s.num_gpus}
    return ({"scenario": knobs} | {q.name: q.to_dict() for _, q in sim.rows()}
            | {"decode_bound": sim.decode_bound, "notes": list(sim.notes)})


def simulation_table(sim: Simulation) -> str:
    """The simulation as text: label, value, and the formula behind each number."""
    rows = sim.rows()
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {q.human():>16}   {q.name}"
             + (f" = {q.pretty_formula()}" if q.formula else "") for label, q in rows]
    lines += [f"note: {n}" for n in sim.notes]
    lines.append("expand any number: --explain NAME (e.g. --explain tpot); assumptions: docs/simulator.md")
    return "\n".join(lines)


def sweep_plot(sims: Sequence[Simulation], width: int = 28) -> str:
    """Bars of decode throughput and per-token latency for each simulated batch size."""
    notes = []
    for s in sims:
        marks = ["compute-bound"] if s.decode_bound == "compute" else []
        if s.scenario.batch > s.max_concurrent.value:
            marks.append(f"KV does not fit (max {int(s.max_concurrent.value)})")
        notes.append("; ".join(marks))
    columns = [BarColumn("decode tokens/s (all users)", [s.decode_throughput.value for s in sims],
                         lambda v: f"{v:,.0f}"),
               BarColumn("TPOT", [s.tpot.value for s in sims], lambda v: format_value(v, "s"))]
    lines = bar_table("batch", [str(s.scenario.batch) for s in sims], columns, width, notes)
    knee = sims[0].knee_batch
    lines.append(f"compute knee at batch {knee.human()} (knee_batch = {knee.pretty_formula() or knee.note})")
    return "\n".join(lines)


def presets_table() -> str:
    """Every model and hardware preset with the numbers that matter most."""
    lines = ["models:"]
    for name in MODEL_CONFIGS:
        m = model_preset(name)
        c, p = m.config, parameter_counts(m)
        active = f", {format_value(p.active, 'params')} active" if m.is_moe else ""
        lines.append(f"  {name:<14}{m.title:<18}{format_value(p.total, 'params'):>12}{active}; "
                     f"{c.num_layers} layers, {c.num_heads} heads / {c.num_kv_heads} KV, "
                     f"context {c.max_model_len}")
    lines.append("hardware:")
    for name, hw in HARDWARE.items():
        lines.append(f"  {name:<12}{format_value(hw.peak('bf16'), 'FLOP/s'):>14} 16-bit"
                     f"{format_value(hw.memory_bandwidth, 'B/s'):>12}{format_value(hw.memory_bytes, 'B'):>9}"
                     f"  ${hw.price_per_hour:.2f}/h  {hw.title}")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in ASSUMPTIONS]
    return "\n".join(lines)
