"""scripts/plot_charts.py draws SVG charts from what the real commands write."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tinyinfer.cli.commands import main as tinyinfer

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"


def plot(*inputs: Path | str, out: Path, caption: str = "") -> dict[str, str]:
    """Run the script; every SVG it names, parsed as XML, as the text of its labels."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts/plot_charts.py"), "--out", str(out),
                           "--caption", caption, *map(str, inputs)],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    charts = {}
    for line in done.stdout.split():
        root = ET.parse(line).getroot()
        assert root.tag == f"{SVG}svg"
        assert not list(root.iter(f"{SVG}font")) and "@font-face" not in Path(line).read_text()
        charts[Path(line).name] = " | ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    return charts


def test_charts_of_a_simulator_sweep_a_quantized_model_and_the_recorded_gpu_runs(tmp_path):
    assert tinyinfer(["simulate", "--model", "llama-3-8b", "--hardware", "h200", "--sweep", "batch",
                      "--values", "1,4,64,4096", "--json", str(tmp_path / "sweep.json")]) == 0
    sims = json.loads((tmp_path / "sweep.json").read_text())
    assert [s["scenario"]["batch"] for s in sims] == [1, 4, 64, 4096]
    assert tinyinfer(["quantize", "--model", "bundled", "--bits", "8", "-o", str(tmp_path / "q8")]) == 0
    charts = plot(tmp_path / "sweep.json", tmp_path / "q8", ROOT / "docs/gpu_bench_2026-11-26.json",
                  ROOT / "docs/tp_gpu_check_2026-11-26-h200x4.json", out=tmp_path / "charts",
                  caption="test machine")
    assert sorted(charts) == ["batch_sweep.svg", "quant_layer_error.svg", "speculative_speedup.svg",
                              "tp_all_reduce.svg", "tp_scaling.svg"]
    sweep = charts["batch_sweep.svg"]
    assert "Decode throughput" in sweep and "Time per output token" in sweep and "tokens/s, all users" in sweep
    assert "KV cache does not fit" in sweep  # 4096 sequences of 1280 tokens do not fit in 141 GB
    assert "measured, NVIDIA H200, 2026-11-26 (prompt 512)" in sweep and "4,096" in sweep
    assert "test machine" in sweep
    quant = charts["quant_layer_error.svg"]
    assert "bundled, int8" in quant and "tinyinfer quantize --model bundled --bits 8 -o q8" in quant
    assert all(f"| {kind} |" in quant for kind in ("q", "k", "v", "o", "gate", "up", "down"))
    spec = charts["speculative_speedup.svg"]
    assert all(f"k = {k}" in spec for k in (2, 4, 6)) and "NVIDIA H200, bundled, draft" in spec
    tp = charts["tp_scaling.svg"]
    assert "llama-2-70b: measured (held out of the fit)" in tp and "llama-3-8b: simulator, wire only" in tp
    assert "TP=2 measured" in charts["tp_all_reduce.svg"] and "TP=4 simulator (fitted wire)" in charts["tp_all_reduce.svg"]


@pytest.mark.slow
def test_batching_timeline_from_the_benchmark(tmp_path):
    result = tmp_path / "batching.json"
    assert tinyinfer(["bench", "batching", "--requests", "4", "--max-num-seqs", "2", "--json", str(result)]) == 0
    runs = json.loads(result.read_text())
    assert all(len(r["running_per_step"]) == r["steps"] == len(r["finished_per_step"]) for r in runs)
    assert all(sum(r["finished_per_step"]) == r["requests"] for r in runs)
    charts = plot(result, out=tmp_path)
    assert list(charts) == ["batching_timeline.svg"]
    text = charts["batching_timeline.svg"]
    assert all(mode in text for mode in ("continuous + paged", "static + paged", "continuous + contiguous"))
    assert "4 requests" in text and "engine step" in text
