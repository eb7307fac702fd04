"""The TUI's model of a run, without Textual: frames, stepping back, replay, scenarios, narration."""

from __future__ import annotations

import argparse
import io
import math

import pytest
from rich.console import Console
from rich.text import Text

import tinyinfer
from tui import cli
from tui.narration import Story, narrate
from tui.options import Options
from tui.scenarios import SCENARIOS
from tui.session import Session, open_session


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def run_to_end(session: Session, limit: int = 400) -> None:
    """Step a live session until its engine has nothing left (arrivals included)."""
    for _ in range(limit):
        if not session.engine_has_work:
            return
        session.begin_step()
        session.finish_step(session.compute_step())
    raise AssertionError(f"the scenario did not finish within {limit} steps")


def titles(session: Session) -> list[str]:
    story = Story(session.scenario.intro, session.source.precision)
    return [narrate(f, story).title for f in session.frames]


def test_start_frame_holds_the_tokenized_prompt(model):
    session = Session.live(model, SCENARIOS["single"])
    frame = session.frame
    prompt = SCENARIOS["single"].arrivals[0].prompt
    ids = model.tokenizer.encode(prompt)
    assert [t.token_id for t in frame.seqs[0].prompt] == ids
    assert "".join(t.text for t in frame.seqs[0].prompt) == prompt
    assert frame.steps_done == 0 and frame.pool.used == 0


def test_prefill_frame_owns_ceil_n_over_block_pages(model):
    session = Session.live(model, SCENARIOS["single"])
    n = len(session.frame.seqs[0].prompt)
    session.begin_step()
    session.finish_step(session.compute_step())
    pool = session.frame.pool
    owned = [p for p, owners in enumerate(pool.owners) if owners == (0,)]
    assert len(owned) == math.ceil(n / 16)
    seq = session.frame.seqs[0]
    assert seq.seq_id == 0 and seq.computed == n and len(seq.output) == 1


def test_abort_frees_the_pages(model):
    session = Session.live(model, SCENARIOS["single"])
    session.begin_step()
    session.finish_step(session.compute_step())
    session.abort(session.frame.seqs[0].request_id)
    frame = session.frame
    assert frame.event == "abort" and frame.seqs[0].finish_reason == "abort"
    assert frame.pool.used == 0 and all(not owners for owners in frame.pool.owners)
    assert not session.engine_has_work


def test_back_then_forward_replays_recorded_frames_without_stepping(model):
    session = Session.live(model, SCENARIOS["single"])
    for _ in range(3):
        session.begin_step()
        session.finish_step(session.compute_step())
    recorded = list(session.frames)
    steps = session.engine.step_count
    assert session.back() and session.back()
    assert session.frame is recorded[1]
    assert session.forward() and session.frame is recorded[2]
    assert session.forward() and session.at_end
    assert not session.forward()
    assert session.engine.step_count == steps


def test_every_scenario_runs_to_completion_and_tells_its_story(model):
    stories = {
        "single": {"Tokenize", "Prefill: the whole prompt in one step", "Decode: one token per step",
                   "A new page", "All requests finished"},
        "batching": {"Continuous batching: a request joins mid-flight", "Batched decode"},
        "prefix": {"Prefix cache hit"},
        "pressure": {"Preemption: the pool ran out of pages", "Recompute after preemption"},
        "speculative": {"Speculative decoding: draft, then verify"},
        "quantization": {"Decode on int8 weights"},
        "chunked": {"Continuous batching: a request joins mid-flight", "Chunked prefill"},
    }
    console = Console(width=78, file=io.StringIO())  # the narration's lines at 80x24
    for name, expected in stories.items():
        session = open_session(Options(model=str(model.path), scenario=name), model)
        run_to_end(session)
        frame = session.frame
        assert all(s.state == "finished" for s in frame.seqs), name
        assert len(frame.seqs) == len(SCENARIOS[name].arrivals), name
        assert frame.pool.used == 0, name
        missing = expected - set(titles(session))
        assert not missing, f"{name} never narrated {missing}"
        story = Story(session.scenario.intro, session.source.precision)
        for f in session.frames:
            said = narrate(f, story)
            assert len(Text(said.body).wrap(console, 78)) <= 6, f"{name}: too long for 80x24: {said}"
        later = [narrate(f, story).body for f in session.frames[3:]]
        assert max(later.count(b) for b in later) <= 2, f"{name} repeats itself"


def test_pressure_pool_fits_each_request_but_not_all(model):
    scenario = SCENARIOS["pressure"]
    session = Session.live(model, scenario)
    pages = session.engine.pool.num_pages
    run_to_end(session)
    assert sum(len(t.preempted) for t in session.frame.traces) > 0
    preempted = [s for s in session.frame.seqs if s.preemptions]
    assert preempted and all(len(s.output) == a.max_tokens or s.finish_reason == "stop"
                             for s, a in zip(session.frame.seqs, scenario.arrivals))
    assert pages < sum(math.ceil((len(s.prompt) + a.max_tokens) / scenario.page_size)
                       for s, a in zip(session.frame.seqs, scenario.arrivals))


def test_prefix_scenario_shares_pages_between_sequences(model):
    session = Session.live(model, SCENARIOS["prefix"])
    run_to_end(session)
    shared = [f for f in session.frames if f.pool and any(len(o) > 1 for o in f.pool.owners)]
    assert shared, "no frame showed a page held by two sequences"
    later = [s for s in session.frame.seqs[1:]]
    assert all(s.cached_tokens > 0 for s in later)


def test_recorded_trace_replays_into_the_same_frames(model, tmp_path):
    path = tmp_path / "run.jsonl"
    live = Session.live(model, SCENARIOS["batching"], record=path)
    run_to_end(live)
    replayed = Session.replay(path)
    # The trace carries every request's prompt tokens and every token's text: a replay is the
    # live run, frame for frame, late arrivals included (no "#id" stand-ins, no missing prompts).
    assert replayed.frames == live.frames
    late = live.frames[-1].seqs[-1]
    assert late.arrival_step > 0 and "".join(t.text for t in late.prompt) == SCENARIOS["batching"].arrivals[-1].prompt


def test_replay_of_a_bad_file_says_what_to_do(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(tinyinfer.TinyInferError, match="--record"):
        Session.replay(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(tinyinfer.TinyInferError, match="cannot replay"):
        Session.replay(broken)


def test_restart_gives_a_fresh_engine_with_one_prompt(model):
    session = Session.live(model, SCENARIOS["batching"])
    fresh = session.restart("HAMLET:\n")
    assert fresh.engine is not session.engine
    assert [s.seq_id for s in fresh.frame.seqs] == [None]
    assert len(fresh.frame.seqs) == 1 and fresh.pending == []
    assert fresh.engine.pool.num_pages == SCENARIOS["batching"].num_pages


def test_cli_wires_into_a_parent_parser(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="tinyinfer")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["tui", "--scenario", "prefix", "--free", "--no-timings"])
    assert (args.scenario, args.free, args.no_timings, args.model) == ("prefix", True, True, "bundled")
    missing = parser.parse_args(["tui", "--replay", str(tmp_path / "missing.jsonl")])
    assert cli.run(missing) == 2
    assert "record one with --record" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["tui", "--scenario", "nope"])


def test_importing_the_cli_does_not_import_textual():
    import subprocess
    import sys

    code = "import sys, tinyinfer, tui.cli; print('textual' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_speculative_frames_show_every_emitted_token_and_match_plain_decoding(text_model_folder):
    # The target drafting for itself: under greedy decoding every guess must be accepted.
    options = Options(model=str(text_model_folder), scenario="speculative",
                      draft_model=str(text_model_folder), num_draft=3)
    fast = open_session(options)
    assert fast.source.drafter == "draft model " + text_model_folder.name
    run_to_end(fast)
    verified = [p for t in fast.frame.traces for p in t.seqs if p.draft_tokens]
    assert verified and all(p.accepted == len(p.draft_tokens) for p in verified)
    assert all(len(p.emitted) == p.accepted + 1 for p in verified)
    assert "Every guess accepted, plus a bonus" in titles(fast)
    plain = fast.restart(speculative=False)
    assert plain.source.drafter == "" and plain.engine.drafter is None
    run_to_end(plain)
    fast_ids = [t.token_id for t in fast.frame.seqs[0].output]
    assert fast_ids == [t.token_id for t in plain.frame.seqs[0].output]
    assert len(fast_ids) == SCENARIOS["speculative"].arrivals[0].max_tokens
    assert len(fast.frame.traces) < len(plain.frame.traces)
    assert fast.frame.seqs[0].computed == plain.frame.seqs[0].computed


def test_without_a_draft_model_speculation_uses_prompt_lookup(text_model_folder):
    session = open_session(Options(model=str(text_model_folder), speculative=True))
    assert session.source.drafter == "prompt lookup"
    assert type(session.engine.drafter).__name__ == "PromptLookupDrafter"


@pytest.mark.parametrize("flags, drafter", [
    (["--speculative", "lookup"], "prompt lookup"),
    (["--speculative", "draft"], "draft model bundled-draft"),
    (["--speculative"], "draft model bundled-draft"),  # bare: a draft model when there is one
])
def test_cli_speculative_picks_the_drafter(flags, drafter):
    from tinyinfer.cli.commands import build_parser

    session = open_session(cli.options_from_args(build_parser().parse_args(["tui", *flags])))
    assert session.source.drafter == drafter
    assert session.speculation.on


def test_cli_draft_quantize_reaches_the_draft_model_alone():
    from tinyinfer.cli.commands import build_parser
    from tui.session import precision_of

    args = build_parser().parse_args(["tui", "--speculative", "draft", "--draft-quantize", "int4",
                                      "--draft-quantize-head"])
    session = open_session(cli.options_from_args(args))
    draft = session.engine.drafter.model
    assert precision_of(draft) == "int4-g128+head"
    assert precision_of(session.engine.model) == "fp32"


@pytest.mark.parametrize("flags, says", [
    (["--speculative", "lookup", "--draft-quantize", "int8"], "drop --speculative lookup"),
    (["--model", "a-model-folder", "--draft-quantize", "int8"], "give --draft-model"),
    (["--draft-quantize-head"], "name one with --draft-quantize"),
    (["--speculative", "draft", "--draft-quantize", "int9"], "int9"),
])
def test_cli_refuses_draft_quantize_where_it_cannot_apply(flags, says, capsys):
    from tinyinfer.cli.commands import main as tinyinfer_main

    assert tinyinfer_main(["tui", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_kv_cache_dtype_reaches_the_model_its_draft_and_a_reload():
    from tinyinfer.cli.commands import build_parser
    from tui.session import reload

    args = build_parser().parse_args(["tui", "--kv-cache-dtype", "int8", "--speculative", "draft"])
    session = open_session(cli.options_from_args(args))
    model = session.engine.model
    assert model.runner.info.kv_cache_dtype == "int8"
    assert session.engine.drafter.model.runner.info.kv_cache_dtype == "int8"
    assert reload(model, "int8").runner.info.kv_cache_dtype == "int8"
