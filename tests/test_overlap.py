"""Asynchronous scheduling: the same tokens, finishes and per-step records as the step-through
engine, on both runners, while each decode step is launched before the one before is read."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import tinyinfer
from tests.conftest import nan_embedding_copy
from tinyinfer.errors import TinyInferError
from tinyinfer.sampling import SamplingParams
from tinyinfer.speculative import DraftModelDrafter, PromptLookupDrafter

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
    with pytest.raises(TinyInferError, match="overlaps speculative steps with a draft model only"):
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
    assert refused.stderr == ("tinyinfer: error: --async-scheduling overlaps speculative steps with a "
                              "draft model only: drop --async-scheduling, or pass --speculative draft\n")
    drafted = generate("--async-scheduling", "--speculative", "draft")
    assert drafted.returncode == 0 and drafted.stdout == plain.stdout


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


# Speculative decoding with a draft model: the next step's rounds launched behind each
# verification, before the host reads it (DraftRun.launch_after).


def speculative_engines(target, draft_model, **options):
    """A speculative engine stepping synchronously and one with asynchronous scheduling, each
    with its own draft run over the same draft model."""
    return tuple(tinyinfer.Engine(target, detail="none", drafter=DraftModelDrafter(draft_model), num_draft=4,
                                  async_scheduling=overlap, **options) for overlap in (False, True))


def draft_calls(monkeypatch, engine, runner) -> dict[str, int]:
    """Count the rounds launched behind a verification and those drafted after the host's turn."""
    calls = {"after": 0, "adopted": 0, "propose": 0}
    after, adopt, propose = runner.launch_rounds_after, engine.draft_run.adopt, engine.draft_run.propose

    def counted_after(*args):
        calls["after"] += 1
        return after(*args)

    def counted_adopt(*args):
        launched = adopt(*args)
        calls["adopted"] += launched is not None
        return launched

    def counted_propose(*args):
        calls["propose"] += 1
        return propose(*args)

    monkeypatch.setattr(runner, "launch_rounds_after", counted_after)
    monkeypatch.setattr(engine.draft_run, "adopt", counted_adopt)
    monkeypatch.setattr(engine.draft_run, "propose", counted_propose)
    return calls


@pytest.mark.parametrize("draft_name", ["llama-mqa-tied", "llama-gqa-untied"])
def test_async_speculative_launches_the_next_rounds_ahead_and_equals_sync(oracle_model, runner_name,
                                                                          draft_name, monkeypatch):
    """Same tokens as plain greedy and as the synchronous speculative engine, alone and
    batched, with each step's rounds launched behind the verification before (most steps) and
    adopted by the next step: with another model as the draft (few guesses kept, the step feeds
    the target's token alone) and with the target itself (every guess kept: the step feeds the
    last guess, which the draft had not computed, and the target's token)."""
    target = tinyinfer.load(oracle_model("llama-gqa-untied")[0], runner=runner_name)
    draft = tinyinfer.load(oracle_model(draft_name)[0], runner=runner_name)
    requests = [(p, SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True))
                for p, n in zip(prompts(4, seed=6), (9, 25, 40, 60))]
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate([p for p, _ in requests],
                                                                      [sp for _, sp in requests])]
    sync, overlapped = speculative_engines(target, draft, max_num_seqs=4)
    calls = draft_calls(monkeypatch, overlapped, draft.runner)
    for engine in (sync, overlapped):
        alone = [run(engine, [request])[0][0].token_ids for request in requests]
        calls.update(after=0, adopted=0, propose=0)  # count the batched run's alone
        together = [c.token_ids for c in run(engine, requests)[0]]
        assert alone == plain and together == plain
        assert engine.draft_run.pool.num_used_pages == 0
        engine.draft_run.pool.check()
    stats = overlapped.spec_stats
    if draft_name == "llama-gqa-untied":
        assert stats.accepted == stats.drafted
    # Batched, most steps adopt rounds launched ahead (each sequence with its own number of
    # guesses, those that ended dropped): the steps after a prompt, and after one sequence
    # could take no launch ahead, draft after the host's turn.
    assert calls["after"] >= calls["adopted"] >= 4 * calls["propose"] > 0


def test_rounds_launched_ahead_guess_the_targets_own_tokens_after_every_accepted_count(
        oracle_model, runner_name):
    """The draft model is the target, the oracle's guesses are wrong half the time, so steps
    keep every number of guesses from none to all: the rounds launched behind each
    verification must still guess the target's own greedy continuation from the token after
    the ones it kept, which they do only if each accepted count's positions and slots are
    right (the verification checks the oracle's guesses, so wrong rounds would not change the
    output: this looks at the rounds themselves)."""
    from tinyinfer.bench.oracle import OracleDrafter

    folder, _ = oracle_model("llama-gqa-untied")
    target, draft = (tinyinfer.load(folder, runner=runner_name) for _ in range(2))
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batch = prompts(3, seed=10)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(batch, long)]
    drafter = OracleDrafter(draft, 0.5, seed=3)
    drafter.follow(batch, plain)
    engine = tinyinfer.Engine(target, detail="none", drafter=drafter, num_draft=4, async_scheduling=True,
                              max_num_seqs=3)
    checked = 0
    adopt = engine.draft_run.adopt

    def checked_adopt(seqs, ks):
        nonlocal checked
        ahead = engine.draft_run.ahead
        launched = adopt(seqs, ks)
        if launched is not None:
            guesses = launched.source.result()  # the draft model's own rounds [launched, width]
            order = list(ahead.ks)  # the launch's sequences, in its order
            for seq, k in zip(seqs, ks):
                if k == 0:
                    continue
                i = int(seq.request_id.split("-")[1])
                done = len(seq.output_ids)
                own = guesses[order.index(seq.seq_id)].tolist()
                # its lookahead's worth after what it kept, then -1: rounds it sat out (near its
                # end, keeping more leaves room for fewer)
                assert own[:k] == plain[i][done:done + k] and set(own[k:]) <= {-1}, (i, done, own)
                checked += 1
        return launched

    engine.draft_run.adopt = checked_adopt
    done, traces = run(engine, [(p, long) for p in batch])
    assert [c.token_ids for c in done] == plain
    assert checked > 10
    kept = {s.accepted for t in traces for s in t.seqs if s.draft_tokens}
    assert {0, 4} <= kept and len(kept) >= 4  # none kept, all kept, and counts between


def test_the_oracles_corruptions_do_not_depend_on_the_order_it_is_asked(oracle_model, runner_name):
    """The oracle decides each followed position's guess once (right, or which wrong token), so
    the synchronous engine with the prompts in either order and the asynchronous engine (its
    guesses asked at other moments) keep exactly the same guesses: their speeds compare at the
    same acceptances. Drawing from one stream in the order asked, they would not."""
    from tinyinfer.bench.oracle import OracleDrafter

    folder, _ = oracle_model("llama-gqa-untied")
    target, draft = (tinyinfer.load(folder, runner=runner_name) for _ in range(2))
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    batch = prompts(3, seed=12)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(batch, long)]

    lengths = (30, 23, 17)

    def kept(order: list[int], overlap: bool, together: bool = False) -> dict[int, list[tuple[int, int]]]:
        """Per prompt, how many guesses each of its steps made and kept (near the end too: the
        rounds launched ahead draft what the lookahead allows after what was kept), alone in
        ``order`` or all at once."""
        drafter = OracleDrafter(draft, 0.6, seed=5)
        drafter.follow(batch, plain)
        engine = tinyinfer.Engine(target, detail="none", drafter=drafter, num_draft=4, async_scheduling=overlap,
                                  max_num_seqs=3)
        adopt = engine.draft_run.adopt
        adopted = [0]

        def counted(*args):
            launched = adopt(*args)
            adopted[0] += launched is not None
            return launched

        engine.draft_run.adopt = counted
        groups = [order] if together else [[i] for i in order]
        out = {}
        for group in groups:
            requests = [(batch[i], SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True))
                        for i in group]
            done, traces = run(engine, requests)
            for trace in traces:
                json.loads(trace.to_json())  # the oracle's guesses are plain ints in the trace
            for i, completion in zip(group, done):
                assert completion.token_ids == plain[i][:lengths[i]]
                out[i] = [(len(s.draft_tokens), s.accepted) for t in traces for s in t.seqs
                          if s.draft_tokens and s.request_id == completion.request_id]
        assert (adopted[0] > 0) == overlap  # the asynchronous engine took rounds launched ahead
        return out

    forward = kept([0, 1, 2], False)
    assert kept([2, 1, 0], False) == forward == kept([0, 1, 2], True)
    assert kept([0, 1, 2], False, together=True) == kept([0, 1, 2], True, together=True)
    assert len({a for counts in forward.values() for _, a in counts}) >= 3  # not all kept, nor none


def test_async_speculative_aborts_arrivals_and_a_full_pool_drop_the_rounds_launched_ahead(
        oracle_model, runner_name):
    """A request aborted while its rounds were launched ahead (they are dropped: the next step
    drafts for the others as usual), one arriving (admitted beside the running ones, whose
    rounds it does not disturb), and a draft pool too small for the worst case (nothing is
    launched ahead): the tokens are the synchronous engine's."""
    target = tinyinfer.load(oracle_model("llama-gqa-untied")[0], runner=runner_name)
    draft = tinyinfer.load(oracle_model("llama-gqa-untied")[0], runner=runner_name)
    first, second, late = prompts(3, seed=8)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def between(engine, step):
        if step == 4:
            engine.abort_request("req-0")
        if step == 6:
            return [engine.add_request(late, long, request_id="late")]
        return []

    for options in ({}, {"draft_num_pages": 9, "page_size": 4}):  # (how far a step drafts depends on it)
        results = []
        for engine in speculative_engines(target, draft, max_num_seqs=3, **options):
            results.append(run(engine, [(first, long), (second, long)], between)[0])
            assert engine.draft_run.pool.num_used_pages == 0
        want, got = results
        assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
        assert got[0].finish_reason == "abort"
        assert got[2].token_ids == tinyinfer.Engine(target).generate([late], long)[0].token_ids


def test_async_speculative_a_nan_row_fails_its_request_alone(oracle_model, runner_name, tmp_path):
    """A verification row the runner refuses (NaN logits: a guessed token whose embedding is
    NaN in the target) with rounds launched behind it: that request fails, the others go on,
    as in the synchronous engine (the rounds' K/V is not trusted past the verified tokens). The
    draft is the clean target, so it guesses the target's own tokens, the corrupt one too."""
    folder, _ = oracle_model("llama-gqa-untied")
    clean = tinyinfer.load(folder, runner=runner_name)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batch = prompts(3, seed=9)
    plain = [c.token_ids for c in tinyinfer.Engine(clean).generate(batch, long)]
    seen = {t for p in batch for t in p} | set(plain[0][:8])
    bad = next(t for t in plain[0][8:] if t not in seen)  # first met as request 0's guess, past step 2
    corrupt = tinyinfer.load(nan_embedding_copy(folder, tmp_path / "m", bad), runner=runner_name)
    requests = [(p, long) for p in batch]
    want, got = (run(engine, requests)[0] for engine in speculative_engines(corrupt, clean, max_num_seqs=3))
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    assert got[0].finish_reason == "error"
    assert [c.token_ids for c, p in zip(got, plain) if bad not in p] == [p for p in plain if bad not in p]


def test_the_devices_choice_of_inputs_is_the_hosts_rule():
    """``choose_after`` (the torch runner's choice of the next step's inputs from a verification
    it has not read) against ``AfterVerification.chosen`` (the host's rule, once read): for
    random verifications and guesses that agree with them for a random number of places, the
    same tokens, positions and slots for every row that computes, the same rounds."""
    import torch

    from tinyinfer.runners.runner import AfterVerification, TopFuture, TopLogits
    from tinyinfer.runners.torch_fast import choose_after

    rng = np.random.default_rng(11)
    for _ in range(40):
        seqs, k, n = int(rng.integers(1, 5)), int(rng.integers(1, 6)), int(rng.integers(0, 4))
        ks = rng.integers(1, k + 1, seqs)
        argmax = rng.integers(0, 50, int((ks + 1).sum()) + 3)
        rows = np.full((seqs, k + 1), -1)
        guesses = np.full((seqs, k), -1)
        positions = np.full((seqs, k + 1, 2 + n), -1)
        start = 3
        for b, kb in enumerate(ks):
            rows[b, :kb + 1] = np.arange(start, start + kb + 1)
            keep = int(rng.integers(0, kb + 1))  # guesses equal to the verification's choices
            guesses[b, :kb] = argmax[start:start + kb]
            wrong = rng.random(kb) < 0.5  # past the first wrong one, some are right again
            wrong[:keep] = False
            if keep < kb:
                wrong[keep] = True
            guesses[b, :kb] += wrong * (1 + rng.integers(0, 3, kb))
            start += kb + 1
            base = int(rng.integers(5, 40))
            lookahead = np.sort(rng.integers(0, n + 2, kb + 1))[::-1]  # fewer rounds after keeping more
            for a in range(kb + 1):
                positions[b, a, 0 if a == kb else 1:] = base + a + np.arange(2 + n)[0 if a == kb else 1:]
                positions[b, a, 2 + max(int(lookahead[a]) - 1, 0):] = -1  # rounds past its lookahead
        slots = np.where(positions >= 0, positions + 1000, -1)
        top = TopLogits(argmax[:, None], np.zeros((len(argmax), 1)), np.zeros(len(argmax)))
        after = AfterVerification(TopFuture.done(top), rows, guesses, positions, slots,
                                  tuple((1, 2) for _ in range(seqs)), q=2)
        batch, rounds = after.chosen()
        staged_positions, staged_slots = np.where(slots < 0, 0, positions), np.where(slots < 0, 7, slots)
        tokens, step_positions, step_slots, round_positions, round_slots = (
            t.numpy() for t in choose_after(torch.from_numpy(argmax), torch.from_numpy(rows),
                                            torch.from_numpy(guesses), torch.from_numpy(staged_positions),
                                            torch.from_numpy(staged_slots), 2))
        computes = step_slots != 7
        assert tokens[computes].tolist() == batch.token_ids.tolist()
        assert step_positions[computes].tolist() == batch.positions.tolist()
        assert step_slots[computes].tolist() == batch.slot_mapping.tolist()
        staged = rounds.staged(7)
        assert round_positions.tolist() == staged[0].tolist() and round_slots.tolist() == staged[1].tolist()
