"""Pilot tests of the TUI: every key binding, and each panel's state after scripted steps."""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np
import pytest
from rich.cells import cell_len

import tinyinfer
from tests.tui_pilot import settle, started
from tui.app import TinyInferApp
from tui.drawing import visible
from tui.options import Options
from tui.panels import (
    AttentionPanel,
    MetricsPanel,
    NextTokenPanel,
    PagesPanel,
    SpeculativePanel,
    TimelinePanel,
    TokensPanel,
)
from tui.panels.narration import NarrationPanel
from tui.scenarios import SCENARIOS
from tui.statusbar import StatusPart, fit, line_text
from tui.screens.help import HelpScreen
from tui.screens.loading import LoadingScreen
from tui.screens.prompt import PromptScreen
from tui.screens.sampling import SamplingScreen

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def make_app(model, **options) -> TinyInferApp:
    options.setdefault("model", str(model.path))
    options.setdefault("show_timings", False)
    options.setdefault("run_interval", 0.01)
    return TinyInferApp(Options(**options), model=model)


async def press(pilot, *keys: str) -> None:
    for key in keys:
        await pilot.press(key)
        await settle(pilot)


def shown(widget) -> str:
    """The plain text a panel renders right now."""
    return widget.render().plain


# ---------------------------------------------------------------------- panels after steps


async def test_prefill_fills_ceil_n_pages_of_seq_0_and_abort_frees_them(model):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        n = len(model.tokenizer.encode(SCENARIOS["single"].arrivals[0].prompt))
        pages = screen.query_one(PagesPanel)
        assert set(pages.labels()) == {"·"}
        await press(pilot, "space")
        labels = pages.labels()
        assert labels.count("0") == math.ceil(n / 16)
        assert set(labels) == {"0", "·"}
        assert "step 1: +%d allocated" % math.ceil(n / 16) in shown(pages)
        await press(pilot, "x")
        assert "0" not in pages.labels() and set(pages.labels()) <= {"·", "○"}
        assert "finished (abort)" in shown(screen.query_one(TokensPanel))


async def test_panels_after_prefill_and_decodes(model):
    app = make_app(model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "space", "space")
        frame = screen.frame
        seq = frame.seqs[0]
        n = seq.prompt_len
        timeline = shown(screen.query_one(TimelinePanel))
        assert f"s0 pre 0:{n}" in timeline
        assert f"s0 dec@{n}" in timeline and f"s0 dec@{n + 1}" in timeline
        tokens = shown(screen.query_one(TokensPanel))
        assert "seq 0 decoding" in tokens
        assert tokens.replace("\n", "").endswith("".join(visible(t.text) for t in seq.output))
        next_token = shown(screen.query_one(NextTokenPanel))
        assert "at step 3 sampled" in next_token and "▶" in next_token
        attention = shown(screen.query_one(AttentionPanel))
        assert "layer 1/2 head 1/4" in attention and f"query @{n + 1}" in attention
        assert len([line for line in attention.splitlines() if re.match(r"\s*\d+ [ ░▒▓█]+$", line)]) == 3
        metrics = shown(screen.query_one(MetricsPanel))
        assert f"3 steps · {n} prefill + 2 decode" in metrics
        assert "times hidden" in metrics and "ms" not in metrics
        assert "Decode" in screen.query_one(NarrationPanel).border_title


async def test_timings_show_only_when_switched_on(model):
    app = make_app(model, show_timings=True)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "space")
        metrics = shown(screen.query_one(MetricsPanel))
        assert "TTFT s0 " in metrics and "ms" in metrics and "tok/s" in metrics
        assert "ms" in shown(screen.query_one(TimelinePanel))


async def test_batching_mixes_prefill_and_decode_in_one_step(model):
    app = make_app(model, scenario="batching")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, *["space"] * 4)
        trace = screen.frame.traces[3]  # step 4: seq 2 arrived after 3 steps
        assert {p.kind for p in trace.seqs} == {"prefill", "decode"}
        timeline = shown(screen.query_one(TimelinePanel))
        row = timeline[timeline.index("  4 "):]  # step 4's line and its continuation lines
        assert "s0 dec@" in row and "s1 dec@" in row and "s2 pre 0:" in row
        assert screen.narration.title.startswith("Continuous batching")


async def test_prefix_scenario_marks_shared_pages(model):
    app = make_app(model, scenario="prefix")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, *["space"] * 4)
        hits = screen.frame.traces[-1].prefix_hit_pages
        assert hits, "the second request did not hit the prefix cache"
        labels = screen.query_one(PagesPanel).labels()
        assert [labels[p] for p in hits] == ["×2"] * len(hits)
        assert "prefix hits" in shown(screen.query_one(MetricsPanel))
        assert screen.narration.title == "Prefix cache hit"


async def test_pressure_scenario_shows_preemption(model):
    app = make_app(model, scenario="pressure")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        for _ in range(60):
            await press(pilot, "space")
            if screen.frame.traces[-1].preempted:
                break
        victim = screen.frame.traces[-1].preempted[0]
        assert screen.narration.title.startswith("Preemption")
        assert f"preempted s{victim}" in shown(screen.query_one(PagesPanel))
        assert str(victim) not in screen.query_one(PagesPanel).labels()
        assert "preempted ×1" in shown(screen.query_one(TokensPanel))


async def test_speculative_panel_marks_accepted_guesses_and_the_bonus(model, text_model_folder):
    # The target drafting for itself under greedy decoding: every guess is accepted.
    app = make_app(model, scenario="speculative",
                   draft_model=str(text_model_folder), num_draft=3)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(SpeculativePanel)
        assert panel.display and "draft model" in shown(panel)
        # before any verification the note wraps to the panel (it was cut with an ellipsis)
        width = panel.content_size.width
        note = shown(panel).splitlines()[1:]
        assert " ".join(line.strip() for line in note if line.strip()) == (
            "No draft verified yet: drafting starts once a sequence decodes.")
        assert all(len(line.rstrip()) <= width for line in note)
        await press(pilot, "space", "space")
        part = screen.frame.trace.seqs[0]
        assert part.draft_tokens and part.accepted == 3
        text = shown(panel)
        assert "accepted 3/3 (100%) · 4.0 tok/pass" in text
        row = text.splitlines()[-1]
        assert row.count("✓") == 3 and "+" in row and "✗" not in row
        assert f"s0 ver@{part.start} 3/3" in shown(screen.query_one(TimelinePanel))
        assert screen.narration.title == "Speculative decoding: draft, then verify"
        assert screen.query_one(TimelinePanel).region.width > 100, "timeline spans the width"
        await press(pilot, "space")
        assert screen.narration.title == "Every guess accepted, plus a bonus"


async def test_d_switches_speculative_decoding(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(SpeculativePanel)
        assert not panel.display and screen.session.engine.drafter is None
        await press(pilot, "space", "d")
        assert screen.session.engine.drafter is not None and screen.frame.steps_done == 0
        assert "drafts: prompt lookup" in str(screen.query_one("#status").render())
        assert panel.display, "a run with speculation starts with its panel in the shared slot"
        await press(pilot, "d")
        assert screen.session.engine.drafter is None and not panel.display


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_status_line_drops_its_least_important_parts_to_fit(model, size):
    async with make_app(model, scenario="speculative").run_test(size=size) as pilot:
        screen = await started(pilot)
        await press(pilot, "space")
        line = str(screen.query_one("#status").render())
        assert cell_len(line) <= size[0], line
        for kept in ("step 1", "live", screen.session.source.model, "numpy", "drafts: prompt lookup"):
            assert kept in line, (kept, line)
        wide = size[0] >= 120
        assert ("tinyinfer" in line) == wide and (" · speculative" in line) == wide, line
        assert " · speculative · drafts:" in screen.status_text, "the whole line keeps every part"


def test_fit_drops_lowest_ranks_first_and_keeps_the_order():
    parts = (StatusPart("step 3", 9, 0), StatusPart("live", 5, 0), StatusPart("model", 8, 1),
             StatusPart("scenario", 1, 1), StatusPart("drafts: x", 6, 1))
    assert fit(parts, 200) == parts
    assert line_text(parts) == "step 3 · live │ model · scenario · drafts: x"
    assert line_text(fit(parts, 33)) == "step 3 · live │ model · drafts: x"
    assert line_text(fit(parts, 26)) == "step 3 │ model · drafts: x"
    assert fit(parts, 1) == (parts[0],), "the highest-ranked part always stays"


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
async def test_waiting_messages_wrap_instead_of_being_cut(model, size):
    async with make_app(model).run_test(size=size) as pilot:
        screen = await started(pilot)
        for panel, ending in ((NextTokenPanel, "prefill step."), (AttentionPanel, "with prefill.")):
            widget = screen.query_one(panel)
            if not widget.display:
                continue
            lines = shown(widget).splitlines()
            assert len(lines) > 1 and lines[-1].endswith(ending)
            assert max(len(line) for line in lines) <= widget.content_size.width


@pytest.mark.skipif(importlib.util.find_spec("tinyinfer.runners.torch_fast") is None,
                    reason="the torch runner module tinyinfer.runners.torch_fast is not present")
async def test_torch_runner_updates_panels_and_labels_attention(text_model_folder):
    torch_model = tinyinfer.load(text_model_folder, runner="torch")
    app = make_app(torch_model)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "space")
        assert screen.query_one(PagesPanel).labels().count("0") >= 1
        assert "at step 2 sampled" in shown(screen.query_one(NextTokenPanel))
        assert "reference runner only" in shown(screen.query_one(AttentionPanel))


async def test_replay_steps_through_a_recorded_run(model, tmp_path):
    path = tmp_path / "run.jsonl"
    async with make_app(model, record=path).run_test(size=(120, 40)) as pilot:
        await started(pilot)
        await press(pilot, "space", "space", "space")
    replay = TinyInferApp(Options(replay=path, show_timings=False))
    async with replay.run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        assert "replay" in screen.narration.title.lower()
        await press(pilot, "space")
        tokens = shown(screen.query_one(TokensPanel))
        assert "".join(t.text for t in screen.frame.seqs[0].prompt).replace("\n", "↵")[:20] in tokens
        await press(pilot, "space", "space", "space")
        assert screen.session.at_end and screen.frame.steps_done == 3
        assert "layer 1/2" in shown(screen.query_one(AttentionPanel))
        await press(pilot, "a", "n", "x", "d")
        assert pilot.app.screen is screen, "a replay has no engine to change"
        assert len(screen.session.frames) == 4 and screen.session.engine is None


async def test_a_missing_model_says_why_on_the_loading_screen(tmp_path):
    app = TinyInferApp(Options(model=str(tmp_path / "nowhere")))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, failures_expected=True)  # however far the load got by now
        screen = pilot.app.screen
        assert isinstance(screen, LoadingScreen)
        for _ in range(50):  # the worker's end reaches the screen as a message: let it arrive
            if "failed" in str(screen.query_one("#loading-text").render()):
                break
            await pilot.pause()
        assert "failed" in str(screen.query_one("#loading-text").render())


# ---------------------------------------------------------------------- bindings


async def test_space_right_back_left_and_end(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "right", "space")
        assert screen.session.engine.step_count == 3 and screen.frame.index == 3
        await press(pilot, "b", "left")
        assert screen.frame.index == 1 and screen.session.engine.step_count == 3
        assert "replaying" in str(screen.query_one("#status").render())
        await press(pilot, "space")
        assert screen.frame is screen.session.frames[2] and screen.session.engine.step_count == 3
        await press(pilot, "end")
        assert screen.session.at_end and "live" in str(screen.query_one("#status").render())


async def test_r_runs_to_the_end_and_pauses(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "r")
        for _ in range(500):
            await pilot.pause(0.01)
            if not screen.running:
                break
        await settle(pilot)
        assert not screen.running
        assert all(s.state == "finished" for s in screen.frame.seqs)
        assert screen.narration.title == "All requests finished"
        await press(pilot, "r")
        assert not screen.running, "nothing left to run, so r must not start running"


async def test_r_pauses_a_running_engine(model):
    async with make_app(model, run_interval=0.05).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "r")
        await pilot.pause(0.2)
        await press(pilot, "r")
        steps = screen.session.engine.step_count
        await pilot.pause(0.2)
        await settle(pilot)
        assert not screen.running and 0 < screen.session.engine.step_count <= steps + 1


async def test_n_starts_a_new_prompt(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "space", "n")
        dialog = pilot.app.screen
        assert isinstance(dialog, PromptScreen)
        dialog.query_one("#prompt").value = "HAMLET:\\nWho's there?"
        await press(pilot, "enter")
        assert pilot.app.screen is screen
        seq = screen.frame.seqs[0]
        assert "".join(t.text for t in seq.prompt) == "HAMLET:\nWho's there?"
        assert len(screen.frame.seqs) == 1 and screen.frame.steps_done == 0
        await press(pilot, "space")
        assert screen.frame.seqs[0].seq_id == 0
        await press(pilot, "n", "escape")
        assert pilot.app.screen is screen and screen.frame.steps_done == 1


async def test_a_adds_a_concurrent_request(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "a")
        assert isinstance(pilot.app.screen, PromptScreen)
        await press(pilot, "enter")
        assert screen.frame.event == "add" and len(screen.frame.seqs) == 2
        assert "waiting" in shown(screen.query_one(TokensPanel))
        await press(pilot, "space")
        assert "1" in screen.query_one(PagesPanel).labels()
        kinds = {(p.seq_id, p.kind) for p in screen.frame.trace.seqs}
        assert kinds == {(0, "decode"), (1, "prefill")}


async def test_s_sets_sampling_exactly_and_rejects_bad_values(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "s")
        dialog = pilot.app.screen
        assert isinstance(dialog, SamplingScreen)
        dialog.query_one("#top_p").value = "1.5"
        await press(pilot, "enter")
        assert pilot.app.screen is dialog
        assert "top_p" in str(dialog.query_one("#sampling-error").render())
        dialog.query_one("#top_p").value = "1.0"
        dialog.query_one("#temperature").value = "0"
        await press(pilot, "enter")
        assert pilot.app.screen is screen and screen.sampling.temperature == 0
        preview = [line for line in shown(screen.query_one(NextTokenPanel)).splitlines()[2:-1]]
        assert sum("1.0" in line for line in preview) == 1, "greedy preview must be one-hot"
        await press(pilot, "s", "escape")
        assert pilot.app.screen is screen and screen.sampling.temperature == 0


async def test_temperature_top_k_top_p_keys_change_the_preview(model):
    async with make_app(model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space")
        panel = screen.query_one(NextTokenPanel)
        await press(pilot, "T", "T")
        assert screen.sampling.temperature == pytest.approx(1.0)
        assert "T=1.0" in shown(panel)
        await press(pilot, "t")
        assert screen.sampling.temperature == pytest.approx(0.9)
        await press(pilot, "K")
        assert screen.sampling.top_k == 0, "top-k is off already: all candidates"
        await press(pilot, "k", "k", "k")
        assert screen.sampling.top_k == 5 and "top-k=5" in shown(panel)
        await press(pilot, "k", "k")
        assert screen.sampling.top_k == 1
        rows = shown(panel).splitlines()[2:-1]
        kept = [row for row in rows if row.split()[-1] not in ("cut", "·")]
        assert len(kept) == 1 and "1.0" in kept[0], "top-k 1 keeps exactly one token"
        await press(pilot, "p")
        assert screen.sampling.top_p == 0.9
        await press(pilot, "P", "P")
        assert screen.sampling.top_p == 1.0 and "top-p=1.00" in shown(panel)


async def test_layer_and_head_keys_choose_the_heatmap(model):
    async with make_app(model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space")
        panel = screen.query_one(AttentionPanel)
        await press(pilot, "l")
        assert "layer 2/2 head 1/4" in shown(panel)
        await press(pilot, "h", "h", "h")
        assert "layer 2/2 head 4/4" in shown(panel)
        await press(pilot, "H", "L", "L")
        assert "layer 2/2 head 3/4" in shown(panel)


async def test_f_follows_each_sequence_then_auto(model):
    async with make_app(model, scenario="batching").run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space", "f")
        assert screen.focus_seq == 0
        await press(pilot, "f")
        assert screen.focus_seq == 1
        assert shown(screen.query_one(NextTokenPanel)).startswith("seq 1")
        assert "▶ seq 1" in shown(screen.query_one(TokensPanel))
        await press(pilot, "f")
        assert screen.focus_seq is None


async def test_i_shows_token_ids(model):
    async with make_app(model).run_test(size=(120, 40)) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(TokensPanel)
        first = screen.frame.seqs[0].prompt[0]
        assert shown(panel).splitlines()[1].startswith(first.text)
        await press(pilot, "i")
        assert shown(panel).splitlines()[1].startswith(f"{first.token_id} ")
        await press(pilot, "i")
        assert shown(panel).splitlines()[1].startswith(first.text)


async def test_v_swaps_the_shared_slot_on_small_screens(model):
    async with make_app(model, walkthrough=False).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        in_slot = lambda: [p.id for p in screen.query(".swap") if p.display]  # noqa: E731
        assert in_slot() == ["next_token"]
        await press(pilot, "v")
        assert in_slot() == ["attention"]
        await press(pilot, "v", "v")
        assert in_slot() == ["next_token"]


async def test_the_footer_offers_v_where_panels_share_a_slot(model):
    """At 80 x 24 four panels and a shared slot fit, and the footer names the key that cycles
    the slot, beside every other key it showed there (q Quit included); at 120 x 40 every panel
    is on screen and v is gone from the footer; a resize moves it."""
    from textual.widgets._footer import FooterKey

    def footer_keys(screen) -> list[str]:
        return [key.key for key in screen.query(FooterKey)]

    async def settled(pilot, screen, want_v: bool) -> list[str]:
        """The footer's keys once the resize has been handled (its timer fires on the app's
        clock; waited for by what it changes, a bounded number of turns)."""
        for _ in range(100):
            keys = footer_keys(screen)
            if ("v" in keys) == want_v:
                return keys
            await pilot.pause(0.02)
        return footer_keys(screen)

    async with make_app(model, walkthrough=False).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        assert footer_keys(screen) == ["space", "r", "b", "n", "a", "s", "c", "question_mark", "v", "q"]
        await pilot.resize_terminal(120, 40)
        assert "v" not in await settled(pilot, screen, want_v=False)
        assert not [p.id for p in screen.query(".swap") if not p.display and not p.has_class("-off")]
        await pilot.resize_terminal(80, 24)
        assert "v" in await settled(pilot, screen, want_v=True)


async def test_w_toggles_the_walkthrough(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        narration = screen.query_one(NarrationPanel)
        assert narration.display and narration.narration.title == "Tokenize"
        assert screen.query_one(TokensPanel).has_class("-highlight")
        await press(pilot, "w")
        assert not narration.display
        assert not screen.query(".-highlight")
        await press(pilot, "w")
        assert narration.display


async def test_question_mark_opens_help_and_escape_closes_it(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "question_mark")
        assert isinstance(pilot.app.screen, HelpScreen)
        await press(pilot, "escape")
        assert pilot.app.screen is screen


async def test_q_quits(model):
    app = make_app(model)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


# ---------------------------------------------------------------------- layout


async def test_big_terminals_show_every_panel_side_by_side(model):
    async with make_app(model).run_test(size=(160, 48)) as pilot:
        screen = await started(pilot)
        regions = [p.region for p in screen.query(".panel") if p.display]
        assert len(regions) == 6 and all(r.width >= 50 and r.height >= 15 for r in regions)
        assert not any(a.overlaps(b) for i, a in enumerate(regions) for b in regions[i + 1:])


async def test_80x24_shows_four_panels_and_the_narration(model):
    async with make_app(model).run_test(size=(80, 24)) as pilot:
        screen = await started(pilot)
        await press(pilot, "space")
        panels = [p for p in screen.query(".panel") if p.display]
        assert [p.id for p in panels] == ["tokens", "pages", "next_token", "timeline"]
        assert all(p.region.height >= 6 and p.region.width >= 38 for p in panels)
        narration = screen.query_one(NarrationPanel)
        wrapped = narration.render().wrap(pilot.app.console, narration.content_size.width)
        assert len(wrapped) <= narration.content_size.height, "the narration is cut off"


@pytest.mark.parametrize("temperature, tolerance", [(0.8, 1e-6), (1.0, 1e-6), (1.3, 1e-6), (1.25, 0.01)])
@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0),
                                                 (5, 1.0, 0.0), (0, 1.0, 0.1)])
def test_preview_is_the_sampler_over_the_whole_vocabulary(model, temperature, tolerance, top_k, top_p,
                                                          min_p):
    # The trace keeps 64 logits and the rest's log-sum-exp at 0.1 steps of temperature: the
    # preview of a setting is what the sampler gives on the full row (between steps: close).
    from tinyinfer.sampling import probs_from_logits
    from tui.panels.next_token import preview_probs

    engine = tinyinfer.Engine(model, detail="full")
    prompt = model.tokenizer.encode("ROMEO:\nBut soft")
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=1.0, seed=2, max_tokens=4))
    parts = []
    while engine.has_unfinished():
        parts.append(engine.step().seqs[0])
    out = engine.release(rid).token_ids
    params = tinyinfer.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for i, part in enumerate(parts):
        full = probs_from_logits(model.logits(prompt + out[:i])[-1], params)
        preview = preview_probs(part, params)
        inside = np.count_nonzero(full) <= len(part.top_logits)  # the filters end among the 64
        assert max(abs(preview[t] - full[t]) for t in preview) <= (tolerance if inside else 0.01)


def test_token_text_never_reaches_the_terminal_as_a_control_code():
    assert visible("\x05a\x1b[31m\n\t\r\x7f") == "␅a␛[31m↵→␍␡"
    assert visible("") == "∅"
