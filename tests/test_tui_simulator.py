"""Pilot tests of the simulator screen: knobs re-run simulate(), rows explain themselves."""

from __future__ import annotations

import pytest
from textual.widgets import Select, Static

from tinyinfer.simulate.model import Scenario, simulate
from tui.simulator_app import SimulatorApp
from tui.simulator_knob import NumberKnob
from tui.simulator_results import ResultsTable

SIZE = (100, 32)



def cell(app: SimulatorApp, name: str) -> str:
    """The value column of the row for quantity `name`."""
    return str(app.screen.query_one(ResultsTable).get_cell(name, "value"))


def text(app: SimulatorApp, selector: str) -> str:
    return str(app.screen.query_one(selector, Static).content)


async def type_into(pilot, knob_id: str, value: str) -> None:
    """Focus a knob, clear it and type `value` as a user would."""
    knob = pilot.app.screen.query_one(f"#{knob_id}", NumberKnob)
    knob.focus()
    knob.value = ""
    await pilot.press(*value)
    await pilot.pause()


@pytest.mark.anyio
async def test_batch_knob_gives_the_simulated_throughput():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert cell(app, "throughput") == simulate(Scenario.of("llama-3-8b", "h100")).throughput.human()
        app.screen.query_one("#knob-batch").focus()
        await pilot.press("up", "up")  # ×2 per step: 1 → 4
        await pilot.pause()
        assert app.screen.query_one("#knob-batch", NumberKnob).value == "4"
        four = simulate(Scenario.of("llama-3-8b", "h100", batch=4))
        assert cell(app, "throughput") == four.throughput.human()
        await type_into(pilot, "knob-batch", "48")
        assert cell(app, "decode_throughput") == \
            simulate(Scenario.of("llama-3-8b", "h100", batch=48)).decode_throughput.human()
        assert "▶   48" in str(app.screen.query_one("#sim-sweep").render())


@pytest.mark.anyio
async def test_model_and_precision_update_weight_memory():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        app.screen.query_one("#knob-model", Select).value = "mistral-7b"
        await pilot.pause()
        assert cell(app, "weight_memory") == simulate(Scenario.of("mistral-7b", "h100")).weight_memory.human()
        assert "Mistral 7B" in text(app, "#sim-status")
        app.screen.query_one("#knob-weight_precision", Select).value = "int4"
        await pilot.pause()
        int4 = simulate(Scenario.of("mistral-7b", "h100", weight_precision="int4"))
        assert cell(app, "weight_memory") == int4.weight_memory.human()


@pytest.mark.anyio
async def test_selected_row_shows_its_derivation():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        expected = simulate(Scenario.of("llama-3-8b", "h100"))
        assert text(app, "#sim-explain-text") == expected.tpot.explain()
        app.screen.query_one(ResultsTable).focus()
        await pilot.press(*["down"] * 5)  # tpot → ... → throughput incl. prefill
        await pilot.pause()
        shown = text(app, "#sim-explain-text")
        assert shown == expected.throughput.explain()
        assert "= batch × output ÷ e2e_latency" in shown
        assert app.screen.query_one("#sim-explain").border_title == "How throughput is derived"


@pytest.mark.anyio
async def test_speculative_rows_appear_with_draft_tokens():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await type_into(pilot, "knob-spec_k", "4")
        spec = simulate(Scenario.of("llama-3-8b", "h100", spec_k=4))
        assert cell(app, "spec_speedup") == spec.spec_speedup.human()
        app.screen.query_one("#knob-spec_acceptance").focus()
        await pilot.press("down")  # 0.70 → 0.65
        await pilot.pause()
        lower = simulate(Scenario.of("llama-3-8b", "h100", spec_k=4, spec_acceptance=0.65))
        assert cell(app, "spec_speedup") == lower.spec_speedup.human()


@pytest.mark.anyio
async def test_price_defaults_to_the_hardware_preset():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        app.screen.query_one("#knob-hardware", Select).value = "l4"
        await pilot.pause()
        assert app.screen.query_one("#knob-price_per_hour", NumberKnob).placeholder == "0.80"
        app.screen.query_one("#knob-price_per_hour").focus()
        await pilot.press("up")  # from the preset's 0.80
        await pilot.pause()
        priced = simulate(Scenario.of("llama-3-8b", "l4", price_per_hour=1.05))
        assert cell(app, "cost_per_million") == priced.cost_per_million.human()


@pytest.mark.anyio
async def test_invalid_knobs_explain_themselves_then_escape_leaves():
    app = SimulatorApp()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        before = cell(app, "tpot")
        await type_into(pilot, "knob-batch", "abc")
        assert text(app, "#sim-message") == "batch: 'abc' is not a whole number"
        assert "showing the last valid knobs" in text(app, "#sim-status")
        assert cell(app, "tpot") == before
        await type_into(pilot, "knob-batch", "2")
        await type_into(pilot, "knob-num_gpus", "3")
        assert "3 GPUs must divide 32 query heads" in text(app, "#sim-message")
        await type_into(pilot, "knob-num_gpus", "2")
        assert text(app, "#sim-message") == ""
        assert cell(app, "tpot") == simulate(Scenario.of("llama-3-8b", "h100", batch=2, num_gpus=2)).tpot.human()
        await pilot.press("escape")  # leaves the screen, which ends the standalone app
        await pilot.pause()
    assert app.return_code == 0


def test_snapshot(snap_compare):
    assert snap_compare(SimulatorApp(), terminal_size=SIZE)
