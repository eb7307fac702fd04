"""The tensor-parallel rank view: a real TP=2 bundled model on the CPU, a replayed trace with
ranks, a one-process model without the view, and the options that do not combine with TP."""

from __future__ import annotations

from pathlib import Path

import pytest

import tinyinfer
from tests.tui_pilot import settle, started
from tinyinfer.cli.commands import main as tinyinfer_main
from tinyinfer.errors import TinyInferError
from tui.app import TinyInferApp
from tui.options import Options
from tui.panels.pages import PagesPanel
from tui.panels.ranks import RanksPanel
from tui.scenarios import SCENARIOS
from tui.session import Session, load_model

TP = dict(runner="torch", tensor_parallel=2)


@pytest.fixture(scope="module")
def tp_model():
    """One TP=2 bundled model for the module (a process holds one at a time), closed at the end;
    loaded as the TUI loads it (its ranks time their collectives)."""
    model = load_model(Options(model="bundled", **TP))
    yield model
    model.runner.close()


def table(panel: RanksPanel) -> dict[str, list[str]]:
    """The rank table's rows by rank number, each split into its cells."""
    out = {}
    for line in panel.render().plain.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if cells and cells[0].isdigit():
            out[cells[0]] = cells
    return out


@pytest.mark.anyio
async def test_panel_shows_each_ranks_heads_pages_and_step_times(tp_model):
    options = Options(model="bundled", show_timings=True, **TP)
    async with TinyInferApp(options, model=tp_model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(RanksPanel)
        assert not panel.has_class("-off") and panel.region.height > 0
        for _ in range(3):
            await pilot.press("space")
            await settle(pilot)
        trace = screen.frame.traces[-1]
        assert trace.rank_timings["rank0_compute"] > 0 and trace.rank_timings["rank1_all_reduce"] > 0
        rows = table(panel)
        assert set(rows) == {"0", "1"}
        assert rows["0"][1:6] == ["0–1 (2)", "0 (1)", "64.0 KB", "0–463 (464)", "0–1023 (1024)"]
        assert rows["1"][1:6] == ["2–3 (2)", "1 (1)", "64.0 KB", "464–927 (464)", "1024–2047 (1024)"]
        for row in rows.values():
            compute, reduce = (float(t.removesuffix("ms")) for t in row[6:8])
            assert compute > 0 and reduce > 0
        text = panel.render().plain
        assert "2 ranks" in text and "128.0 KB page" in text and "→ all-reduce →" in text
        assert "split by KV head over 2 ranks" in screen.query_one(PagesPanel).render().plain
        assert "torch · 2 ranks" in screen.status_text
        # per-rank times split `forward` and live apart, so the metrics count each stage once
        assert not any(key.startswith("rank") for key in trace.timings)
        assert max(trace.rank_timings.values()) <= trace.timings["forward"]


@pytest.mark.anyio
async def test_replayed_trace_with_ranks_shows_the_panel(tp_model, tmp_path):
    path = tmp_path / "tp.jsonl"
    session = Session.live(tp_model, SCENARIOS["single"], record=path)
    for _ in range(2):
        session.begin_step()
        session.finish_step(session.compute_step())
    recorded = session.frames[-1].traces[-1].rank_timings
    options = Options(replay=path, show_timings=True)
    async with TinyInferApp(options).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(RanksPanel)
        assert not panel.has_class("-off")
        for _ in range(2):
            await pilot.press("space")
            await settle(pilot)
        rows = table(panel)
        assert rows["0"][1] == "0–1 (2)" and rows["1"][1] == "2–3 (2)"
        assert rows["1"][6] == f"{1e3 * recorded['rank1_compute']:.1f}ms"


@pytest.mark.anyio
async def test_one_process_model_has_no_rank_view():
    model = tinyinfer.load("bundled")
    options = Options(model="bundled", show_timings=False)
    async with TinyInferApp(options, model=model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await pilot.press("space")
        await settle(pilot)
        assert screen.query_one(RanksPanel).has_class("-off")
        assert "ranks" not in screen.query_one(PagesPanel).render().plain
        assert "ranks" not in screen.status_text and screen.session.tensor_parallel == 1


@pytest.mark.parametrize("options, says", [
    (Options(quantize="int8", **TP), "float weights only"),
    (Options(scenario="quantization", **TP), "float weights only"),
    (Options(runner="numpy", tensor_parallel=2), "drop --runner numpy"),
    (Options(replay=Path("run.jsonl"), **TP), "drop --tensor-parallel"),
])
def test_options_that_do_not_combine_with_tensor_parallel(options, says):
    with pytest.raises(TinyInferError, match=says):
        options.check()


def test_cli_refuses_before_starting_anything(capsys):
    assert tinyinfer_main(["tui", "--tensor-parallel", "2", "--quantize", "int8"]) == 2
    assert "float weights only" in capsys.readouterr().err


def test_switching_precision_is_refused_under_tensor_parallel(tp_model):
    session = Session.live(tp_model, SCENARIOS["single"])
    with pytest.raises(TinyInferError, match="split over 2 processes"):
        session.requantize("int8", "")
