"""The TUI as a class sees it, on the bundled model at 80x24 and 120x40: the fact each step is
about is on screen (not cut off by a panel's edge), and the narration follows the trace's events.

Each test drives the real app with Textual's pilot and reads the terminal's text, the way a
student reads it. Screens are deterministic: fixed seeds, times hidden.
"""

from __future__ import annotations

import re

import pytest

import tinyinfer
from tests.tui_pilot import screen_text, settle, started
from tinyinfer.model import BUNDLED
from tui.app import TinyInferApp
from tui.drawing import visible
from tui.frames import emitted
from tui.options import Options
from tui.panels.narration import NarrationPanel
from tui.panels.timeline import part_label
from tui.screens.run import RunScreen

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not (BUNDLED["bundled"] / "config.json").is_file(),
                       reason="the bundled model (tinyinfer/data/shakespeare) is not installed"),
]
SIZES = [(80, 24), (120, 40)]
size_ids = pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")


@pytest.fixture(scope="module")
def model():
    return tinyinfer.load("bundled", measure_error=True)


def app_for(model, scenario: str, **options) -> TinyInferApp:
    options.setdefault("show_timings", False)
    return TinyInferApp(Options(scenario=scenario, **options), model=model)


async def press(pilot, *keys: str) -> None:
    for key in keys:
        await pilot.press(key)
        await settle(pilot)


async def ready(pilot) -> RunScreen:
    """The run screen once it shows its session (and, in quantization runs, the measured errors)."""
    return await started(pilot, lambda screen: screen.quant_report is not None
                         or not screen.session.source.precision)


def narration_shown(screen: RunScreen) -> str:
    """The narration as the panel wraps it, failing if the panel cuts any of it off."""
    panel = screen.query_one(NarrationPanel)
    lines = panel.render().wrap(screen.app.console, panel.content_size.width)
    assert len(lines) <= panel.content_size.height, f"the narration is cut off: {panel.render().plain}"
    return panel.render().plain


# ---------------------------------------------------------------------- the evidence, uncut


@size_ids
async def test_batching_timeline_shows_every_part_of_the_mixed_step(model, size):
    async with app_for(model, "batching").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, *["space"] * 4)
        mixed = screen.frame.trace
        assert {p.kind for p in mixed.seqs} == {"prefill", "decode"}
        text = screen_text(pilot.app)
        for part in mixed.seqs:
            assert part_label(part) in text, f"{part_label(part)} is cut off:\n{text}"


@size_ids
async def test_single_shows_the_prefill_and_the_pages_it_took(model, size):
    async with app_for(model, "single").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, "space")
        trace = screen.frame.trace
        text = screen_text(pilot.app)
        assert part_label(trace.seqs[0]) in text and f"+{len(trace.pages_allocated)} allocated" in text


@size_ids
async def test_pressure_shows_who_was_preempted(model, size):
    async with app_for(model, "pressure").run_test(size=size) as pilot:
        screen = await ready(pilot)
        while not screen.frame.trace or not screen.frame.trace.preempted:
            await press(pilot, "space")
        victim = screen.frame.trace.preempted[0]
        text = screen_text(pilot.app)
        assert f"preempted s{victim}" in text and "preempted ×1" in text, text


@size_ids
async def test_chunked_timeline_shows_each_chunk_beside_the_decodes(model, size):
    async with app_for(model, "chunked").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, *["space"] * 6)
        chunks = [p for t in screen.frame.traces[3:] for p in t.seqs if p.seq_id == 2]
        assert len(chunks) >= 3 and all(p.kind == "prefill" for p in chunks)
        text = screen_text(pilot.app)
        for part in chunks:
            assert part_label(part) in text, f"{part_label(part)} is cut off:\n{text}"


@size_ids
async def test_speculative_panel_shows_the_replacement_of_a_rejected_guess(model, size):
    async with app_for(model, "speculative").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, *["space"] * 8)
        part = screen.frame.trace.seqs[0]
        assert part.accepted < len(part.draft_tokens), "step 8 rejects a guess"
        replacement = repr(visible(screen.frame.text(emitted(part)[-1])))
        rejected = repr(visible(screen.frame.text(part.draft_tokens[part.accepted])))
        text = screen_text(pilot.app)
        assert f"✗{rejected}→{replacement}" in text, text


@size_ids
async def test_attention_says_how_many_positions_share_a_column(model, size):
    async with app_for(model, "prefix", walkthrough=False).run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, "space", "v")  # 64 prompt tokens: wider than the panel
        panel = screen.query_one("#attention")
        assert panel.display
        per = -(-screen.frame.seqs[0].samples[-1].end // (panel.content_size.width - 5))
        assert per > 1
        assert f"{per} pos/col" in screen_text(pilot.app)


@size_ids
async def test_quantization_panel_is_on_screen_with_its_whole_header(model, size):
    async with app_for(model, "quantization").run_test(size=size) as pilot:
        screen = await ready(pilot)
        assert "weights int8" in screen_text(pilot.app), "the run's own panel starts on screen"
        await press(pilot, "m")
        screen = await ready(pilot)
        await press(pilot, "space")
        errors = screen.quant_report.errors
        mean = sum(e.relative for e in errors) / len(errors)
        text = screen_text(pilot.app)
        assert "weights int4-g128" in text and f"{100 * mean:.2f}%" in text, text


@size_ids
async def test_the_sampled_token_shows_its_real_probability(model, size):
    async with app_for(model, "prefix").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, *["space"] * 4)
        part = screen.frame.focus(None).last_sample
        name = repr(visible(screen.frame.text(part.token_id)))
        row = next(line for line in screen_text(pilot.app).splitlines() if f"▶ {name[:9]}" in line)
        assert "cut" not in row and "·" not in row, row
        assert part.token_prob is not None and part.token_prob > 0


# ---------------------------------------------------------------------- the narration


@size_ids
async def test_decode_steps_do_not_repeat_the_same_text(model, size):
    async with app_for(model, "single").run_test(size=size) as pilot:
        screen = await ready(pilot)
        bodies = []
        while screen.session.engine_has_work:
            await press(pilot, "space")
            bodies.append(narration_shown(screen))
        decode_steps = bodies[2:-1]
        assert len(set(decode_steps)) == len(decode_steps), "a later step repeats an earlier text"
        assert sum("memory-bound" in b for b in bodies) == 1, "the decode lecture comes once"


@size_ids
async def test_pressure_narrates_the_recompute_of_preempted_requests(model, size):
    async with app_for(model, "pressure").run_test(size=size) as pilot:
        screen = await ready(pilot)
        preempted: set[int] = set()
        while screen.session.engine_has_work:
            await press(pilot, "space")
            trace = screen.frame.trace
            if set(trace.admitted) & preempted:
                break
            preempted |= set(trace.preempted)
        back = [p for p in trace.seqs if p.seq_id in preempted and p.kind == "prefill"]
        positions = sum(p.end - p.start for p in back)
        assert screen.narration.title == "Recompute after preemption"
        assert f"{positions} positions" in narration_shown(screen)


@size_ids
async def test_speculative_narration_fits_the_measurements_and_follows_d(model, size):
    async with app_for(model, "speculative").run_test(size=size) as pilot:
        screen = await ready(pilot)
        await press(pilot, "space", "space")
        first = narration_shown(screen)
        assert "on a CPU it costs more" in first, "a verify pass is not free on this machine"
        await press(pilot, "d")
        assert screen.session.engine.drafter is None
        said = narration_shown(screen)
        assert "drafter guesses" not in said and "Speculative decoding is off" in said


@size_ids
async def test_quantization_runs_keep_talking_about_the_weights(model, size):
    async with app_for(model, "quantization").run_test(size=size) as pilot:
        screen = await ready(pilot)
        titles = []
        for _ in range(5):
            await press(pilot, "space")
            narration_shown(screen)
            titles.append(screen.narration.title)
        assert sum("int8" in t for t in titles) >= 3, titles


@size_ids
async def test_quantization_bars_share_one_scale_across_precisions(model, size):
    def bar_cells(text: str) -> float:
        row = next(line for line in text.splitlines() if "▶0.q" in line)
        bar = row.split("▶0.q", 1)[1].split("%")[0]
        eighths = {c: (i + 1) / 8 for i, c in enumerate("▏▎▍▌▋▊▉█")}
        return sum(eighths.get(c, 0) for c in bar)

    async with app_for(model, "quantization").run_test(size=size) as pilot:
        await ready(pilot)
        int8 = bar_cells(screen_text(pilot.app))
        await press(pilot, "m")
        await ready(pilot)
        int4 = bar_cells(screen_text(pilot.app))
        assert 0 < int8 < 1 and int4 > 8 * int8, (int8, int4)


@size_ids
async def test_a_replay_shows_every_prompt_and_token_as_text(model, size, tmp_path):
    path = tmp_path / "run.jsonl"
    async with app_for(model, "single", record=path).run_test(size=size) as pilot:
        await ready(pilot)
        await press(pilot, "space", "space", "a", "enter", "space", "space")
    replay = TinyInferApp(Options(replay=path, show_timings=False))
    async with replay.run_test(size=size) as pilot:
        screen = await started(pilot)
        await press(pilot, *["space"] * 4)
        added = screen.frame.seqs[-1]
        assert added.arrival_step == 2 and added.prompt, "the added request's prompt is in the trace"
        text = screen_text(pilot.app)
        assert "not in the trace" not in text
        assert not re.search(r"#\d+", text), text
        words = "".join(t.text for t in added.prompt).split(":")[0]
        assert words in text
