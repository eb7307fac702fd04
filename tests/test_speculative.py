"""Speculative decoding: same tokens as plain greedy, same distribution as plain sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tinyinfer
from tinyinfer.sampling import probs_from_logits
from tinyinfer.speculative import DraftModelDrafter, PromptLookupDrafter


@pytest.fixture
def pair(oracle_model, runner_name):
    target, _ = oracle_model("llama-gqa-untied")
    draft, _ = oracle_model("llama-mqa-tied")
    return tinyinfer.load(target, runner=runner_name), tinyinfer.load(draft, runner=runner_name)


def repetitive_prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    prompts = []
    for i in range(n):
        phrase = rng.integers(0, 320, 6 + i % 5).tolist()
        prompts.append((phrase * 4)[: 10 + 3 * i])
    return prompts


@pytest.mark.parametrize("drafter_kind", ["draft", "lookup"])
def test_greedy_speculative_equals_plain_greedy(pair, drafter_kind):
    target, draft = pair
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=24)
    prompts = repetitive_prompts(6)
    plain = tinyinfer.Engine(target).generate(prompts, params)
    drafter = DraftModelDrafter(draft) if drafter_kind == "draft" else PromptLookupDrafter()
    engine = tinyinfer.Engine(target, drafter=drafter, num_draft=4)
    single = [engine.generate([p], params)[0].token_ids for p in prompts]
    batched = engine.generate(prompts, params)
    assert single == [c.token_ids for c in plain]
    assert [c.token_ids for c in batched] == [c.token_ids for c in plain]
    assert engine.spec_stats.verify_steps > 0 and engine.spec_stats.drafted > 0
    assert engine.pool.num_used_pages == 0
    engine.pool.check()


def counting(monkeypatch, runner, calls: dict[str, int]) -> None:
    """Count the real runner's forward and launch_top calls (they still compute)."""
    for name in ("forward", "launch_top"):
        method = getattr(runner, name)

        def counted(*args, _method=method, _name=name):
            calls[_name] += 1
            return _method(*args)
        monkeypatch.setattr(runner, name, counted)


@pytest.mark.parametrize("drafter_kind", ["draft", "lookup"])
def test_greedy_verification_from_top_logits_equals_full_rows(pair, drafter_kind, monkeypatch):
    """A plainly greedy speculative step verifies (and drafts) from argmaxes reduced by the
    runner; with full logits rows (detail="full") every step drafts, keeps and emits the same."""
    target, draft = pair
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=24)
    prompts = repetitive_prompts(5)

    def run(detail: str) -> tuple[list, list, dict, dict]:
        target_calls, draft_calls = {"forward": 0, "launch_top": 0}, {"forward": 0, "launch_top": 0}
        with monkeypatch.context() as m:
            counting(m, target.runner, target_calls)
            counting(m, draft.runner, draft_calls)
            drafter = DraftModelDrafter(draft) if drafter_kind == "draft" else PromptLookupDrafter()
            engine = tinyinfer.Engine(target, drafter=drafter, num_draft=4, detail=detail)
            ids = [engine.add_request(p, params) for p in prompts]
            steps = []
            while engine.has_unfinished():
                trace = engine.step()
                steps.append([(s.seq_id, s.draft_tokens, s.accepted, s.emitted, s.token_id) for s in trace.seqs])
            return [engine.release(i).token_ids for i in ids], steps, target_calls, draft_calls

    top_ids, top_steps, top_target, top_draft = run("none")
    full_ids, full_steps, full_target, full_draft = run("full")
    assert top_ids == full_ids and top_steps == full_steps
    assert any(s[2] > 0 for step in top_steps for s in step)  # some guesses were kept
    # (the NumPy runner's launch_top calls its forward, so only launch_top is told apart)
    assert top_target["launch_top"] == len(top_steps)
    assert full_target["launch_top"] == 0 and full_target["forward"] == len(full_steps)
    if drafter_kind == "draft":  # the draft model's argmaxes never need full rows
        assert top_draft["launch_top"] > 0 and top_draft == full_draft


def test_greedy_draft_rounds_propose_the_draft_models_own_greedy_continuation(pair):
    """Greedy draft rounds run back to back, each fed the round before's argmax on the runner's
    side: every draft still equals the draft model's plain greedy continuation of the sequence
    so far, also when sequences of one step guess different numbers of tokens."""
    target, draft = pair
    prompts = repetitive_prompts(4)
    params = [tinyinfer.SamplingParams(temperature=0, max_tokens=n) for n in (3, 5, 9, 24)]
    engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=4)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    context = {i: list(p) for i, p in zip(ids, prompts)}
    seen, lengths = 0, set()
    while engine.has_unfinished():
        trace = engine.step()
        drafts = [s for s in trace.seqs if s.draft_tokens]
        lengths.add(tuple(sorted(len(s.draft_tokens) for s in drafts)))
        for s in drafts:
            own = tinyinfer.Engine(draft).generate([context[s.request_id]], tinyinfer.SamplingParams(
                temperature=0, max_tokens=len(s.draft_tokens)))[0].token_ids
            assert list(s.draft_tokens) == own
            seen += 1
        for s in trace.seqs:
            context[s.request_id] += list(s.emitted) if s.draft_tokens else (
                [] if s.token_id is None else [s.token_id])
    assert seen > 4 and any(len(set(ks)) > 1 for ks in lengths), "some steps drafted unequal lengths"


def test_greedy_draft_rounds_run_as_one_launch_a_step_and_as_the_stepwise_rule_does():
    """On the torch runner a step's greedy draft rounds after the first step's (the prompt's
    catch-up, round by round) are one launch_rounds call that runs as one function (on CUDA,
    one CUDA graph) and calls launch_top no more: and every step drafts, keeps and emits what
    the stepwise rule (one launch_top per round) does, each prompt alone and all at once."""
    import functools

    from tinyinfer.runners.runner import launch_rounds_stepwise

    target, draft = (tinyinfer.load(oracle, runner="torch") for oracle in ("bundled", "bundled-draft"))
    from tinyinfer.bench import workloads as bench

    prompts = bench.speculative_prompts(target, "continue", count=3)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=24)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(prompts, params)]

    def run(stepwise: bool, together: bool) -> tuple[list, list, dict]:
        calls = {"launch_top": 0, "launch_rounds": 0}
        runner = draft.runner
        rounds = functools.partial(launch_rounds_stepwise, runner) if stepwise else runner.launch_rounds
        launch_top = runner.launch_top

        def counted_top(*args):
            calls["launch_top"] += 1
            return launch_top(*args)

        def counted_rounds(*args):
            calls["launch_rounds"] += 1
            return rounds(*args)

        runner.launch_top, runner.launch_rounds = counted_top, counted_rounds
        try:
            engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=4)
            steps, out = [], []
            for group in [prompts] if together else [[p] for p in prompts]:
                ids = [engine.add_request(p, params) for p in group]
                while engine.has_unfinished():
                    trace = engine.step()
                    steps.append([(s.seq_id, s.draft_tokens, s.accepted, s.emitted) for s in trace.seqs])
                out += [engine.release(i).token_ids for i in ids]
        finally:
            del runner.launch_top, runner.launch_rounds
        return out, steps, calls

    for together in (False, True):
        one, one_steps, one_calls = run(stepwise=False, together=together)
        rule, rule_steps, rule_calls = run(stepwise=True, together=together)
        assert one == rule == plain
        assert one_steps == rule_steps
        assert one_calls["launch_rounds"] == rule_calls["launch_rounds"] == sum(
            any(s[1] for s in step) for step in one_steps)
        assert rule_calls["launch_top"] > one_calls["launch_top"]
        if not together:  # alone, only the first step's catch-up (the prompt) goes round by
            # round, and a step of one guess (no rounds: near max_tokens) is one launch_top
            single = sum(len(s[1]) == 1 for step in one_steps for s in step)
            assert one_calls["launch_top"] == 4 * len(prompts) + single


def test_a_draft_model_that_is_the_target_has_every_guess_kept(oracle_model, runner_name):
    """The draft model is the target itself (a second copy): each greedy guess is the target's
    own next token, so the verification keeps every one, if it computes the guesses the draft
    made (the torch runner feeds them to it on the device, behind the rounds, before the host
    reads them). A verification that read other tokens would turn guesses down, or compute the
    next ones from a wrong context."""
    folder, _ = oracle_model("llama-gqa-untied")
    target, draft = (tinyinfer.load(folder, runner=runner_name) for _ in range(2))
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    prompts = repetitive_prompts(3)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(prompts, params)]
    engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=4)
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == plain
    assert [c.token_ids for c in engine.generate(prompts, params)] == plain
    stats = engine.spec_stats
    assert stats.drafted > 0 and stats.accepted == stats.drafted and stats.rejected == 0


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_the_verification_checks_the_oracles_guesses_not_the_draft_models(pair, acceptance):
    """The benchmark's oracle fixes its guesses on the host (``fixed_guesses``) while the draft
    model runs its rounds on its own argmaxes: the verification must check the oracle's. At
    acceptance 1 (the target's own greedy tokens) it keeps every guess, at 0 (each one wrong)
    none; fed the draft model's argmaxes, it would keep some guesses at 0 and not all at 1."""
    from tinyinfer.bench.oracle import OracleDrafter

    target, draft = pair
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    prompts = repetitive_prompts(3)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(prompts, params)]
    drafter = OracleDrafter(draft, acceptance, seed=2)
    drafter.follow(prompts, plain)
    engine = tinyinfer.Engine(target, drafter=drafter, num_draft=4)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        for s in engine.step().seqs:
            if s.draft_tokens:
                assert s.accepted == (len(s.draft_tokens) if acceptance else 0)
                i = ids.index(s.request_id)
                at = s.start + 1 - len(prompts[i])  # the first guess's place in the output
                followed = tuple(plain[i][at:at + len(s.draft_tokens)])
                assert (s.draft_tokens == followed) == bool(acceptance)
    assert [engine.release(i).token_ids for i in ids] == plain
    assert engine.spec_stats.drafted > 0


def test_the_verification_is_queued_before_the_guesses_are_read():
    """On the torch runner a step's verification is launched behind the draft's rounds, its
    guesses fed from the rounds' argmaxes where the runner left them (a Feed whose source is
    the rounds' launch), before the host has read them: the host waits once a step, for both."""
    import torch

    from tinyinfer.runners.runner import TokensFuture

    target, draft = (tinyinfer.load(name, runner="torch") for name in ("bundled", "bundled-draft"))
    from tinyinfer.bench import workloads as bench

    prompts = bench.speculative_prompts(target, "continue", count=2)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=24)
    read: set[int] = set()
    fed_unread = fed_read = 0
    launch_rounds, launch_top = draft.runner.launch_rounds, target.runner.launch_top

    def rounds(*args):
        future = launch_rounds(*args)
        wait = future.result

        def result():
            read.add(id(future))
            return wait()
        future.result = result
        return future

    def verify(batch, kv, k, feed=None):
        nonlocal fed_unread, fed_read
        # (a prompt's catch-up goes round by round: its argmaxes reach the feed via the host)
        if feed is not None and isinstance(feed.source.argmax, torch.Tensor):
            assert isinstance(feed.source, TokensFuture)
            if id(feed.source) in read:
                fed_read += 1
            else:
                fed_unread += 1
        return launch_top(batch, kv, k, feed)

    draft.runner.launch_rounds, target.runner.launch_top = rounds, verify
    try:
        engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=4)
        out = [c.token_ids for c in engine.generate(prompts, params)]
    finally:
        del draft.runner.launch_rounds, target.runner.launch_top
    assert out == [c.token_ids for c in tinyinfer.Engine(target).generate(prompts, params)]
    steps = engine.spec_stats.verify_steps  # a sequence's verifications: steps with a draft, two at a time
    assert fed_read == 0 and steps // 2 - 2 <= fed_unread <= steps


def test_rejections_leak_no_pages(pair):
    target, draft = pair
    engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=5, page_size=4,
                              num_pages=60, draft_num_pages=64, max_num_batched_tokens=48)
    draft_pool = engine.draft_run.pool  # the engine runs the draft model on its own pages
    params = [tinyinfer.SamplingParams(temperature=1.0, seed=s, max_tokens=30) for s in range(8)]
    ids = [engine.add_request(p, sp) for p, sp in zip(repetitive_prompts(8), params)]
    saw_rejection = False
    while engine.has_unfinished():
        trace = engine.step()
        engine.pool.check()
        draft_pool.check()
        saw_rejection |= any(s.accepted < len(s.draft_tokens) for s in trace.seqs)
    assert saw_rejection
    assert all(len(engine.release(i).token_ids) == 30 for i in ids)
    assert engine.pool.num_used_pages == 0 and draft_pool.num_used_pages == 0
    stats = engine.spec_stats
    assert 0 < stats.acceptance_rate < 1 and stats.forwards_saved == stats.accepted


def test_trace_shows_drafts_and_marks(pair):
    target, _ = pair
    engine = tinyinfer.Engine(target, drafter=PromptLookupDrafter(), num_draft=3, detail="full")
    engine.add_request([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], tinyinfer.SamplingParams(temperature=0, max_tokens=12))
    traces = []
    while engine.has_unfinished():
        traces.append(engine.step())
    spec = [s for t in traces for s in t.seqs if s.draft_tokens]
    assert spec and all(len(s.emitted) == s.accepted + 1 or s.finish_reason for s in spec)
    assert all(s.emitted[: s.accepted] == s.draft_tokens[: s.accepted] for s in spec)
    assert "draft" in traces[-1].timings
    assert tinyinfer.StepTrace.from_json(traces[-1].to_json()) == traces[-1]


def test_prompt_lookup_finds_the_latest_match():
    lookup = PromptLookupDrafter(max_ngram=2)
    assert lookup.lookup([1, 2, 3, 4, 1, 2, 9, 9, 1, 2], 3) == [9, 9, 1]
    assert lookup.lookup([1, 2, 3], 2) == []


def test_mismatched_vocabularies_are_refused(oracle_model):
    target, _ = oracle_model("llama-gqa-untied")
    small, _ = oracle_model("tiny-vocab-draft")
    with pytest.raises(tinyinfer.TinyInferError, match="vocabulary"):
        tinyinfer.Engine(tinyinfer.load(target), drafter=DraftModelDrafter(tinyinfer.load(small)))


# ---------------------------------------------------------------- distribution


def chi_square_critical(dof: int, z: float = 3.0902) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile; z = 3.09 is alpha = 0.001."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def exact_pair_distribution(model, prompt: list[int], params) -> np.ndarray:
    """P(t2, t3) under plain sampling, summed over t1: [V, V], from the model's own logits."""
    vocab = model.config.vocab_size
    dist = np.zeros((vocab, vocab))
    p1 = probs_from_logits(model.logits(prompt)[-1], params)
    for t1 in range(vocab):
        logits = model.logits(prompt + [t1])
        p2 = probs_from_logits(logits[-1], params)
        for t2 in range(vocab):
            p3 = probs_from_logits(model.logits(prompt + [t1, t2])[-1], params)
            dist[t2] += p1[t1] * p2[t2] * p3
    return dist


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    """Statistic and degrees of freedom, pooling cells expected below 5."""
    n = counts.sum()
    expected = expected_probs.ravel() * n
    observed = counts.ravel()
    small = expected < 5
    e = np.append(expected[~small], expected[small].sum())
    o = np.append(observed[~small], observed[small].sum())
    keep = e > 0
    return float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum() - 1)


def sample_pairs(model, prompt, params, n: int, drafter=None) -> np.ndarray:
    """Counts of (t2, t3) over n seeded generations of 4 tokens."""
    vocab = model.config.vocab_size
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for batch_start in range(0, n, 500):
        engine = tinyinfer.Engine(model, drafter=drafter, num_draft=2 if drafter else 4,
                                  max_num_seqs=500, max_num_batched_tokens=4096)
        seeds = range(batch_start, min(n, batch_start + 500))
        for out in engine.generate([prompt] * len(seeds), [
                tinyinfer.SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
                for s in seeds]):
            counts[out.token_ids[1], out.token_ids[2]] += 1
        if drafter is not None:
            assert engine.spec_stats.verify_steps > 0
    return counts


def test_speculative_sampling_has_the_target_distribution(oracle_model):
    """Chi-square at alpha = 0.001 cannot tell speculative sampling from the target's own
    distribution; accepting every guess (the drafter's distribution) is caught by the same test."""
    target = tinyinfer.load(oracle_model("tiny-vocab-target")[0], dtype="float64")
    draft = tinyinfer.load(oracle_model("tiny-vocab-draft")[0], dtype="float64")
    prompt = [1, 4, 2]
    params = tinyinfer.SamplingParams(temperature=1.0)
    expected = exact_pair_distribution(target, prompt, params)
    n = 4000
    speculative = sample_pairs(target, prompt, params, n, DraftModelDrafter(draft))
    stat, dof = chi_square(speculative, expected)
    assert stat < chi_square_critical(dof), (stat, dof)
    accept_all = sample_pairs(draft, prompt, params, n)
    stat_wrong, dof_wrong = chi_square(accept_all, expected)
    assert stat_wrong > chi_square_critical(dof_wrong), (stat_wrong, dof_wrong)


@pytest.mark.parametrize("fmt", ["int8", "int4+head"])
def test_a_quantized_draft_model_keeps_greedy_output_exact(runner_name, fmt):
    """Whatever the draft model's weights (here int8 or int4 codes, the draft alone quantized,
    as --draft-quantize does), the target verifies every token: speculative greedy output is
    plain greedy output token for token, each prompt alone and all at once."""
    from tinyinfer.bench import workloads as bench

    target = tinyinfer.load("bundled", runner=runner_name)
    draft = tinyinfer.load("bundled-draft", runner=runner_name, quantize=fmt)
    assert target.quantization is None
    assert draft.quantization.bits == int(fmt[3]) and draft.quantization.head == fmt.endswith("+head")
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=32)
    prompts = bench.speculative_prompts(target, "continue", count=4)
    plain = [c.token_ids for c in tinyinfer.Engine(target).generate(prompts, params)]
    engine = tinyinfer.Engine(target, drafter=DraftModelDrafter(draft), num_draft=4)
    assert [engine.generate([p], params)[0].token_ids for p in prompts] == plain
    assert [c.token_ids for c in engine.generate(prompts, params)] == plain
    stats = engine.spec_stats
    assert stats.accepted > 0 and stats.rejected > 0  # the quantized draft guesses, right and wrong


def parsed(*argv: str):
    from tinyinfer.cli.commands import build_parser

    return build_parser().parse_args(list(argv))


def test_draft_quantize_quantizes_the_draft_model_alone():
    """--draft-quantize FORMAT (and --draft-quantize-head) load the draft model in that format
    whatever --quantize does to the target; without it the draft follows --quantize."""
    from tinyinfer.cli.commands import make_drafter

    alone = make_drafter(parsed("generate", "x", "--speculative", "draft", "--draft-quantize", "int4",
                                "--draft-quantize-head"))
    assert (alone.model.quantization.bits, alone.model.quantization.head) == (4, True)
    both = make_drafter(parsed("generate", "x", "--speculative", "draft", "--quantize", "int8"))
    assert (both.model.quantization.bits, both.model.quantization.head) == (8, False)
    floats = make_drafter(parsed("generate", "x", "--speculative", "draft", "--quantize", "int8",
                                 "--draft-quantize", "none"))
    assert floats.model.quantization is None


def test_a_preset_draft_shape_takes_draft_quantize():
    """bench speculative --preset: the draft shape's linear layers drawn as random codes of the
    --draft-quantize format, the head too with --draft-quantize-head."""
    from tinyinfer.cli.commands import make_drafter
    from tinyinfer.runners import torch_layers as layers

    args = parsed("bench", "speculative", "--preset", "gpt2", "--device", "cpu", "--dtype", "float32",
                  "--draft-model", "gpt2", "--speculative", "oracle", "--draft-quantize", "int8")
    drafter = make_drafter(args, preset="gpt2", acceptance=0.5)
    weights = drafter.model.runner.w
    assert drafter.model.quantization.name == "int8" and drafter.acceptance == 0.5
    assert all(isinstance(layer.mlp_in[0], layers.Int8Weight) for layer in weights.layers)


@pytest.mark.parametrize("argv, says", [
    (["generate", "hi", "--speculative", "draft", "--draft-quantize-head"],
     "--draft-quantize-head stores the draft model's embedding and LM head in its format: name one "
     "with --draft-quantize (e.g. int8 or int4)"),
    (["generate", "hi", "--speculative", "draft", "--draft-quantize", "none", "--draft-quantize-head"],
     "--draft-quantize-head stores the draft model's embedding and LM head in its format: name one "
     "with --draft-quantize (e.g. int8 or int4)"),
    (["generate", "hi", "--draft-quantize", "int4"],
     "--draft-quantize applies to a draft model: add --speculative draft"),
    (["generate", "hi", "--speculative", "lookup", "--draft-quantize", "int8"],
     "--draft-quantize applies to a draft model: add --speculative draft"),
    (["generate", "hi", "--speculative", "draft", "--draft-quantize", "int3"], "unknown quantization int3"),
    (["bench", "speculative", "--speculative", "lookup", "--draft-quantize-head"],
     "--draft-quantize-head applies to a draft model: add --speculative draft or oracle"),
    (["bench", "speculative", "--draft-quantize", "q4"], "unknown quantization q4"),
    (["bench", "latency", "--draft-quantize", "int4", "--draft-quantize-head"],
     "--draft-quantize, --draft-quantize-head apply to bench speculative only: drop them for bench latency"),
])
def test_draft_quantize_misuse_is_one_line(argv, says):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tinyinfer", *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinyinfer: error: "), done.stderr
    assert says in lines[0]
