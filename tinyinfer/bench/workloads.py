"""Measurements of the engine on reproducible synthetic workloads.

* ``batching``: the same requests through continuous vs static batching and paged vs
  contiguous KV allocation — throughput (claim C8) and KV memory waste (claim C9).
* ``prefix``: time to first token with and without a prefix-cache hit on a long shared
  system prompt (claim C17).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tinyinfer.bench.oracle import OracleDrafter
from tinyinfer.display import progress
from tinyinfer.display.tables import table
from tinyinfer.engine import Engine
from tinyinfer.engine_config import DEFAULTS
from tinyinfer.model import Model
from tinyinfer.sampling import SamplingParams
from tinyinfer.simulate.model import speculative_speedup
from tinyinfer.simulate.quantity import given
from tinyinfer.speculative import SpeculativeStats


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_tokens: int


def make_workload(num_requests: int, vocab_size: int, max_model_len: int,
                  seed: int = 0) -> list[Request]:
    """Requests with a chat-like spread: log-normal prompt and output lengths, clipped to fit."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(120), 0.8, num_requests), 4, max_model_len // 2)
    outputs = np.clip(rng.lognormal(np.log(80), 0.9, num_requests), 2, max_model_len // 2)
    return [Request(tuple(rng.integers(0, vocab_size, int(p)).tolist()), int(o))
            for p, o in zip(prompts, outputs)]


@dataclass(frozen=True)
class WorkloadResult:
    mode: str
    requests: int
    output_tokens: int
    seconds: float
    steps: int
    tokens_per_second: float
    mean_running: float
    kv_waste: float  # time-averaged share of allocated KV slots holding no token
    ttft_p50_ms: float
    ttft_p95_ms: float
    running_per_step: tuple[int, ...]  # sequences in each step's batch
    finished_per_step: tuple[int, ...]  # requests that finished in each step


def run_workload(model: Model, workload: list[Request], mode: str,
                 **engine_kwargs: Any) -> WorkloadResult:
    """Push every request in at once and step until all finish; greedy, EOS ignored."""
    engine = Engine(model, **engine_kwargs)
    ids = [engine.add_request(list(r.prompt_ids),
                              SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
           for r in workload]
    running, finished, allocated_slots, written_slots = [], [], 0, 0
    start = time.perf_counter()
    with progress.task(f"{mode}: requests", total=len(workload)) as advance:
        while engine.has_unfinished():
            trace = engine.step()
            running.append(trace.num_running + len(trace.finished))
            finished.append(len(trace.finished))
            allocated_slots += engine.pool.num_used_pages * engine.pool.page_size
            written_slots += sum(s.num_computed for s in engine.scheduler.running)
            advance(len(trace.finished))
    seconds = time.perf_counter() - start
    done = [engine.release(i) for i in ids]
    ttfts = sorted(1e3 * c.metrics.ttft for c in done)
    output_tokens = sum(len(c.token_ids) for c in done)
    return WorkloadResult(
        mode=mode, requests=len(workload), output_tokens=output_tokens, seconds=seconds,
        steps=len(running), tokens_per_second=output_tokens / seconds, mean_running=statistics.mean(running),
        kv_waste=1 - written_slots / allocated_slots if allocated_slots else 0.0,
        ttft_p50_ms=statistics.median(ttfts), ttft_p95_ms=ttfts[int(0.95 * (len(ttfts) - 1))],
        running_per_step=tuple(running), finished_per_step=tuple(finished),
    )


BATCHING_MODES = {
    "continuous + paged": dict(batching="continuous", kv_allocation="paged"),
    "static + paged": dict(batching="static", kv_allocation="paged"),
    "continuous + contiguous": dict(batching="continuous", kv_allocation="contiguous"),
}


def bench_batching(model: Model, num_requests: int = 200, max_num_seqs: int = DEFAULTS.max_num_seqs,
                   num_pages: int | None = None, seed: int = 0) -> list[WorkloadResult]:
    """Same workload and page pool through each batching / allocation mode."""
    page_size = DEFAULTS.page_size
    full_context = -(-model.config.max_model_len // page_size)
    num_pages = num_pages or max_num_seqs * full_context
    workload = make_workload(num_requests, model.config.vocab_size, model.config.max_model_len, seed)
    return [run_workload(model, workload, mode, max_num_seqs=max_num_seqs, num_pages=num_pages,
                         page_size=page_size, enable_prefix_caching=False, **kwargs)
            for mode, kwargs in BATCHING_MODES.items()]


@dataclass(frozen=True)
class PrefixResult:
    system_tokens: int
    ttft_miss_ms: float
    ttft_hit_ms: float
    cached_tokens: int

    @property
    def speedup(self) -> float:
        return self.ttft_miss_ms / self.ttft_hit_ms


def _ttft_ms(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    done = engine.release(rid)
    return 1e3 * done.metrics.ttft, done.metrics.cached_tokens


def bench_prefix(model: Model, system_tokens: int = 512, user_tokens: int = 16,
                 repeats: int = 5, seed: int = 0) -> PrefixResult:
    """TTFT of a new question after a long system prompt: cold cache vs shared prefix."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, model.config.vocab_size, system_tokens).tolist()
    def question() -> list[int]:
        return rng.integers(0, model.config.vocab_size, user_tokens).tolist()
    misses, hits, cached = [], [], 0
    for _ in progress.track(range(repeats), "prefix: repeats"):
        misses.append(_ttft_ms(Engine(model, enable_prefix_caching=True), system + question())[0])
        warm = Engine(model, enable_prefix_caching=True)
        _ttft_ms(warm, system + question())
        hit_ms, cached = _ttft_ms(warm, system + question())
        hits.append(hit_ms)
    return PrefixResult(system_tokens, statistics.median(misses), statistics.median(hits), cached)


def batching_table(results: list[WorkloadResult]) -> str:
    base = results[0].tokens_per_second
    rows = [[r.mode, f"{r.tokens_per_second:.1f}", f"{r.tokens_per_second / base:.2f}x", r.steps,
             f"{r.mean_running:.1f}", f"{100 * r.kv_waste:.1f}", f"{r.ttft_p50_ms:.0f}",
             f"{r.ttft_p95_ms:.0f}"] for r in results]
    return table(["mode", "tok/s", "vs cont.", "steps", "running", "KV waste %", "TTFT p50 ms",
                  "TTFT p95 ms"], rows)


def to_json(obj: Any, **extra: Any) -> str:
    """Results as JSON; ``extra`` (e.g. the thread counts) goes into every record."""
    if isinstance(obj, list):
        return json.dumps([{**asdict(o), **extra} for o in obj], indent=2)
    speedups = ({"speedup": obj.speedup, "speedup_vs_async": obj.speedup_vs_async}
                if isinstance(obj, SpeculativeResult) else {})
    return json.dumps({**asdict(obj), **speedups, **extra}, indent=2)


@dataclass(frozen=True)
class SpeculativeResult:
    drafter: str
    num_draft: int
    output_tokens: int
    plain_tokens_per_second: float
    speculative_tokens_per_second: float
    acceptance_rate: float  # accepted / drafted
    token_acceptance: float  # accepted / examined: the closed form's per-token α
    mean_accepted: float
    identical: bool  # greedy speculative output equals plain greedy output (both plain runs')
    plain_step_ms: float  # plain decoding's time per token
    draft_step_ms: float  # one drafted token (a draft-model step, with its overhead)
    verify_ms: float  # one verification forward of k + 1 tokens
    other_ms: float  # the rest of a speculative step: scheduling, acceptance, bookkeeping
    closed_form_speedup: float  # the simulator's formula at token_acceptance and these costs
    asked_acceptance: float | None = None  # the oracle drafter's rate
    # plain decoding with asynchronous scheduling (step N + 1 launched before N is read): its
    # fastest, where plain_tokens_per_second reads each step before the next, as speculative steps do
    plain_async_tokens_per_second: float = 0.0
    # the speculative engine's own scheduling: asynchronous, a draft model's next rounds launched
    # behind each verification (draft_step_ms and verify_ms are then the host's view of a step)
    async_scheduling: bool = False

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_second / self.plain_tokens_per_second

    @property
    def speedup_vs_async(self) -> float:
        """The speedup against plain decoding at its fastest (asynchronous scheduling)."""
        return self.speculative_tokens_per_second / self.plain_async_tokens_per_second


PASSAGE = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to."""
SPEAKER_PROMPTS = ("ROMEO:\n", "JULIET:\nO Romeo,", "KING HENRY:\n", "HAMLET:\nTo be",
                   "FIRST CITIZEN:\n", "LADY MACBETH:\n", "PORTIA:\n", "OTHELLO:\n")


def speculative_prompts(model: Model, task: str, count: int = 8, seed: int = 0) -> list[list[int]]:
    """Prompts for the speculative benchmark.

    ``continue``: speakers' cues (text models) or random ids; ``rewrite``: a passage followed
    by its own first words, so that continuing means copying — prompt lookup's best case.
    """
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    if task == "continue":
        if model.has_tokenizer:
            return [model.tokenizer.encode(p) for p in SPEAKER_PROMPTS[:count]]
        return [rng.integers(0, vocab, 16).tolist() for _ in range(count)]
    if model.has_tokenizer:
        lines = PASSAGE.splitlines()
        passages = ["\n".join(lines[i:] + lines[:i]) for i in range(count)]
        return [model.tokenizer.encode(f"{p}\n\n{p.splitlines()[0]}\n") for p in passages]
    prompts = []
    for _ in range(count):
        passage = rng.integers(0, vocab, 200).tolist()
        prompts.append(passage + passage[:12])
    return prompts


def greedy_alone(engine: Engine, prompts: list[list[int]], max_tokens: int,
                 label: str = "plain") -> tuple[list[list[int]], float]:
    """Greedy decode of each prompt alone after one warm-up prompt (compilation, graphs,
    caches): the outputs and the seconds they took."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with progress.task(f"{label}: prompts", total=len(prompts)) as advance:
        engine.generate([prompts[0]], params)
        engine.spec_stats = SpeculativeStats()
        start = time.perf_counter()
        outputs = []
        for p in prompts:
            outputs.append(engine.generate([p], params)[0].token_ids)
            advance()
        return outputs, time.perf_counter() - start


def bench_speculative(model: Model, drafter: Any, prompts: list[list[int]], max_tokens: int = 128,
                      num_draft: int = 4,
                      plain: tuple[list[list[int]], float] | None = None,
                      plain_async: tuple[list[list[int]], float] | None = None,
                      spec_async: bool = False) -> SpeculativeResult:
    """Greedy decode of each prompt alone, plain vs speculative (warmed up once each).

    Plain decoding twice: as the speculative engine steps (each step's tokens read before the
    next is launched), and with asynchronous scheduling, its fastest. ``plain``, ``plain_async``:
    greedy_alone's results for those, when several drafters share them. The oracle drafter
    follows the plain run's tokens through an untimed speculative pass, then the tokens of that
    pass through the timed one (see bench/oracle.py). ``spec_async``: the speculative engine
    with asynchronous scheduling (a draft model's next rounds launched behind each verification).
    """
    if plain is None:
        plain = greedy_alone(Engine(model, max_num_seqs=1, detail="none"), prompts, max_tokens)
    if plain_async is None:
        plain_async = greedy_alone(Engine(model, max_num_seqs=1, detail="none", async_scheduling=True),
                                   prompts, max_tokens, "plain, asynchronous")
    plain_ids, plain_s = plain
    spec_engine = Engine(model, max_num_seqs=1, detail="none", drafter=drafter, num_draft=num_draft,
                         async_scheduling=spec_async)
    oracle = isinstance(drafter, OracleDrafter)
    if oracle:
        drafter.follow(prompts, plain_ids)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        drafter.follow(prompts, [c.token_ids for c in spec_engine.generate(prompts, params)])
    spec, spec_s = greedy_alone(spec_engine, prompts, max_tokens, "speculative")
    tokens = sum(len(o) for o in plain_ids)
    stats = spec_engine.spec_stats
    plain_step = plain_s / tokens
    draft_step = stats.draft_seconds / max(stats.drafted, 1)
    verify_time = stats.verify_seconds / max(stats.verify_steps, 1)
    other = (stats.step_seconds - stats.draft_seconds - stats.verify_seconds) / max(stats.verify_steps, 1)
    closed = speculative_speedup(given("k", num_draft), given("acceptance", stats.token_acceptance),
                                 given("draft_step_time", draft_step), given("verify_time", verify_time),
                                 given("tpot", plain_step))["spec_speedup"].value
    return SpeculativeResult(drafter.name, num_draft, tokens, tokens / plain_s, tokens / spec_s,
                             stats.acceptance_rate, stats.token_acceptance, stats.mean_accepted,
                             spec == plain_ids == plain_async[0], 1e3 * plain_step, 1e3 * draft_step,
                             1e3 * verify_time, 1e3 * other, closed, drafter.acceptance if oracle else None,
                             tokens / plain_async[1], spec_async)
