"""Screenshots of the TUI at 80x24 and 120x40: the walkthrough's first screens and each scenario.

Deterministic: a fixed model and seed, and wall-clock times switched off. After an intended
change of the look, review the new pictures and run with --snapshot-update.
"""

from __future__ import annotations

import pytest

import tinyinfer

from tui.app import TinyInferApp
from tui.options import Options
from tui.screens.run import RunScreen

SIZES = [(80, 24), (120, 40)]


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def stepper(steps: int):
    """A run_before hook: wait for the run screen, then take `steps` engine steps."""
    async def run_before(pilot) -> None:
        for _ in range(100):
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()
            if isinstance(pilot.app.screen, RunScreen):
                break
        for _ in range(steps):
            await pilot.press("space")
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()
    return run_before


def app(model, scenario: str = "single") -> TinyInferApp:
    options = Options(model=str(model.path), scenario=scenario, show_timings=False)
    return TinyInferApp(options, model=model)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("steps", [0, 1, 2], ids=["tokenize", "prefill", "decode"])
def test_walkthrough_first_screens(snap_compare, model, size, steps):
    assert snap_compare(app(model), terminal_size=size, run_before=stepper(steps))


SCENARIO_STEPS = {"single": 6, "batching": 7, "prefix": 5, "pressure": 4, "speculative": 8, "chunked": 6}


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("scenario", list(SCENARIO_STEPS))
def test_scenario_after_fixed_steps(snap_compare, model, scenario, size):
    assert snap_compare(app(model, scenario), terminal_size=size,
                        run_before=stepper(SCENARIO_STEPS[scenario]))


def test_help_screen(snap_compare, model):
    assert snap_compare(app(model), terminal_size=(80, 24), press=["question_mark"],
                        run_before=stepper(0))
