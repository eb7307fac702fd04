"""Draw the docs' charts (SVG) from the JSON that tinyinfer's commands and scripts write.

    python scripts/plot_charts.py [--out docs/charts] [--caption TEXT] INPUT...

Each INPUT is a JSON file or a folder; what it holds decides the chart:

* `tinyinfer bench batching --json FILE`              -> batching_timeline.svg
* `tinyinfer simulate --sweep batch --json FILE`      -> batch_sweep.svg (with any measured
  batch-1 decode of the same model and device among the other inputs)
* `tinyinfer bench speculative --json FILE`, or scripts/gpu_bench.py's JSON
                                                      -> speculative_speedup.svg (measured points
  on the simulator's curves for Llama-3-8B on one H200)
* a folder written by `tinyinfer quantize` (its layer_errors.json) -> quant_layer_error.svg
* scripts/tp_gpu_check.py's JSON                      -> tp_scaling.svg and tp_all_reduce.svg,
  measured against `tinyinfer simulate --calibrate FILE`'s fit

--caption adds what the files do not record (device, threads, date) to every chart's caption.
Needs matplotlib (`pip install -e .[docs]`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tinyinfer.cli.quantize import ERRORS_FILE  # noqa: E402
from tinyinfer.quant import QuantConfig  # noqa: E402
from tinyinfer.simulate.calibrate_tp import calibrate_recorded, hardware_named  # noqa: E402
from tinyinfer.simulate.model import Scenario, sweep  # noqa: E402

plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "tinyinfer", "font.size": 9,
                     "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
                     "axes.spines.right": False})
SPEC_MODEL, SPEC_HARDWARE = "llama-3-8b", "h200"


def classify(path: Path) -> tuple[str, object]:
    """(kind, data) of one input: batching, sweep, gpu_bench, speculative, quant or tp."""
    if path.is_dir():
        path = path / ERRORS_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "layers" in data and "format" in data:
        return "quant", data
    if isinstance(data, dict) and any(k.startswith("all_reduce_tp") for k in data):
        return "tp", path
    if isinstance(data, dict) and "drafter" in data:
        return "speculative", data
    if isinstance(data, dict) and "device" in data and ("latency" in data or "speculative" in data):
        return "gpu_bench", data
    if isinstance(data, list) and data and "running_per_step" in data[0]:
        return "batching", data
    if isinstance(data, list) and data and "scenario" in data[0]:
        return "sweep", data
    raise SystemExit(f"{path}: not a JSON this script knows (see its docstring)")


def save(fig: plt.Figure, out: Path, name: str, caption: str) -> Path:
    """Caption the figure, plain numbers on its log axes, write it as `out/name`."""
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,g}")
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                axis.set_major_formatter(plain)
                axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    fig.supxlabel(caption, fontsize=7, color="0.35", x=0.01, ha="left")
    path = out / name
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def batching_timeline(results: list[dict], out: Path, caption: str) -> Path:
    """Sequences in each step's batch, and requests finished so far, per batching mode."""
    fig, (running, done) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    for r, line in zip(results, cycle(({"lw": 1.6}, {"lw": 1}, {"lw": 1, "ls": (0, (2, 2))}))):
        steps = range(1, len(r["running_per_step"]) + 1)
        finished, total = [], 0
        for n in r["finished_per_step"]:
            total += n
            finished.append(total)
        label = f"{r['mode']} ({r['tokens_per_second']:.0f} tokens/s)"
        running.plot(steps, r["running_per_step"], label=label, **line)
        done.plot(steps, finished, label=label, **line)
    running.set(title="Sequences in each step's batch", xlabel="engine step", ylabel="running sequences")
    done.set(title="Requests finished", xlabel="engine step", ylabel="requests finished (cumulative)")
    done.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Continuous vs static batching: {results[0]['requests']} requests, same page pool")
    return save(fig, out, "batching_timeline.svg", caption)


def batch_sweep(sims: list[dict], measured: list[dict], out: Path, caption: str) -> Path:
    """Predicted decode throughput and TPOT against batch size, with the compute knee."""
    s0 = sims[0]["scenario"]
    batch = [s["scenario"]["batch"] for s in sims]
    fits = [s["scenario"]["batch"] <= s["max_concurrent"]["value"] for s in sims]
    fig, (tput, tpot) = plt.subplots(1, 2, figsize=(9, 3.6), layout="constrained")
    for ax, key, scale, unit in ((tput, "decode_throughput", 1, "tokens/s, all users"),
                                 (tpot, "tpot", 1e3, "TPOT, ms")):
        values = [s[key]["value"] * scale for s in sims]
        ax.plot(batch, values, "-", color="C0", lw=1.2, label="simulator")
        ax.plot([b for b, f in zip(batch, fits) if f], [v for v, f in zip(values, fits) if f],
                "o", color="C0", ms=4, label="KV cache fits")
        if not all(fits):
            ax.plot([b for b, f in zip(batch, fits) if not f], [v for v, f in zip(values, fits) if not f],
                    "x", color="C3", ms=6, label="KV cache does not fit")
        ax.axvline(sims[0]["knee_batch"]["value"], color="0.4", ls="--", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="batch (sequences decoding together)", ylabel=unit)
        ax.set_xscale("log", base=2)
    knee = sims[0]["knee_batch"]["value"]
    tput.annotate(f"compute knee ≈ {knee:.0f}", (knee, tput.get_ylim()[0]), xytext=(-4, 6),
                  textcoords="offset points", ha="right", fontsize=7, color="0.3")
    for m in measured:
        tput.plot(m["batch"], m["tokens_per_s"], "s", color="C1", ms=5, label=m["label"])
        tpot.plot(m["batch"], 1e3 / m["tokens_per_s"], "s", color="C1", ms=5, label=m["label"])
    tput.set_title("Decode throughput")
    tpot.set_title("Time per output token")
    tpot.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{s0['model']} on {s0['gpus']} × {s0['hardware_title']}, weights {s0['weights']}, "
                 f"KV {s0['kv']}, prompt {s0['prompt_tokens']} + output {s0['output_tokens']} tokens")
    return save(fig, out, "batch_sweep.svg", caption)


def measured_decode(sims: list[dict], benches: list[dict]) -> list[dict]:
    """Batch-1 decode runs in scripts/gpu_bench.py JSON of the sweep's model on its hardware."""
    model, hardware = sims[0]["scenario"]["model"], sims[0]["scenario"]["hardware"]
    points = []
    for b in benches:
        if hardware_named(b["device"]).name != hardware:
            continue
        for row in b.get("latency", []):
            if row["label"] == f"{model} / torch":
                points.append({"batch": 1, "tokens_per_s": row["decode_tokens_per_s"],
                               "label": f"measured, {b['device']}, {b['date']} "
                                        f"(prompt {row['prompt_tokens']})"})
    return points


def speculative_speedup(points: list[dict], out: Path, caption: str) -> Path:
    """Measured speedups at their acceptance rates, on the simulator's speedup curves."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    alphas = [i / 50 for i in range(50)]
    for i, k in enumerate(sorted({p["num_draft"] for p in points} | {4})):
        sims = sweep(Scenario.of(SPEC_MODEL, SPEC_HARDWARE, spec_k=k), "spec_acceptance", alphas)
        ax.plot(alphas, [s.quantity("spec_speedup").value for s in sims], color=f"C{i}", lw=1.2,
                label=f"simulator, {SPEC_MODEL} on one {SPEC_HARDWARE}, batch 1, free drafts, k = {k}")
        for p in points:
            if p["num_draft"] == k:
                ax.plot(p["acceptance_rate"], p["speedup"], "o", color=f"C{i}", ms=5)
                ax.annotate(p["label"], (p["acceptance_rate"], p["speedup"]), xytext=(5, 2),
                            textcoords="offset points", fontsize=6.5, color="0.25")
    ax.axhline(1, color="0.4", ls="--", lw=0.8)
    ax.set(yscale="log", xlim=(0, 1), xlabel="acceptance rate α (share of drafted tokens accepted)",
           ylabel="speedup over plain decoding (×)",
           title="Speculative decoding: speedup against acceptance, simulated and measured (dots)")
    ax.legend(fontsize=7, loc="upper left")
    return save(fig, out, "speculative_speedup.svg", caption)


def quant_layer_error(runs: list[dict], out: Path, caption: str) -> Path:
    """Relative error of each quantized weight, by block and kind, one panel per format."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs) + 0.6, 3.4), layout="constrained",
                             squeeze=False)
    for ax, run in zip(axes[0], runs):
        kinds: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for e in run["layers"]:
            parts = e["name"].split(".")
            kinds[parts[-2]].append((int(parts[1]), 100 * e["relative"]))
        for kind, rows in kinds.items():
            ax.plot([b for b, _ in rows], [v for _, v in rows], "o-", ms=3, lw=1, label=kind)
        ax.set(title=f"{run['model']}, {run['format']}", xlabel="block (layer index)",
               ylabel="relative error ‖W − Ŵ‖ / ‖W‖, %")
        ax.set_ylim(bottom=0)
    axes[0][-1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle("Weight quantization error by layer")
    return save(fig, out, "quant_layer_error.svg", caption)


def quantize_flags(name: str) -> str:
    """The `tinyinfer quantize` flags that write format `name` (e.g. int4-g64 -> --bits 4 --group-size 64)."""
    q = QuantConfig.parse(name)
    flags = f"--bits {q.bits}" + (f" --group-size {q.group_size}" if q.bits == 4 else "")
    return flags + ("" if q.symmetric else " --asymmetric")


def tp_charts(path: Path, out: Path, caption: str) -> list[Path]:
    """Decode tokens/s against GPU count (measured, calibrated, wire only) and the all-reduce sweep."""
    cal = calibrate_recorded(path)
    rec = cal.recorded
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    by_model = defaultdict(list)
    for c in cal.comparisons:
        if c.metric == "TPOT":
            by_model[c.run.model.name].append(c)
    for i, (model, rows) in enumerate(by_model.items()):
        gpus = [c.run.gpus for c in rows]
        line = {"ls": "-", "lw": 1.5} if len(rows) > 1 else {"ls": "none"}
        dashed, dotted = ({"ls": ls, "lw": 1} if len(rows) > 1 else {"ls": "none"} for ls in ("--", ":"))
        held = "" if rows[0].run.fit else " (held out of the fit)"
        ax.plot(gpus, [1 / c.measured for c in rows], marker="o", color=f"C{i}", **line,
                label=f"{model}: measured{held}")
        ax.plot(gpus, [1 / c.predicted for c in rows], marker="s", color=f"C{i}", **dashed, ms=8,
                mfc="none", label=f"{model}: simulator, this engine's fit")
        ax.plot(gpus, [1 / c.wire_only for c in rows], marker="^", color=f"C{i}", **dotted, ms=8,
                mfc="none", label=f"{model}: simulator, wire only")
    ax.set(xscale="log", yscale="log", xlabel="tensor-parallel GPUs", ylabel="decode tokens/s (batch 1)",
           title=f"Tensor-parallel decode on {rec.device}: measured vs simulator")
    ax.set_xticks(sorted({c.run.gpus for c in cal.comparisons}))
    ax.legend(fontsize=7)
    source = f"{path.name} ({rec.date}); fit: tinyinfer simulate --calibrate {path.name}"
    paths = [save(fig, out, "tp_scaling.svg", f"{source}{caption}")]

    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for i, g in enumerate(sorted({p.gpus for p, _ in cal.sweep})):
        rows = sorted(((p.nbytes, p.seconds, w) for p, w in cal.sweep if p.gpus == g))
        ax.plot([b for b, _, _ in rows], [1e6 * s for _, s, _ in rows], "o-", color=f"C{i}", ms=4,
                label=f"TP={g} measured")
        ax.plot([b for b, _, _ in rows], [1e6 * w for _, _, w in rows], "--", color=f"C{i}", lw=1,
                label=f"TP={g} simulator (fitted wire)")
    ax.set(xscale="log", yscale="log", xlabel="message, bytes (bf16)", ylabel="all-reduce time, µs",
           title=f"One NCCL all-reduce on {rec.device} (CUDA graph replay)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    paths.append(save(fig, out, "tp_all_reduce.svg", f"{source}{caption}"))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="JSON files or tinyinfer quantize folders")
    parser.add_argument("--out", type=Path, default=Path("docs/charts"), help="folder for the SVGs")
    parser.add_argument("--caption", default="", help="device, threads, date: added to every caption")
    args = parser.parse_args(argv)
    found: dict[str, list] = defaultdict(list)
    names: dict[str, list[str]] = defaultdict(list)
    for path in args.inputs:
        kind, data = classify(path)
        found[kind].append(data)
        names[kind].append(path.name)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = f" · {args.caption}" if args.caption else ""
    written = []
    if found["batching"]:
        written.append(batching_timeline(found["batching"][0], args.out,
                                         f"tinyinfer bench batching --json {names['batching'][0]}{extra}"))
    if found["sweep"]:
        sims = found["sweep"][0]
        written.append(batch_sweep(sims, measured_decode(sims, found["gpu_bench"]), args.out,
                                   f"tinyinfer simulate --sweep batch --json ({names['sweep'][0]}); "
                                   f"measured: {', '.join(names['gpu_bench']) or 'none'}{extra}"))
    spec = [{**row, "label": f"{b['device']}, {row['model']}, {row['drafter']}"}
            for b in found["gpu_bench"] for row in b.get("speculative", [])]
    spec += [{**row, "label": f"{name}, {row['drafter']}"}
             for row, name in zip(found["speculative"], names["speculative"])]
    if spec:
        written.append(speculative_speedup(spec, args.out, f"measured: {', '.join(names['gpu_bench'] + names['speculative'])} "
                                           f"(tinyinfer bench speculative); curves: tinyinfer.simulate.model.sweep{extra}"))
    if found["quant"]:
        commands = "; ".join(f"tinyinfer quantize --model {q['model']} {quantize_flags(q['format'])} -o {name}"
                             for q, name in zip(found["quant"], names["quant"]))
        written.append(quant_layer_error(found["quant"], args.out, f"{commands} ({ERRORS_FILE}){extra}"))
    for path in found["tp"]:
        written += tp_charts(path, args.out, extra)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
