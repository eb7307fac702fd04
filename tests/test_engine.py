"""The engine loop: continuous batching, chunked prefill, preemption, prefix caching, baselines.

Every test runs on both runners (the `runner_name` fixture): bookkeeping is shared, and the
fast path must produce exactly what the reference produces.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyinfer
from tests.conftest import nan_embedding_copy
from tinyinfer.sampling import processed_probs
from tinyinfer.trace import StepTrace

GREEDY = tinyinfer.SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture
def model(oracle_model, runner_name):
    folder, _ = oracle_model("llama-gqa-untied")
    return tinyinfer.load(folder, runner=runner_name)


def mixed_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 320, int(k)).tolist() for k in rng.integers(1, 70, n)]


def run_all(engine: tinyinfer.Engine, prompts, params) -> tuple[list[list[int]], list[StepTrace]]:
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
        engine.pool.check()
    return [engine.release(i).token_ids for i in ids], traces


def test_batched_equals_alone_with_chunked_prefill_and_preemption(model):
    prompts = mixed_prompts()
    params = [tinyinfer.SamplingParams(temperature=0, max_tokens=int(n))
              for n in np.random.default_rng(1).integers(4, 24, len(prompts))]
    alone = [tinyinfer.Engine(model).generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    # A tiny pool and token budget force chunked prefill and preemption mid-decode.
    engine = tinyinfer.Engine(model, num_pages=24, page_size=4, max_num_batched_tokens=40)
    together, traces = run_all(engine, prompts, params)
    assert together == alone
    chunked = [s for t in traces for s in t.seqs if s.kind == "prefill" and s.start > s.cached_tokens]
    assert chunked, "no prompt was split across steps"
    assert sum(len(t.preempted) for t in traces) > 0, "the tiny pool never forced a preemption"
    assert any(len(t.seqs) > 1 and {s.kind for s in t.seqs} == {"prefill", "decode"} for t in traces)
    assert engine.pool.num_used_pages == 0


def test_requests_join_between_steps(model):
    engine = tinyinfer.Engine(model)
    first = engine.add_request([1, 2, 3], GREEDY)
    for _ in range(3):
        engine.step()
    second = engine.add_request([4, 5, 6, 7], GREEDY)
    trace = engine.step()
    assert {s.request_id: s.kind for s in trace.seqs} == {first: "decode", second: "prefill"}
    while engine.has_unfinished():
        engine.step()
    assert engine.release(second).token_ids == tinyinfer.Engine(model).generate([[4, 5, 6, 7]], GREEDY)[0].token_ids
    engine.release(first)


def test_prefix_cache_reuses_full_pages_of_a_shared_system_prompt(model):
    system = list(range(10, 50))  # 40 tokens: two full pages of 16, plus 8
    engine = tinyinfer.Engine(model, page_size=16)
    engine.generate([system + [7, 8, 9]], GREEDY)
    rid = engine.add_request(system + [60, 61], GREEDY)
    first = engine.step()
    (admitted,) = first.seqs
    assert admitted.cached_tokens == 32 and admitted.start == 32 and admitted.end == 42
    assert len(first.prefix_hit_pages) == 2
    while engine.has_unfinished():
        engine.step()
    cached_output = engine.release(rid).token_ids
    fresh = tinyinfer.Engine(model, enable_prefix_caching=False)
    assert cached_output == fresh.generate([system + [60, 61]], GREEDY)[0].token_ids
    assert engine.pool.prefix_hits == 32


def test_abort_frees_pages_and_keeps_others_running(model):
    engine = tinyinfer.Engine(model, page_size=4)
    keep = engine.add_request(mixed_prompts(1, seed=5)[0], GREEDY)
    drop = engine.add_request(list(range(30)), tinyinfer.SamplingParams(max_tokens=50))
    engine.step()
    used = engine.pool.num_used_pages
    engine.abort_request(drop)
    assert engine.pool.num_used_pages < used
    assert engine.completion(drop).finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.release(keep).finish_reason == "length"
    assert engine.pool.num_used_pages == 0


def test_static_batching_waits_for_the_longest_member(model):
    prompts = mixed_prompts(8, seed=2)
    params = [tinyinfer.SamplingParams(temperature=0, max_tokens=n) for n in (2, 20) * 4]
    cont_out, cont = run_all(tinyinfer.Engine(model, max_num_seqs=4), prompts, params)
    static_out, static = run_all(tinyinfer.Engine(model, max_num_seqs=4, batching="static"),
                                 prompts, params)
    assert static_out == cont_out
    assert len(static) > len(cont)
    for trace in static:  # nobody is admitted while an earlier batch is still running
        if trace.admitted:
            assert all(s.seq_id in trace.admitted for s in trace.seqs)


def test_contiguous_allocation_reserves_a_whole_context(model):
    engine = tinyinfer.Engine(model, kv_allocation="contiguous", page_size=16, num_pages=64)
    engine.add_request([1, 2, 3], GREEDY)
    trace = engine.step()
    assert len(trace.pages_allocated) == model.config.max_model_len // 16


def test_same_seed_gives_same_tokens_alone_or_batched(model):
    params = tinyinfer.SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = tinyinfer.Engine(model).generate([[5, 6, 7]], params)[0].token_ids
    others = [tinyinfer.SamplingParams(temperature=1.0, max_tokens=10, seed=s) for s in range(3)]
    batch = tinyinfer.Engine(model).generate([[1, 2], [5, 6, 7], [9], [3, 3]],
                                             [others[0], params, others[1], others[2]])
    assert batch[1].token_ids == alone
    assert tinyinfer.Engine(model).generate([[5, 6, 7]], params)[0].token_ids == alone


def test_trace_round_trips_through_json(model):
    engine = tinyinfer.Engine(model, page_size=4)
    engine.add_request([1, 2, 3, 4, 5], GREEDY)
    traces = [engine.step() for _ in range(3)]
    for trace in traces:
        assert StepTrace.from_json(trace.to_json()) == trace
    assert traces[0].prefill_tokens == 5 and traces[1].decode_tokens == 1
    assert traces[0].pool.owners[traces[0].pages_allocated[0]] == (traces[0].seqs[0].seq_id,)


def test_full_detail_records_top_logits_and_reference_attention(model):
    engine = tinyinfer.Engine(model, detail="full")
    engine.add_request([3, 1, 4, 1, 5], GREEDY)
    engine.step()  # prefill
    decode = engine.step()
    (seq,) = decode.seqs
    assert len(seq.top_logits) == 64 and seq.top_logits[0][0] == seq.token_id
    if model.runner.name == "numpy":
        layers, heads = model.config.num_layers, model.config.num_heads
        assert len(seq.attention) == layers and len(seq.attention[0]) == heads
        assert len(seq.attention[0][0]) == 6  # the decoded token attends over 6 positions
        assert abs(sum(seq.attention[1][2]) - 1) < 1e-5
    assert StepTrace.from_json(decode.to_json()) == decode


# ----------------------------------------------------------------- the guard against bad rows


def slipped_params(**fields) -> tinyinfer.SamplingParams:
    """Sampling params with values set past validation, as a hole in it would let through."""
    params = tinyinfer.SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_request_whose_settings_overflow_fails_alone(model):
    # 1e-310 divides every seen positive logit to +inf: no token can be chosen for that row.
    bad = slipped_params(repetition_penalty=1e-310)
    good = [tinyinfer.SamplingParams(max_tokens=10, temperature=0.8, seed=s) for s in (1, 2)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    alone = [tinyinfer.Engine(model).generate([p], sp)[0] for p, sp in zip(prompts[1:], good)]
    engine = tinyinfer.Engine(model)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, [bad, *good])]
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    failed, *others = [engine.release(i) for i in ids]
    assert failed.finish_reason == "error" and "NaN or +inf" in failed.error
    assert [o.token_ids for o in others] == [a.token_ids for a in alone]
    assert all(o.error is None for o in others)
    assert [s.finish_reason for t in traces for s in t.seqs if s.request_id == ids[0]] == ["error"]
    assert engine.pool.num_used_pages == 0
    with pytest.raises(tinyinfer.TinyInferError, match="NaN or \\+inf"):
        tinyinfer.Engine(model).generate([5, 6, 7], bad)


def test_a_corrupt_row_fails_only_the_greedy_requests_that_reach_it(oracle_model, runner_name,
                                                                     tmp_path):
    # A real fault: one NaN embedding row; greedy requests take the fast top-k path.
    folder, _ = oracle_model("llama-gqa-untied")
    nan_embedding_copy(folder, tmp_path / "m", 7)
    healthy = tinyinfer.load(folder, runner=runner_name)
    corrupt = tinyinfer.load(tmp_path / "m", runner=runner_name)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # only the first holds token 7
    alone = [tinyinfer.Engine(healthy).generate([p], GREEDY)[0].token_ids for p in prompts[1:]]
    engine = tinyinfer.Engine(corrupt)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    failed, *others = [engine.release(i) for i in ids]
    assert failed.finish_reason == "error"
    assert [o.token_ids for o in others] == alone
    assert engine.pool.num_used_pages == 0


class CountingStr(str):
    """A stop string that counts the characters read out of it (by index or slice)."""

    read = 0

    def __getitem__(self, key):
        piece = super().__getitem__(key)
        CountingStr.read += len(piece)
        return piece


def test_streaming_with_long_stop_strings_reads_each_character_a_few_times(text_model_folder):
    # Holding back a possible stop-string start once sliced every prefix of every stop string
    # after every token: work quadratic in the text, 16 stops of 60k characters cut the decode
    # rate by a quarter. Read through an automaton, each new character costs a few reads.
    model = tinyinfer.load(text_model_folder)
    stops = [CountingStr(chr(1 + i) * 5000) for i in range(4)]  # never whole in 60 tokens
    engine = tinyinfer.Engine(model)
    params = tinyinfer.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=stops)
    request_id = engine.add_request("To be, or not to be", params)
    CountingStr.read = 0
    streamed = ""
    while engine.has_unfinished():
        engine.step()
        streamed += engine.stream_text(request_id)
    text = engine.release(request_id).text
    assert streamed == text and len(text) > 60
    assert CountingStr.read <= 3 * len(stops) * len(text)


def test_full_detail_records_the_sampled_probability_and_the_rest_of_the_vocabulary(model):
    # The TUI's Next token panel shows the sampled token's own chance and re-applies sampling
    # settings over the whole vocabulary: the trace must carry both, exactly.
    params = tinyinfer.SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=5)
    engine = tinyinfer.Engine(model, detail="full")
    prompt = [3, 1, 4, 1, 5]
    rid = engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step().seqs[0])
    out = engine.release(rid).token_ids
    for i, step in enumerate(steps):
        logits = model.logits(prompt + out[:i])[-1].astype(np.float64)
        p = processed_probs(logits, params, prompt, out[:i])
        assert step.token_id == out[i] and step.token_prob == pytest.approx(p[out[i]], rel=1e-4, abs=1e-7)
        outside = np.delete(logits, [t for t, _ in step.top_logits])
        assert [t for t, _ in step.rest_logsumexp] == [round(0.1 * k, 1) for k in range(1, 21)]
        for t, lse in step.rest_logsumexp:
            want = outside.max() / t + np.log(np.exp((outside - outside.max()) / t).sum())
            assert lse == pytest.approx(want, abs=1e-3)


def test_verify_steps_record_the_logits_of_the_token_they_emitted_last(model):
    # Two sequences in one verify step: each one's top logits come from its own last row.
    from tinyinfer.speculative import PromptLookupDrafter

    engine = tinyinfer.Engine(model, detail="full", drafter=PromptLookupDrafter(), num_draft=3)
    repeat = [7, 8, 9, 10] * 6
    engine.add_request(repeat, GREEDY)
    engine.add_request([11, 12] * 10, GREEDY)
    verified = []
    while engine.has_unfinished():
        verified += [p for p in engine.step().seqs if p.draft_tokens]
    assert len({p.seq_id for p in verified}) == 2
    for part in verified:
        assert part.top_logits[0][0] == part.emitted[-1] == part.token_id


def test_traces_announce_requests_and_describe_each_token_once(text_model_folder):
    # A replay has no tokenizer: the traces carry every prompt and the text of every token id
    # they mention, each id described by the first trace that mentions it.
    m = tinyinfer.load(text_model_folder)
    engine = tinyinfer.Engine(m, detail="basic")
    params = tinyinfer.SamplingParams(temperature=0.8, seed=1, max_tokens=4)
    first = engine.add_request("To be, or not to be", params)
    traces = [engine.step()]
    late = engine.add_request("that is the question", params)
    while engine.has_unfinished():
        traces.append(engine.step())
    assert [r.request_id for r in traces[0].requests] == [first]
    assert [r.request_id for r in traces[1].requests] == [late] and not traces[2].requests
    assert traces[1].requests[0].prompt_ids == tuple(m.tokenizer.encode("that is the question"))
    described = [t for trace in traces for t, _ in trace.token_texts]
    assert len(described) == len(set(described))
    texts = {t: x for trace in traces for t, x in trace.token_texts}
    for rid in (first, late):
        done = engine.completion(rid)
        for t in done.prompt_ids + done.token_ids:
            assert texts[t] == m.tokenizer.generated_bytes(t).decode("utf-8", errors="replace")
    quiet = tinyinfer.Engine(m, detail="none")
    quiet.add_request("To be", params)
    assert not quiet.step().token_texts and not quiet.step().requests


def test_text_decoded_when_read_equals_text_decoded_at_every_step(text_model_folder):
    # At detail "none" a request without stop strings leaves its tokens to the decoder until
    # its text is read: completions, streams and stop strings must come out exactly the same.
    m = tinyinfer.load(text_model_folder)
    plain = tinyinfer.SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    reference = tinyinfer.Engine(m).generate("To be, or not to be", plain)[0].text
    stop = reference[len(reference) // 2:][:3]
    params = [plain, tinyinfer.SamplingParams(temperature=0.9, seed=5, max_tokens=40, stop=[stop]),
              tinyinfer.SamplingParams(temperature=1.5, seed=6, max_tokens=40)]

    def run(detail: str, stream: bool):
        engine = tinyinfer.Engine(m, detail=detail)
        ids = [engine.add_request("To be, or not to be", p) for p in params]
        streamed = dict.fromkeys(ids, "")
        texts = []
        while engine.has_unfinished():
            texts += [(s.request_id, s.token_text) for s in engine.step().seqs if s.token_id is not None]
            for i in ids if stream else ():
                streamed[i] += engine.stream_text(i)
        tails = {i: engine.stream_text(i) for i in ids}
        done = [engine.release(i) for i in ids]
        if stream:
            assert [streamed[i] + tails[i] for i in ids] == [d.text for d in done]
        return [(d.text, d.token_ids, d.finish_reason) for d in done], texts

    eager, per_token = run("basic", stream=False)
    assert run("basic", stream=True) == (eager, per_token)
    assert eager[0][0] == reference and eager[1][2] == "stop" and stop in reference
    for stream in (False, True):
        lazy, lazy_per_token = run("none", stream)
        assert lazy == eager
        # the trace's token texts: only for the request with stop strings
        assert lazy_per_token == [(r, t if r == "req-1" else "") for r, t in per_token]
