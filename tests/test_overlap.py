"""Asynchronous scheduling: the same tokens, finishes and per-step records as the step-through
engine, on both runners, while each decode step is launched before the one before is read."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import tinyinfer
from tests.conftest import nan_embedding_copy
from tinyinfer.errors import TinyInferError
from tinyinfer.sampling import SamplingParams
from tinyinfer.speculative import PromptLookupDrafter

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def model(oracle_model, runner_name):
    folder, _ = oracle_model("llama-gqa-untied")
    return tinyinfer.load(folder, runner=runner_name)


@pytest.fixture
def text_model(runner_name):
    return tinyinfer.load("bundled", runner=runner_name)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 320, int(k)).tolist() for k in rng.integers(2, 40, n)]


def fed_launches(monkeypatch, runner) -> list[int]:
    """Record, for each launch_top the runner gets, its rows if its tokens were fed, else 0
    (the real runner still does the work)."""
    launches: list[int] = []
    real = runner.launch_top

    def launch_top(batch, kv_cache, k, feed=None):
        launches.append(batch.num_seqs if feed is not None else 0)
        return real(batch, kv_cache, k, feed)

    monkeypatch.setattr(runner, "launch_top", launch_top)
    return launches


def run(engine: tinyinfer.Engine, requests, between=None):
    """Queue (prompt, params) pairs, step to the end (calling between(engine, step_index) after
    each step), return completions and the step records."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
        engine.pool.check()
        if between is not None:
            ids += between(engine, len(traces))
    assert engine.pool.num_used_pages == 0  # every page freed, wasted rows' included
    return [engine.release(i) for i in ids], traces


def records(traces):
    return [[(s.request_id, s.kind, s.start, s.end, s.token_id, s.finish_reason) for s in t.seqs]
            for t in traces]


def engines(model, **options):
    return (tinyinfer.Engine(model, detail="none", **options),
            tinyinfer.Engine(model, detail="none", async_scheduling=True, **options))


def test_async_greedy_equals_sync_token_for_token_and_step_for_step(model, monkeypatch):
    requests = [(p, SamplingParams(temperature=0, max_tokens=int(n)))
                for p, n in zip(prompts(5), np.random.default_rng(1).integers(3, 20, 5))]
    sync, overlapped = engines(model)
    want, sync_traces = run(sync, requests)
    launches = fed_launches(monkeypatch, model.runner)
    got, traces = run(overlapped, requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want] == ["length"] * 5
    assert [c.logprobs for c in got] == [c.logprobs for c in want]
    # Each step's record describes what that step computed, as the step-through engine's does.
    assert records(traces) == records(sync_traces)
    assert [t.finished for t in traces] == [t.finished for t in sync_traces]
    # One unfed launch (the prefill), then every decode step fed from the step before.
    assert launches[0] == 0 and all(launches[1:]) and len(launches) == len(traces)
    assert all(t.device_seconds is None for t in traces)  # the CPU does not time its steps


def test_end_tokens_and_stop_strings_drop_the_row_launched_ahead(text_model, monkeypatch):
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    texts = ["ROMEO:", "JULIET: O", "First Citizen:\nBefore we"]
    reference = tinyinfer.Engine(text_model).generate(texts, plain)
    # End each request early: at a token id it produces, or at a piece of text it writes.
    stop_id = reference[0].token_ids[6]
    stop_text = reference[1].text[10:14]
    requests = [(texts[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_id,))),
                (texts[1], SamplingParams(temperature=0, max_tokens=30, stop=(stop_text,))),
                (texts[2], plain)]
    sync, overlapped = engines(text_model)
    want, sync_traces = run(sync, requests)
    launches = fed_launches(monkeypatch, text_model.runner)
    got, traces = run(overlapped, requests)
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == \
        [(c.token_ids, c.text, c.finish_reason) for c in want]
    assert [c.finish_reason for c in got] == ["stop", "stop", "length"]
    assert records(traces) == records(sync_traces)
    # The stopped sequences' rows of the step after were computed (launched ahead) and dropped.
    assert launches[0] == 0 and all(launches[1:])
    assert sum(launches) > sum(len(t.seqs) for t in traces[1:])


def test_abort_mid_flight_and_requests_added_while_a_step_runs(model):
    first, second, late = prompts(3, seed=2)

    def between(engine, step):
        if step == 3:  # a step is in flight: its row of this request is dropped
            engine.abort_request("req-0")
        if step == 4:
            return [engine.add_request(late, GREEDY, request_id="late")]
        return []

    results = []
    for engine in engines(model):
        results.append(run(engine, [(first, GREEDY), (second, GREEDY)], between)[0])
    want, got = results
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    assert got[0].finish_reason == "abort" and len(got[0].token_ids) == 3
    assert got[2].token_ids == tinyinfer.Engine(model).generate([late], GREEDY)[0].token_ids


def test_preemption_and_chunked_prefill_drain_the_pipeline_and_agree(model):
    requests = [(p, SamplingParams(temperature=0, max_tokens=int(n)))
                for p, n in zip(prompts(8, seed=3), np.random.default_rng(4).integers(4, 24, 8))]
    options = dict(num_pages=20, page_size=4, max_num_batched_tokens=40, max_num_seqs=4)
    sync, overlapped = engines(model, **options)
    want, _ = run(sync, requests)
    got, traces = run(overlapped, requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert sum(len(t.preempted) for t in traces) > 0, "the tiny pool never forced a preemption"


def test_seeded_sampling_runs_one_step_at_a_time_and_agrees(model, monkeypatch):
    mixed = [(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=i) if i % 2 else GREEDY)
             for i, p in enumerate(prompts(4, seed=5))]
    sync, overlapped = engines(model)
    want, _ = run(sync, mixed)
    launches = fed_launches(monkeypatch, model.runner)
    got, _ = run(overlapped, mixed)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    # While a sampled request runs, steps take full logits one at a time; once both end (10
    # tokens) the two greedy ones (12) take their 11th token from a top-k step and their 12th
    # from one launched ahead of it.
    assert launches == [0, 2]


def test_a_nan_row_fails_its_request_alone(oracle_model, runner_name, tmp_path):
    folder, _ = oracle_model("llama-gqa-untied")
    corrupt = tinyinfer.load(nan_embedding_copy(folder, tmp_path / "m", 7), runner=runner_name)
    requests = [([5, 6, 7], GREEDY), ([8, 9], GREEDY), ([10, 11, 12, 13], GREEDY)]
    results = [run(engine, requests)[0] for engine in engines(corrupt)]
    want, got = results
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    assert got[0].finish_reason == "error" and got[1].finish_reason == "length"


def test_async_scheduling_refuses_what_it_cannot_do(model):
    with pytest.raises(TinyInferError, match="async_scheduling needs detail='none', not 'basic'"):
        tinyinfer.Engine(model, async_scheduling=True)
    with pytest.raises(TinyInferError, match="does not overlap speculative decoding"):
        tinyinfer.Engine(model, detail="none", async_scheduling=True, drafter=PromptLookupDrafter())


def test_generate_command_streams_the_same_text_with_async_scheduling():
    def generate(*extra):
        return subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "ROMEO:", "--temperature", "0",
                               "--max-tokens", "24", *extra], capture_output=True, text=True, timeout=300)

    plain, overlapped = generate(), generate("--async-scheduling")
    assert overlapped.returncode == plain.returncode == 0
    assert overlapped.stdout == plain.stdout and len(plain.stdout) > len("ROMEO:") + 20
    refused = generate("--async-scheduling", "--speculative", "lookup")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == ("tinyinfer: error: --async-scheduling does not overlap speculative "
                              "decoding steps: drop --async-scheduling or --speculative\n")


def test_tensor_parallel_async_equals_sync_with_fed_tokens_taken_on_every_rank(monkeypatch):
    """TP=2 (gloo, CPU): every rank takes a fed step's tokens from its own argmax of the step
    before; the commands carry only placeholders, so a rank that ignored the feed would embed
    token 0 and change every later token."""
    requests = [(p, SamplingParams(temperature=0, max_tokens=int(n)))
                for p, n in zip(prompts(4, seed=6), (9, 14, 5, 11))]
    requests.append((prompts(1, seed=7)[0], SamplingParams(temperature=0, max_tokens=8, logprobs=3)))
    want, _ = run(tinyinfer.Engine(tinyinfer.load("bundled", runner="torch", device="cpu"), detail="none"),
                  requests)
    tp = tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cpu")
    try:
        sync, overlapped = engines(tp)
        got_sync, sync_traces = run(sync, requests)
        sent = []
        real_send = tp.runner._send
        monkeypatch.setattr(tp.runner, "_send", lambda command: (sent.append(command), real_send(command)))
        got, traces = run(overlapped, requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in got_sync] == [c.token_ids for c in want]
        assert [c.logprobs for c in got] == [c.logprobs for c in got_sync]
        assert records(traces) == records(sync_traces)
        fed = [c for c in sent if c.kind == "forward" and c.fed is not None]
        assert len(fed) > len(traces) / 2
        assert all(not c.batch.token_ids.any() for c in fed)  # placeholders: the ranks fed themselves
        # Every step's trace still has both ranks' timings, read when the step was finished.
        assert all({"rank0_compute", "rank1_compute"} <= set(t.rank_timings) for t in traces)
    finally:
        tp.runner.close()
