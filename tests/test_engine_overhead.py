"""Benchmark: the engine's own host time per decode step, with the model's math taken out.

At batch 256 a GPU decode step of an 8B model takes ~15–30 ms; everything the engine does on
the host around it (scheduling, packing the batch, choosing tokens, page bookkeeping, the
trace) adds to that serially. This measures exactly that part: a runner that returns its
answers without computing anything, so only engine code is timed. Likewise a speculative
step at batch 1 (draft rounds, verification, acceptance), the host's turn between the GPU's
verification and the next draft rounds.

    python -m pytest tests/test_engine_overhead.py --benchmark-only

The benchmarks are skipped in normal runs (`--benchmark-skip` in pyproject.toml; results in
docs/benchmarks.md); the test that their runner keeps the runner contract is not.
"""

from __future__ import annotations

import numpy as np
import pytest

import tinyinfer
from tinyinfer.config import ModelConfig, load_config
from tinyinfer.model import BUNDLED, Model
from tinyinfer.runners.runner import (
    AfterVerification,
    Batch,
    Feed,
    ModelRunner,
    Rounds,
    RunnerInfo,
    TokensFuture,
    TopFuture,
    TopLogits,
    fed_batch,
    launch_rounds_after_stepwise,
    launch_rounds_stepwise,
)
from tinyinfer.speculative import DraftModelDrafter
from tinyinfer.tokenizer import load_tokenizer


class InstantRunner:
    """Answers every step at once: token 0 greedy, all logits zero (no model math)."""

    name = "instant"
    capture_attention = False
    last_attention: tuple = ()
    last_timings: tuple = ()

    def __init__(self, config: ModelConfig):
        self.config = config
        self.vocab_size = config.vocab_size

    @property
    def info(self) -> RunnerInfo:
        return RunnerInfo(name=self.name, dtype="float32", device="cpu", itemsize=4, weight_bytes=0)

    def new_kv_cache(self, num_pages: int, page_size: int) -> None:
        return None

    def copy_page(self, kv_cache: None, src: int, dst: int) -> None:
        pass

    def forward(self, batch: Batch, kv_cache: None) -> np.ndarray:
        return np.zeros((len(batch.logits_rows), self.vocab_size), np.float32)

    def forward_top(self, batch: Batch, kv_cache: None, k: int) -> TopLogits:
        rows = len(batch.logits_rows)
        return TopLogits(np.tile(np.arange(k), (rows, 1)), np.zeros((rows, k), np.float32),
                         np.zeros(rows, np.float32))

    def launch_top(self, batch: Batch, kv_cache: None, k: int, feed: Feed | None = None) -> TopFuture:
        return TopFuture.done(self.forward_top(fed_batch(batch, feed), kv_cache, k))

    def launch_rounds(self, batch: Batch, kv_cache: None, rounds: Rounds) -> TokensFuture:
        return launch_rounds_stepwise(self, batch, kv_cache, rounds)

    def launch_rounds_after(self, kv_cache: None, after: AfterVerification) -> TokensFuture:
        return launch_rounds_after_stepwise(self, kv_cache, after)

    def close(self) -> None:
        pass


def instant_model() -> Model:
    config = load_config(BUNDLED["bundled"])
    return Model(config=config, runner=InstantRunner(config), path=BUNDLED["bundled"], name="instant",
                 tokenizer=load_tokenizer(BUNDLED["bundled"]))


def speculative_engine() -> tinyinfer.Engine:
    """Batch 1, a draft model guessing 4 tokens a step: every guess kept (both runners answer
    token 0), so each step also runs the draft's two-row catch-up."""
    engine = tinyinfer.Engine(instant_model(), drafter=DraftModelDrafter(instant_model()), num_draft=4,
                              detail="none")
    engine.add_request(list(range(1, 129)), tinyinfer.SamplingParams(temperature=0, max_tokens=800,
                                                                      ignore_eos=True))
    engine.step()  # the prompt
    return engine


def test_the_instant_runner_keeps_the_runner_contract():
    """Not a benchmark (runs in CI): the benchmarks' runner answers everything the engine asks, so
    they keep measuring the engine when the contract grows (a runner without launch_top once left
    them failing where nobody ran them)."""
    model = instant_model()
    assert isinstance(model.runner, ModelRunner)
    engine = tinyinfer.Engine(model, detail="none")
    engine.add_request([1, 2, 3], tinyinfer.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    kinds = []
    while engine.has_unfinished():
        kinds += [s.kind for s in engine.step().seqs]
    assert kinds == ["prefill", "decode", "decode"]
    spec = speculative_engine()
    trace = spec.step()
    assert [s.kind for s in trace.seqs] == ["decode"] and spec.spec_stats.mean_accepted == 4


@pytest.mark.parametrize("batch", [16, 256])
def test_decode_step_host_time(benchmark, batch):
    model = instant_model()
    engine = tinyinfer.Engine(model, max_num_seqs=batch, max_num_batched_tokens=8192,
                              num_pages=batch * 60, detail="none")
    rng = np.random.default_rng(0)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(0, model.config.vocab_size, 500).tolist(), params)
    while any(s.kind == "prefill" for s in engine.step().seqs):
        pass
    trace = benchmark.pedantic(engine.step, rounds=100, warmup_rounds=5)
    assert len(trace.seqs) == batch and all(s.kind == "decode" for s in trace.seqs)


def test_speculative_step_host_time(benchmark):
    """One speculative step at batch 1, k = 4 (draft rounds, verification, acceptance, the trace
    at detail "none"): the engine's host time in a cycle, beside the GPU's draft and verification."""
    engine = speculative_engine()
    for _ in range(5):
        engine.step()
    trace = benchmark.pedantic(engine.step, rounds=100, warmup_rounds=5)
    assert [s.kind for s in trace.seqs] == ["decode"]
