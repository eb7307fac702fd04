"""The quantization scenario: per-layer errors as tinyinfer.quant measures them, and switching precision."""

from __future__ import annotations

import shutil

import pytest

import tinyinfer
from tinyinfer.quant import (BINS, QuantConfig, error_histograms, layer_errors, quantize_weights,
                             save_quantized)
from tinyinfer.weights import load_weights

from tui.app import TinyInferApp
from tui.drawing import short_name
from tui.options import Options
from tui.panels.quantization import QuantizationPanel
from tui.screens.run import RunScreen
from tests.tui_pilot import settle, started

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def make_app(model, **options) -> TinyInferApp:
    options.setdefault("model", str(model.path))
    options.setdefault("scenario", "quantization")
    options.setdefault("show_timings", False)
    return TinyInferApp(Options(**options), model=model)


def first_probs(screen: RunScreen) -> list[tuple[int, float]]:
    """The first sampled token's recorded candidates: (token id, probability)."""
    trace = screen.session.frames[-1].traces[0]
    return [(c.token_id, c.prob) for c in trace.seqs[0].candidates]


async def test_scenario_shows_the_per_layer_errors_quant_py_computes(model):
    original = load_weights(model.path, model.config)
    expected = layer_errors(original, quantize_weights(original, QuantConfig.parse("int8")))
    async with make_app(model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot, ready=lambda screen: screen.quant_report is not None)
        panel = screen.query_one(QuantizationPanel)
        assert panel.display and not panel.has_class("-off")
        assert screen.session.engine.model.quantization.name == "int8"
        report = panel.quant_report
        assert report.precision == "int8" and list(report.errors) == expected
        assert "int8" in screen.status_text
        text = panel.render().plain
        assert f"{short_name(expected[0].name)} " in text
        assert f"{100 * expected[0].relative:5.2f}%" in text
        await pilot.press("j")
        await settle(pilot)
        assert panel.quant_layer == 1
        chosen = expected[1].name
        weights, errors = error_histograms(original[chosen], quantize_weights(
            {chosen: original[chosen]}, QuantConfig.parse("int8"))[chosen], BINS)
        assert report.histograms[1] == (weights, errors)
        assert f"▶{short_name(chosen)}" in panel.render().plain


async def test_panel_shows_the_errors_measured_at_load_without_the_checkpoint(text_model_folder, tmp_path):
    # The errors are measured once, as the model quantizes at load, and ride on the Model: the
    # panel shows them with the checkpoint folder gone (it reads no weights and quantizes nothing).
    folder = tmp_path / "model"
    shutil.copytree(text_model_folder, folder)
    original = load_weights(folder, tinyinfer.load(folder).config)
    expected = layer_errors(original, quantize_weights(original, QuantConfig.parse("int4-g64")))
    model = tinyinfer.load(folder, quantize="int4-g64", measure_error=True)
    shutil.rmtree(folder)
    async with make_app(model, quantize="int4-g64").run_test(size=(120, 40)) as pilot:
        screen = await started(pilot, ready=lambda screen: screen.quant_report is not None)
        assert screen.session.engine.model is model
        report = screen.quant_report
        assert report.precision == "int4-g64" and list(report.errors) == expected
        assert f"{100 * expected[0].relative:5.2f}%" in screen.query_one(QuantizationPanel).render().plain


def test_load_measures_errors_only_when_asked_and_only_for_float_weights(model, tmp_path):
    assert tinyinfer.load(model.path, quantize="int8").quant_errors is None
    measured = tinyinfer.load(model.path, quantize="int8", measure_error=True).quant_errors
    assert len(measured.layers) == len(measured.histograms) > 0
    assert all(sum(w.counts) == sum(e.counts) > 0 for w, e in measured.histograms)
    assert tinyinfer.load(model.path, measure_error=True).quant_errors is None  # nothing rounded
    saved = tmp_path / "saved"
    original = load_weights(model.path, model.config)
    save_quantized(saved, quantize_weights(original, QuantConfig(8)), QuantConfig(8))
    shutil.copy(model.path / "config.json", saved)
    assert tinyinfer.load(saved, measure_error=True).quant_errors is None  # no floats to compare


async def test_m_switches_precision_and_changes_the_next_token_distribution(model):
    async with make_app(model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot, ready=lambda screen: screen.quant_report is not None)
        await pilot.press("space")
        await settle(pilot)
        int8 = first_probs(screen)
        await pilot.press("m")
        await started(pilot, ready=lambda screen: screen.quant_report is not None)
        assert screen.session.engine.model.quantization.name == "int4-g128"
        assert screen.session.frame.event == "start" and screen.quant_report.precision == "int4-g128"
        assert "reloaded with int4" in screen.narration.body
        await pilot.press("space")
        await settle(pilot)
        int4 = first_probs(screen)
        assert [t for t, _ in int4] and int4 != int8
        await pilot.press("m")
        await started(pilot, ready=lambda screen: screen.quant_report is not None)
        assert screen.session.engine.model.quantization is None
        assert screen.quant_report.errors == ()
        assert "as trained" in screen.query_one(QuantizationPanel).render().plain


async def test_panel_stays_off_in_runs_without_quantization(model):
    async with make_app(model, scenario="single").run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            await settle(pilot)
            if isinstance(pilot.app.screen, RunScreen):
                break
        assert pilot.app.screen.query_one(QuantizationPanel).has_class("-off")


def test_snapshot_after_prefill(snap_compare, model):
    async def run_before(pilot) -> None:
        await started(pilot, ready=lambda screen: screen.quant_report is not None)
        await pilot.press("space")
        await settle(pilot)

    assert snap_compare(make_app(model), terminal_size=(120, 40), run_before=run_before)
