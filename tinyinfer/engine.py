"""The Engine: requests in, one scheduled batch per `step()`, tokens and traces out.

    add_request ─▶ Scheduler (waiting → running) ─▶ Batch ─▶ runner.forward ─▶ logits
        ▲                                                                     │
        └──────── text, finish, StepTrace ◀── stops ◀── sample_next ◀─────────┘

With ``async_scheduling`` (OverlapSteps, below) plain greedy decode steps are launched one
ahead: the host reads step N's tokens while the device runs step N+1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator
from typing import Sequence as Seq

import numpy as np

from tinyinfer.engine_config import EngineConfig
from tinyinfer.errors import (
    ContextOverflowError,
    InvalidLogitsError,
    OutOfPagesError,
    PromptError,
    TinyInferError,
)
from tinyinfer.kv import PagePool
from tinyinfer.model import Model, check_token_ids
from tinyinfer.runners.runner import (
    AfterVerification,
    Batch,
    Feed,
    Rounds,
    TokensFuture,
    TopFuture,
    TopLogits,
    make_batch,
)
from tinyinfer.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    StopHoldback,
    TokenChoice,
    find_stop,
    greedy_choice,
    greedy_choices_from_top,
    is_plain_greedy,
    sample_next,
)
from tinyinfer.scheduler import (
    Chunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
)
from tinyinfer.speculative import (
    Draft,
    Drafter,
    DraftModelDrafter,
    SpeculativeStats,
    Verification,
    verify,
    verify_greedy,
)
from tinyinfer.tokenizer import IncrementalDecoder
from tinyinfer.trace import Candidate, PoolView, RequestStart, SeqStep, StepTrace

# Plug points: functions this module calls by their global name, so that the course can put a
# student's version in their place (lessons/support.py: plugged). tests/test_lessons.py checks
# that the engine still reaches every one.
# speculative.verify (full logits rows) and verify_greedy (plainly greedy steps, argmaxes
# reduced on the device), as the engine calls them
PLUG_POINTS = ("verify", "verify_greedy")

TOP_LOGITS = 64
# Temperatures at which a full-detail trace sums the logits outside the top ones, so a UI can
# re-apply sampling settings over the whole vocabulary (the TUI's temperature knob: 0.1 steps).
REST_TEMPERATURES = tuple(round(0.1 * i, 1) for i in range(1, 21))
TOP_FOR_GREEDY = 20


@dataclass
class RequestMetrics:
    """Wall-clock moments of one request (seconds, time.perf_counter)."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


@dataclass
class Completion:
    """The result of one request."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    error: str | None = None  # why a request with finish_reason "error" failed


@dataclass
class _Request:
    seq: Sequence
    decoder: IncrementalDecoder | None
    metrics: RequestMetrics
    text: str = ""  # up to the last token the decoder has read (see settle)
    unread: list[int] = field(default_factory=list)  # sampled ids the decoder has not read yet
    streamed: int = 0  # characters of text already handed to a stream
    choices: list[TokenChoice] = field(default_factory=list)
    holdback: StopHoldback | None = None  # for streaming: how much text could begin a stop
    error: str | None = None

    def settle(self) -> str:
        """The request's text so far: the decoder reads the ids it has not read yet first."""
        if self.unread:
            self.text += "".join(map(self.decoder.push, self.unread))
            self.unread.clear()
        return self.text


class Engine:
    """Continuous-batching engine over one model and one paged KV cache."""

    def __init__(self, model: Model, config: EngineConfig | None = None, *,
                 drafter: Drafter | None = None, **options: Any):
        """``options`` are EngineConfig fields that replace ``config``'s (or the defaults):
        ``Engine(model, max_num_seqs=4)`` is ``Engine(model, EngineConfig(max_num_seqs=4))``."""
        config = dataclasses.replace(config or EngineConfig(), **options)
        self.config = config
        self.model = model
        self.detail = config.detail
        self.drafter = drafter
        self.num_draft = config.num_draft if drafter is not None else 0
        self.spec_stats = SpeculativeStats()
        if drafter is not None:
            _check_drafter(model, drafter, config.num_draft)
            if config.async_scheduling and not isinstance(drafter, DraftModelDrafter):
                raise TinyInferError("async_scheduling overlaps speculative steps with a draft model "
                                     "only: drop async_scheduling, or draft with a model")
        # The draft model's own KV pages, run by the engine (speculative decoding with a draft model).
        self.draft_run = (DraftRun(drafter, config.draft_num_pages, config.page_size)
                          if isinstance(drafter, DraftModelDrafter) else None)
        runner = model.runner
        runner.capture_attention = config.detail == "full"
        info = runner.info
        self.page_bytes = info.kv_bytes_per_token(model.config) * config.page_size
        self._rank_shares = info.rank_shares  # fixed for the runner's life: read once, not per step
        num_pages = config.num_pages if config.num_pages is not None else self._default_num_pages()
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            batching=config.batching, kv_allocation=config.kv_allocation,
                            max_model_len=model.config.max_model_len,
                            num_lookahead_slots=self.num_draft),
            self.pool,
        )
        self.kv_cache = runner.new_kv_cache(num_pages, config.page_size)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self.step_count = 0
        self._queued: list[RequestStart] = []  # for the next trace (detail basic and full)
        self._described: set[int] = set()  # token ids whose text a trace carried already
        # Asynchronous scheduling: the step launched ahead, and how the next one is planned.
        # With a draft model it launches the next step's rounds behind each verification instead
        # (``_draft_ahead``): a speculative step's next input is the verification's outcome.
        self._overlap = OverlapSteps(self) if config.async_scheduling and drafter is None else None

    def _default_num_pages(self) -> int:
        """As many pages as kv_cache_memory pays for at the runner's bytes per value, scales
        included (a bf16 pool gets twice a float32 one's, an int8 one nearly twice a bf16 one's),
        up to every slot's full context, and at least one context."""
        full_context = math.ceil(self.model.config.max_model_len / self.config.page_size)
        return max(min(self.config.kv_cache_memory // self.page_bytes,
                       self.config.max_num_seqs * full_context), full_context)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids); it joins the running batch at a coming step."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty: give some text")
            prompt_ids = self.model.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        prompt_ids = check_token_ids(prompt_ids, self.model.config)
        self._check_fits(len(prompt_ids), params.max_tokens)
        seq_id = next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}"
        if request_id in self._requests:
            raise TinyInferError(f"request id {request_id} is already in use")
        rng = np.random.default_rng(params.seed if params.seed is not None
                                    else self._rng.integers(2**63))
        seq = Sequence(seq_id, request_id, prompt_ids, params, rng)
        tokenizer = self.model.tokenizer if self.model.has_tokenizer else None
        decoder = IncrementalDecoder(tokenizer, prompt_ids) if tokenizer is not None else None
        self._requests[request_id] = _Request(seq, decoder, RequestMetrics(time.perf_counter()),
                                              holdback=StopHoldback(params.stop))
        self.scheduler.add(seq)
        if self.detail != "none":
            self._queued.append(RequestStart(request_id, tuple(prompt_ids)))
        return request_id

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.model.config.max_model_len
        if prompt_len + max_tokens > limit:
            raise ContextOverflowError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_len + max_tokens} exceeds the model's context of {limit} tokens: "
                "shorten the prompt or lower max_tokens"
            )
        pages = math.ceil((prompt_len + max_tokens) / self.pool.page_size)
        if pages > self.pool.num_pages:
            raise OutOfPagesError(
                f"this request needs up to {pages} KV pages but the pool has only "
                f"{self.pool.num_pages}: give the engine more pages or lower max_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its pages."""
        request = self._requests.get(request_id)
        if request is None:
            raise TinyInferError(f"no request with id {request_id}")
        if request.seq.finish_reason is None:
            self._finish(request.seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def completion(self, request_id: str) -> Completion:
        """The request's output so far (final once its finish_reason is set)."""
        r = self._requests[request_id]
        return Completion(
            request_id=request_id,
            prompt_ids=list(r.seq.prompt_ids),
            token_ids=list(r.seq.output_ids),
            text=r.settle(),
            finish_reason=r.seq.finish_reason,
            logprobs=[c.logprob for c in r.choices],
            top_logprobs=[c.top_logprobs for c in r.choices],
            metrics=r.metrics,
            error=r.error,
        )

    def release(self, request_id: str) -> Completion:
        """Return a finished request's completion and forget it."""
        completion = self.completion(request_id)
        if completion.finish_reason is None:
            raise TinyInferError(f"request {request_id} has not finished; abort it first")
        del self._requests[request_id]
        return completion

    # ------------------------------------------------------------------ the loop

    def step(self) -> StepTrace:
        """Schedule one batch, run the model once, sample, and report what happened.

        With async_scheduling, a plain greedy decode step returns once the next step is queued
        on the device (``OverlapSteps``), and a speculative step with a draft model once the
        next step's rounds are (``_draft_ahead``); its trace still describes this step alone."""
        if self._overlap is not None:
            return self._overlap.step()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        return self._run(out, t0, time.perf_counter())

    def _run(self, out: SchedulerOutput, t0: float, t1: float) -> StepTrace:
        """Run a scheduled step to its end: draft, forward, choose tokens, trace."""
        drafts = self._draft(out.chunks)
        greedy = self._greedy_step(out.chunks, drafts) if self._greedy_only(out.chunks) else None
        if greedy is not None:
            steps, freed, t2, t3, device_s = greedy
        else:
            guesses = drafts.result()
            t2 = time.perf_counter()
            (steps, freed, t3), device_s = self._full_step(out.chunks, guesses), None
        if drafts.drafted:
            self.spec_stats.draft_seconds += t2 - t1
            self.spec_stats.verify_seconds += t3 - t2
        trace = self._finish_step(out, steps, freed, t0, t1, t2, t3, device_s)
        if drafts.drafted:
            self.spec_stats.step_seconds += time.perf_counter() - t0
        return trace

    def _full_step(self, chunks: list[Chunk],
                   drafts: dict[int, Draft]) -> tuple[list[SeqStep], list[int], float]:
        """Forward with full logits rows [R, V] on the host: sampling, penalties, detail="full"."""
        logits, rows = self._forward(chunks, drafts)
        t3 = time.perf_counter()
        eos = self.model.eos_token_ids
        steps, freed = [], []
        for chunk, rows_of_chunk in zip(chunks, rows):
            draft = drafts.get(chunk.seq.seq_id)
            if draft is not None:
                chunk_logits = logits[rows_of_chunk]
                seq_step, pages, last = self._advance_speculative(
                    chunk, draft, lambda: verify(chunk_logits, draft, chunk.seq,
                                                 eos_token_id=eos[0] if eos else None))
            else:
                last = rows_of_chunk.stop - 1
                seq_step, pages = self._advance(chunk, self._sampler(chunk.seq, logits[last]))
            if self.detail == "full":
                row = last if draft is None else rows_of_chunk.start + last
                seq_step = self._with_detail(seq_step, len(steps), logits[row])
            steps.append(seq_step)
            freed += pages
        return steps, freed, t3

    def _finish_step(self, out: SchedulerOutput, steps: list[SeqStep], freed: list[int],
                     t0: float, t1: float, t2: float, t3: float,
                     device_s: float | None = None) -> StepTrace:
        t4 = time.perf_counter()
        self.step_count += 1
        finished = [s.seq_id for s in steps if s.finish_reason is not None]
        timings = {"schedule": t1 - t0, "forward": t3 - t2, "sample": t4 - t3}
        if self.drafter is not None:
            timings["draft"] = t2 - t1
        rank_timings = {}
        for rank in self.model.runner.last_timings if out.chunks else ():  # tensor parallelism
            rank_timings[f"rank{rank.rank}_compute"] = rank.compute_s
            rank_timings[f"rank{rank.rank}_all_reduce"] = rank.all_reduce_s
            rank_timings[f"rank{rank.rank}_forward"] = rank.forward_s
        requests, self._queued = tuple(self._queued), []
        return StepTrace(
            step=self.step_count,
            seqs=tuple(steps),
            admitted=tuple(s.seq_id for s in out.admitted),
            preempted=tuple(s.seq_id for s in out.preempted),
            finished=tuple(finished),
            pages_allocated=tuple(out.pages_allocated),
            pages_freed=tuple(freed),
            prefix_hit_pages=tuple(out.prefix_hit_pages),
            num_batched_tokens=sum(s.end - s.start for s in steps),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            pool=self.pool_view() if self.detail != "none" else None,
            timings=timings,
            rank_timings=rank_timings,
            requests=requests,
            token_texts=self._new_texts(requests, steps) if self.detail != "none" else (),
            device_seconds=device_s,
        )

    def _new_texts(self, requests: tuple[RequestStart, ...],
                   steps: list[SeqStep]) -> tuple[tuple[int, str], ...]:
        """Texts of the token ids this step mentions that no earlier trace described."""
        if not self.model.has_tokenizer:
            return ()
        ids = [t for r in requests for t in r.prompt_ids]
        for s in steps:
            ids += [*s.emitted, *s.draft_tokens, *(t for t, _ in s.top_logits),
                    *(c.token_id for c in s.candidates)]
            if s.token_id is not None:
                ids.append(s.token_id)
        texts = []
        for t in dict.fromkeys(ids):
            if t not in self._described:
                self._described.add(t)
                texts.append((t, self.model.tokenizer.generated_bytes(t).decode("utf-8", errors="replace")))
        return tuple(texts)

    def _greedy_only(self, chunks: list[Chunk]) -> bool:
        """True when every row is plain greedy, so the runner may reduce logits on its side."""
        return (bool(chunks) and self.detail != "full"
                and all(is_plain_greedy(c.seq.params, len(c.seq.output_ids), TOP_FOR_GREEDY)
                        for c in chunks))

    def _greedy_step(self, chunks: list[Chunk], drafts: LaunchedDrafts
                     ) -> tuple[list[SeqStep], list[int], float, float, float | None] | None:
        """Forward with top-k logits only (no [R, V] transfer), then pick each argmax; a drafted
        sequence keeps its guesses while they equal those argmaxes (``verify_greedy``).

        The verification is queued before the guesses are read: those the draft model's rounds
        are still computing reach it on the device (``LaunchedDrafts.feed``), so the host stages
        it while the rounds run and waits once, for both. -> (steps, freed pages, t2, the moment
        the result was read, device seconds), where t2 - t1 is the draft's time (until the
        verification's launch, and the wait for the guesses after it) and the rest the
        verification's (its launch, and the wait for its result): on a device that queues work
        as on a runner that computes each launch at once.

        None when the runner refused a row of invalid logits while reducing them: the step then
        runs again with full rows (writing the same K/V), which sorts the bad rows out one by one.
        """
        batch, rows = self._pack(chunks, drafts.placeholders())
        try:
            launch = time.perf_counter()
            future = self._launch_top(batch, chunks, drafts.feed(batch, chunks))
            launched = time.perf_counter()
            guesses = drafts.result()  # the rounds' argmaxes land before the verification has run
            t2 = launch + time.perf_counter() - launched
            if guesses and self.config.async_scheduling:
                self._draft_ahead(chunks, guesses, rows, future)
            top = future.result()
        except InvalidLogitsError:
            return None
        t3 = time.perf_counter()
        steps, freed = self._greedy_advance(chunks, top, rows, guesses)
        return steps, freed, t2, t3, future.device_seconds

    def _draft_ahead(self, chunks: list[Chunk], guesses: dict[int, Draft], rows: list[slice],
                     verification: TopFuture) -> None:
        """Asynchronous scheduling with a draft model: launch the next step's draft rounds behind
        the verification (``DraftRun.launch_after``) where that step is certain to run these
        sequences as plain greedy decodes: every running one decodes plain greedy with
        guesses. After keeping a of its guesses a sequence drafts as many as its lookahead
        allows then (the lookahead bounds a step's guesses: near its max_tokens, one that keeps
        more has room for fewer), as the synchronous engine would; one with no room even after
        keeping none gets no rounds. Else the next step drafts after the host's turn."""
        scheduler = self.scheduler
        if self.draft_run is None or not scheduler.runs_exactly([c.seq for c in chunks]):
            return  # (an admission comes after the running sequences: it changes nothing here)
        drafted = [guesses.get(c.seq.seq_id) for c in chunks]
        if any(c.kind != "decode" or d is None or not d.tokens
               or not is_plain_greedy(c.seq.params, len(c.seq.output_ids), 1) for c, d in zip(chunks, drafted)):
            return
        # each sequence's lookahead after keeping a = 0 .. all of its guesses (and the target's token)
        ks = [[scheduler.lookahead(c.seq, emitted=a + 1) for a in range(len(d.tokens) + 1)]
              for c, d in zip(chunks, drafted)]
        ahead = [i for i, k in enumerate(ks) if k[0] > 0]  # the others may not draft next time
        if ahead:
            self.draft_run.launch_after([chunks[i].seq for i in ahead], [drafted[i].tokens for i in ahead],
                                        [rows[i] for i in ahead], verification, [ks[i] for i in ahead])

    def _launch_top(self, batch: Batch, chunks: list[Chunk], feed: Feed | None = None) -> TopFuture:
        """Queue a greedy step on the runner: its top logits, on their way to the host. As many
        per row as the most logprobs a row asks for (none: the argmax alone, a cheaper
        reduction over the vocabulary than a top k)."""
        k = max([1] + [c.seq.params.logprobs or 0 for c in chunks])
        return self.model.runner.launch_top(batch, self.kv_cache, k, feed)

    def _greedy_advance(self, chunks: list[Chunk], top: TopLogits, rows: list[slice],
                        drafts: dict[int, Draft]) -> tuple[list[SeqStep], list[int]]:
        """Each chunk's argmax (its last row of top, ``rows``) through the stop rules; a drafted
        chunk's k + 1 rows through ``verify_greedy``."""
        valid = np.isfinite(top.logsumexp).tolist()  # [R]; NaN or +inf anywhere in a row, or all -inf
        row_params = [c.seq.params for c, r in zip(chunks, rows) for _ in range(r.stop - r.start)]
        with np.errstate(invalid="ignore"):
            choices = greedy_choices_from_top(top.ids, top.values, top.logsumexp, row_params)

        def choice_at(row: int) -> TokenChoice:
            return choices[row] if valid[row] else _invalid_row()

        steps, freed = [], []
        for chunk, r in zip(chunks, rows):
            draft = drafts.get(chunk.seq.seq_id)
            if draft is not None:
                seq_step, pages, _ = self._advance_speculative(
                    chunk, draft, lambda r=r, draft=draft: verify_greedy(
                        lambda i: choice_at(r.start + i), draft))
            else:
                seq_step, pages = self._advance(chunk, lambda r=r: choice_at(r.stop - 1))
            steps.append(seq_step)
            freed += pages
        return steps, freed

    def _draft(self, chunks: list[Chunk]) -> LaunchedDrafts:
        """Ask the drafter for guesses for every decoding sequence (speculative mode only)."""
        if self.drafter is None:
            return LaunchedDrafts.known({})
        seqs = [c.seq for c in chunks if c.kind == "decode"]
        ks = [self.scheduler.lookahead(seq) for seq in seqs]
        if self.draft_run is not None:
            launched = self.draft_run.adopt(seqs, ks)  # rounds launched behind the last verification
            return launched if launched is not None else self.draft_run.propose(seqs, ks)
        drafts = self.drafter.propose(seqs, ks)
        return LaunchedDrafts.known({seq.seq_id: d for seq, d in zip(seqs, drafts) if d.tokens})

    def _forward(self, chunks: list[Chunk], drafts: dict[int, Draft]) -> tuple[np.ndarray, list[slice]]:
        """One runner call for the whole batch; returns logits and each chunk's rows of them."""
        if not chunks:
            return np.zeros((0, 0), np.float32), []
        batch, rows = self._pack(chunks, drafts)
        return self.model.runner.forward(batch, self.kv_cache), rows

    def _pack(self, chunks: list[Chunk], drafts: dict[int, Draft]) -> tuple[Batch, list[slice]]:
        """The step's chunks (plus drafted tokens) as one Batch, and each chunk's logits rows."""
        entries, rows, row = [], [], 0
        for c in chunks:
            draft = drafts.get(c.seq.seq_id)
            tokens = c.seq.all_ids[c.start:c.end]  # a new list
            if draft is not None:
                tokens += draft.tokens
            entries.append((tokens, c.start, self.pool.pages(c.seq.seq_id), draft is not None))
            n_rows = len(tokens) if draft else 1
            rows.append(slice(row, row + n_rows))
            row += n_rows
        return make_batch(entries, self.pool.page_size), rows

    def _base_step(self, chunk: Chunk) -> dict:
        seq = chunk.seq
        request = self._requests[seq.request_id]
        if chunk.cached_tokens:
            request.metrics.cached_tokens = chunk.cached_tokens
        request.metrics.num_preemptions = seq.num_preemptions
        return {"seq_id": seq.seq_id, "request_id": seq.request_id, "kind": chunk.kind,
                "start": chunk.start, "end": chunk.end, "cached_tokens": chunk.cached_tokens,
                "token_ids": tuple(seq.all_ids[chunk.start:chunk.end])}

    def _sampler(self, seq: Sequence, logits: np.ndarray) -> Callable[[], TokenChoice]:
        """How to choose a sequence's next token from its full logits row [V]."""
        if is_plain_greedy(seq.params, len(seq.output_ids), MAX_LOGPROBS):
            return lambda: greedy_choice(logits, seq.params)
        eos = self.model.eos_token_ids
        return lambda: sample_next(logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng,
                                   eos_token_id=eos[0] if eos else None)

    def _advance(self, chunk: Chunk,
                 choose: Callable[[], TokenChoice]) -> tuple[SeqStep, list[int]]:
        """Record a computed chunk; if it reached the end, choose a token and apply stop rules."""
        seq = chunk.seq
        base = self._base_step(chunk)
        seq.num_computed = chunk.end
        self.pool.commit(seq.seq_id, seq.all_ids, chunk.end)
        if not chunk.samples:
            return SeqStep.from_fields(base), []
        try:
            choice = choose()
        except InvalidLogitsError as exc:
            return self._fail(seq, base, exc)
        token_text, reason = self._accept(seq, choice)
        pages = self._finish(seq, reason) if reason is not None else []
        base.update(token_id=choice.token_id, token_text=token_text, logprob=choice.logprob,
                    token_prob=choice.prob, candidates=self._candidates(choice),
                    finish_reason=reason)
        return SeqStep.from_fields(base), pages

    def _advance_speculative(self, chunk: Chunk, draft: Draft,
                             check: Callable[[], Verification]) -> tuple[SeqStep, list[int], int]:
        """Verify a draft (``check`` applies the acceptance rule to the target's k + 1 rows),
        emit 1..k+1 tokens, roll back the rest."""
        seq = chunk.seq
        base = self._base_step(chunk)
        try:
            result = check()
        except InvalidLogitsError as exc:
            seq_step, pages = self._fail(seq, base, exc)
            return seq_step, pages, len(draft.tokens)
        text, reason, emitted = "", None, []
        for choice in result.choices:
            piece, reason = self._accept(seq, choice)
            text += piece
            emitted.append(choice.token_id)
            if reason is not None:
                break
        stats = self.spec_stats
        stats.verify_steps += 1
        stats.drafted += len(draft.tokens)
        stats.accepted += result.accepted
        stats.rejected += result.accepted < len(draft.tokens)
        stats.emitted += len(emitted)
        if reason is not None:
            pages = self._finish(seq, reason)
        else:
            # K/V is valid for the last token and the accepted guesses; the rest is rolled back.
            seq.num_computed = chunk.end + result.accepted
            self.pool.truncate(seq.seq_id, seq.num_computed)
            self.pool.commit(seq.seq_id, seq.all_ids, seq.num_computed)
            if self.draft_run is not None:
                self.draft_run.rollback(seq)
            pages = []
        choice = result.choices[len(emitted) - 1]
        return SeqStep(**{**base, "end": chunk.end + len(draft.tokens)}, token_id=choice.token_id,
                       token_text=text, logprob=choice.logprob, token_prob=choice.prob,
                       candidates=self._candidates(choice),
                       finish_reason=reason, draft_tokens=draft.tokens, accepted=result.accepted,
                       emitted=tuple(emitted)), pages, len(emitted) - 1

    def _fail(self, seq: Sequence, base: dict, exc: InvalidLogitsError) -> tuple[SeqStep, list[int]]:
        """The guard: a row no token can be chosen from ends its own request (finish reason
        "error", pages freed), never the step, so the rest of the batch goes on."""
        self._requests[seq.request_id].error = (f"request {seq.request_id} stopped: {exc} (a "
                                                "corrupt checkpoint, or settings that overflow)")
        return SeqStep(**base, finish_reason="error"), self._finish(seq, "error")

    def _accept(self, seq: Sequence, choice: TokenChoice) -> tuple[str, str | None]:
        """Append a sampled token to the output; return its text and a finish reason, if any."""
        request = self._requests[seq.request_id]
        token_id = choice.token_id
        seq.append(token_id)
        request.choices.append(choice)
        if request.metrics.first_token is None:
            request.metrics.first_token = time.perf_counter()
        ends = self._is_end_token(token_id, seq.params)
        token_text, hit_stop = self._emit_text(request, token_id, ends)
        return token_text, "stop" if ends or hit_stop else self._length_reason(seq)

    def _finish(self, seq: Sequence, reason: str) -> list[int]:
        """Mark a sequence finished and free its pages (and the drafter's)."""
        request = self._requests[seq.request_id]
        seq.finish_reason = reason
        request.metrics.finished = time.perf_counter()
        if request.decoder is not None and reason == "length":
            request.settle()
            request.text += request.decoder.flush()
        if self.draft_run is not None:
            self.draft_run.release(seq)
        return self.scheduler.finish(seq)

    def _emit_text(self, request: _Request, token_id: int, ends: bool) -> tuple[str, bool]:
        """Append a token's text (an end token, ``ends``, has none, but ends what the decoder
        held back); cut at a stop string if one appears.

        Without stop strings and at detail "none" (a trace without texts), nothing needs the
        text now: the token waits in request.unread, decoded when someone reads the text.
        """
        params = request.seq.params
        if request.decoder is None:
            return "", False
        later = self.detail == "none" and not params.stop
        if ends:
            request.settle()
            piece = request.decoder.flush()
        elif later:
            request.unread.append(token_id)
            return "", False
        else:
            piece = request.decoder.push(token_id)
        request.text += piece
        cut = find_stop(request.text, params.stop) if params.stop else None
        if cut is not None:
            request.text = request.text[:cut]
        return "" if later else piece, cut is not None

    def _is_end_token(self, token_id: int, params: SamplingParams) -> bool:
        if token_id in params.stop_token_ids:
            return True
        return not params.ignore_eos and token_id in self.model.eos_token_ids

    def _length_reason(self, seq: Sequence) -> str | None:
        """The finish reason "length" once a sequence has its max_tokens or fills the context."""
        if len(seq.output_ids) >= seq.params.max_tokens:
            return "length"
        if seq.num_tokens >= self.model.config.max_model_len:
            return "length"
        return None

    def _with_detail(self, seq_step: SeqStep, row: int, logits: np.ndarray) -> SeqStep:
        """Attach raw top logits and (reference runner) attention weights to a step record."""
        order = np.argsort(-logits, kind="stable")
        top, rest = order[:TOP_LOGITS], logits[order[TOP_LOGITS:]].astype(np.float64)
        peak = rest.max() if rest.size else 0.0
        rest_lse = tuple((t, float(peak / t + np.log(np.exp((rest - peak) / t).sum())))
                         for t in REST_TEMPERATURES) if rest.size else ()
        captured = self.model.runner.last_attention
        attention = ()
        if row < len(captured):
            attention = tuple(tuple(tuple(float(x) for x in head) for head in layer)
                              for layer in captured[row])
        return dataclasses.replace(
            seq_step, top_logits=tuple((int(t), float(logits[t])) for t in top),
            rest_logsumexp=rest_lse, attention=attention)

    def _candidates(self, choice: TokenChoice) -> tuple[Candidate, ...]:
        """The ranked alternatives a UI shows beside the token; none at detail "none" (serving and
        benchmarks read a request's choices, not the trace's)."""
        if self.detail == "none":
            return ()
        tokenizer = self.model.tokenizer if self.model.has_tokenizer else None
        def text(token_id: int) -> str:
            if tokenizer is None:
                return ""
            return tokenizer.generated_bytes(token_id).decode("utf-8", errors="replace")
        return tuple(Candidate(t, p, text(t)) for t, p in choice.top)

    def pool_view(self) -> PoolView:
        snap = self.pool.snapshot()
        return PoolView(
            num_pages=self.pool.num_pages, page_size=self.pool.page_size,
            used=snap.num_used, free=snap.num_free, cached=snap.num_cached,
            owners=tuple(p.owners for p in snap.pages),
            cached_pages=tuple(p.page_id for p in snap.pages if p.cached),
            page_bytes=self.page_bytes, prefix_hits=snap.prefix_hits,
            prefix_queries=snap.prefix_queries,
            ranks=self._rank_shares,  # tensor parallelism (one rank: empty)
        )

    def seq_id(self, request_id: str) -> int:
        """The sequence id traces use for a request."""
        return self._requests[request_id].seq.seq_id

    # ------------------------------------------------------------------ conveniences

    def stream_text(self, request_id: str) -> str:
        """New text of a request since the last call, holding back a possible stop-string start."""
        r = self._requests[request_id]
        text = r.settle()
        end = len(text)
        if r.seq.finish_reason is None and r.holdback is not None:
            end -= r.holdback.holdback(text)
        piece = text[r.streamed:end]
        r.streamed = max(r.streamed, end)
        return piece

    def stream(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt, yielding text as it is produced (other requests keep running).

        The request is checked and queued now, so a bad prompt raises before any text is out.
        """
        return self._stream(self.add_request(prompt, params))

    def _stream(self, request_id: str) -> Iterator[str]:
        try:
            while self.completion(request_id).finish_reason is None:
                self.step()
                piece = self.stream_text(request_id)
                if piece:
                    yield piece
            piece = self.stream_text(request_id)
            if piece:
                yield piece
        finally:
            if self.completion(request_id).finish_reason is None:
                self.abort_request(request_id)
            done = self.release(request_id)
        if done.error is not None:
            raise InvalidLogitsError(done.error)

    def generate(self, prompts: str | Seq[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts together through the continuous-batching loop until all finish."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise TinyInferError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, per_prompt):
                ids.append(self.add_request(prompt, sp))
        except TinyInferError:
            for request_id in ids:  # all or nothing: a bad prompt queues none of the batch
                self.abort_request(request_id)
                self.release(request_id)
            raise
        # (each request's Sequence, not completion(), which copies its tokens and text each step)
        while any(self._requests[i].seq.finish_reason is None for i in ids):
            self.step()
        done = [self.release(i) for i in ids]
        failed = [c.error for c in done if c.error is not None]
        if failed:
            raise InvalidLogitsError(failed[0])
        return done


@dataclass
class LaunchedDrafts:
    """A step's guesses once the drafter has them under way (``drafted``: whether any
    sequence has some), and the guesses by ``result()``.

    Guesses the host knows (prompt lookup, sampled drafts, a drafter's ``fixed_guesses``) are in
    ``host``. Greedy guesses of a draft model are its rounds' argmaxes, still on the device
    while the rounds run: ``rows`` says where each sequence's lie in ``source.argmax``, so the
    verification can be fed them there (``feed``) and launched before the host reads them;
    ``result()`` waits for the rounds (also when the host knew the guesses: the step's draft
    time is the rounds')."""

    host: dict[int, Draft]  # seq_id -> guesses known on the host
    source: TokensFuture | None = None  # the draft model's greedy rounds
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # seq_id -> its guesses' rows of source.argmax
    _drafts: dict[int, Draft] | None = field(default=None, init=False, repr=False)  # result()'s

    @classmethod
    def known(cls, drafts: dict[int, Draft]) -> LaunchedDrafts:
        return cls(drafts)

    @property
    def drafted(self) -> bool:
        """Whether any sequence of the step has guesses."""
        return bool(self.host or self.rows)

    def result(self) -> dict[int, Draft]:
        """Every drafted sequence's guesses on the host (waits for the rounds, if any)."""
        if self._drafts is None:
            ids = self.source.host_argmax() if self.source is not None else None
            self._drafts = {**self.host, **{s: Draft(tuple(ids[r].tolist())) for s, r in self.rows.items()}}
        return self._drafts

    def placeholders(self) -> dict[int, Draft]:
        """Drafts to pack the verification with before the guesses are read: 0 for each guess
        that the verification is fed on the device."""
        return {**self.host, **{s: Draft((0,) * len(r)) for s, r in self.rows.items()}}

    def feed(self, batch: Batch, chunks: list[Chunk]) -> Feed | None:
        """The verification batch's guesses on the device, packed from ``placeholders`` over
        ``chunks`` in order (each sequence's guesses are its last tokens); None if there are none."""
        if not self.rows:
            return None
        fed = np.full(batch.num_tokens, -1, dtype=np.int64)
        for b, chunk in enumerate(chunks):
            rows = self.rows.get(chunk.seq.seq_id)
            if rows is not None:
                end = int(batch.query_starts[b + 1])
                fed[end - len(rows):end] = rows
        assert self.source is not None
        return Feed(self.source, fed)


class DraftRun:
    """The draft model's side of speculative decoding: its own KV pages, and its forward passes.

    Each round runs the draft model once over every sequence still guessing (its new tokens
    since the last round: at first the whole context, then one guess), and the drafter's rule
    turns each row of logits into the next guess. Plainly greedy rounds go to the runner at
    once (``launch_rounds``: every round's positions and slots are known ahead, only its tokens
    come from the round before), so that on a GPU a step's k rounds are one CUDA graph replay,
    and their argmaxes, left on the device, feed the verification launched behind them.
    """

    def __init__(self, drafter: DraftModelDrafter, num_pages: int, page_size: int):
        self.drafter = drafter
        self.runner = drafter.model.runner
        self.pool = PagePool(num_pages, page_size, enable_prefix_caching=False)
        self.kv_cache = self.runner.new_kv_cache(num_pages, page_size)
        self.computed: dict[int, int] = {}  # seq_id -> tokens whose K/V the draft holds
        self.ahead: DraftAhead | None = None  # the next step's rounds, launched (launch_after)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> LaunchedDrafts:
        """Up to ks[i] guesses per sequence: k draft-model rounds, batched over sequences
        (plainly greedy ones launched, not waited for)."""
        active = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0 and self._reserve(seq, k)]
        rounds = max((ks[i] for i in active), default=0)
        # Plainly greedy sequences need only each round's argmax, and their verification no q.
        if all(is_plain_greedy(seqs[i].params, len(seqs[i].output_ids), 1) for i in active):
            return self._propose_greedy(seqs, ks, active, rounds)
        tokens = {i: [] for i in active}
        probs: dict[int, list[np.ndarray]] = {i: [] for i in active}
        for r in range(rounds):
            live = [i for i in active if ks[i] > r]
            batch, last_rows = self._catch_up(seqs, live, tokens, rounds)
            logits = self.runner.forward(batch, self.kv_cache)
            for i in live:
                token, q = self.drafter.guess(seqs[i], tokens[i], logits[last_rows[i]])
                tokens[i].append(token)
                probs[i].append(q)
        return LaunchedDrafts.known({seqs[i].seq_id: Draft(tuple(tokens[i]), tuple(probs[i]))
                                     for i in active})

    def _catch_up(self, seqs: list[Sequence], live: list[int], tokens: dict[int, list[int]],
                  rounds: int) -> tuple[Batch, dict[int, int]]:
        """A round over every token the draft has not seen of each live sequence (its context,
        then its guesses), and the row whose logits give each sequence's next guess."""
        feeds, last_rows, rows = [], {}, 0
        for i in live:
            seq, history = seqs[i], seqs[i].all_ids + tokens[i]
            start = self.computed[seq.seq_id]
            # A catch-up of a few tokens (the last guess and the target's bonus token) asks
            # for every row's logits, as a decode step does, so the runner can replay a
            # CUDA graph; a long one (the prompt) only for its last row.
            every_row = len(history) - start <= rounds + 1
            feeds.append((history[start:], start, self.pool.pages(seq.seq_id), every_row))
            rows += len(history) - start if every_row else 1
            last_rows[i] = rows - 1
            self.computed[seq.seq_id] = len(history)
        return make_batch(feeds, self.pool.page_size), last_rows

    def _propose_greedy(self, seqs: list[Sequence], ks: list[int], active: list[int],
                        rounds: int) -> LaunchedDrafts:
        """The greedy rounds in one launch (``launch_rounds``): the catch-up, then rounds - 1
        rounds whose input is each sequence's argmax of the round before, fed on the device (a
        CUDA graph replays them all at once on the torch runner), so the host stages every
        round's positions and slots ahead (one more a round) and no logits row reaches the host.
        Nothing is waited for: the guesses are the rounds' argmaxes where they lie, rows
        b * rounds + r of the launch's argmax, unless the drafter fixes them on the host while
        the rounds run (``fixed_guesses``: the benchmark's oracle); the draft model is fed its
        own argmaxes."""
        if not active:
            return LaunchedDrafts.known({})
        batch, _ = self._catch_up(seqs, active, {i: [] for i in active}, rounds)
        positions = np.full((rounds - 1, len(active)), -1, dtype=np.int64)  # [n, B]; -1: sits out
        slots = positions.copy()
        for row, i in enumerate(active):
            positions[:ks[i] - 1, row] = [self._advance(seqs[i]) for _ in range(ks[i] - 1)]
            slots[:, row] = self.pool.slots(seqs[i].seq_id, positions[:, row])
        future = self.runner.launch_rounds(batch, self.kv_cache, Rounds(positions, slots))
        fixed = self.drafter.fixed_guesses([seqs[i] for i in active], [ks[i] for i in active])  # while they run
        if fixed is not None:
            host = {seqs[i].seq_id: Draft(tuple(own)) for i, own in zip(active, fixed)}
            return LaunchedDrafts(host, future)
        rows = {seqs[i].seq_id: row * rounds + np.arange(ks[i]) for row, i in enumerate(active)}
        return LaunchedDrafts({}, future, rows)

    def launch_after(self, seqs: list[Sequence], guesses: list[tuple[int, ...]], rows: list[slice],
                     verification: TopFuture, ks: list[list[int]]) -> None:
        """Launch the next step's catch-up and greedy rounds now, behind the verification of
        ``guesses`` (its rows ``rows`` of each sequence), before the host reads it: the runner
        picks each sequence's inputs by the guesses it keeps (``AfterVerification``); ks[i][a]
        guesses for sequence i where it keeps a (its lookahead then, at least 1 for a = 0; at
        0 its step still computes the target's token, and no round).

        A sequence that keeps a of its g guesses (the draft computed the first g - 1 in its
        rounds) catches up on its a-th guess (only where a = g: the draft never computed the
        last one) and the target's token after it, at positions L + a - 1 and L + a (L: the
        first guess's position), then runs k - 1 rounds from L + a + 1 (k = ks[i][a]) and sits
        out the rest of the ks[i][0] - 1 rounds the launch runs. Pages are reserved for the
        most it may take; where the pool cannot, nothing is launched. The caller plans: the
        next step runs these sequences, each drafting what its lookahead allows after what it
        keeps (``adopt``)."""
        if not all(self._reserve(seq, len(g) + max(k)) for seq, g, k in zip(seqs, guesses, ks)):
            return
        width, most = max(len(g) for g in guesses), max(k[0] for k in ks)
        verified = np.full((len(seqs), width + 1), -1, dtype=np.int64)
        checked = np.full((len(seqs), width), -1, dtype=np.int64)
        positions = np.full((len(seqs), width + 1, 2 + most - 1), -1, dtype=np.int64)  # -1: sits out
        slots = positions.copy()
        for b, (seq, g, r, k) in enumerate(zip(seqs, guesses, rows, ks)):
            verified[b, :len(g) + 1] = np.arange(r.start, r.start + len(g) + 1)
            checked[b, :len(g)] = g
            # keeping a guesses: positions L + a - 1 (the a-th guess; only where a = g) .. L + a + k[a] - 1
            at = seq.num_tokens + np.arange(len(g) + 1)[:, None] + np.arange(-1, k[0])[None, :]  # [g + 1, k[0] + 1]
            at[:len(g), 0] = -1  # the draft computed the a-th guess in its rounds where a < g
            at[np.arange(k[0] + 1)[None, :] > np.maximum(np.asarray(k), 1)[:, None]] = -1  # past its lookahead
            positions[b, :len(g) + 1, :k[0] + 1] = at
            slots[b, :len(g) + 1, :k[0] + 1] = self.pool.slots(seq.seq_id, at)
        after = AfterVerification(verification, verified, checked, positions, slots,
                                  tuple(tuple(self.pool.pages(s.seq_id)) for s in seqs), q=2)
        future = self.runner.launch_rounds_after(self.kv_cache, after)
        self.ahead = DraftAhead({s.seq_id: (len(s.output_ids), tuple(k)) for s, k in zip(seqs, ks)}, most, future)

    def adopt(self, seqs: list[Sequence], ks: list[int]) -> LaunchedDrafts | None:
        """The rounds ``launch_after`` launched, as this step's guesses, if every sequence that
        drafts now (lookahead ``ks`` above 0) had rounds launched (they computed its lookahead's
        worth after what it kept); else None, and they are forgotten. Rounds of sequences that
        do not draft now (ended, preempted, or out of lookahead) are forgotten alone."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        drafting = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        if not drafting or any(ahead.guesses(s) < k for s, k in drafting):
            self._forget(ahead.ks)
            return None
        self._forget(ahead.ks.keys() - {s.seq_id for s, _ in drafting})
        order = {seq_id: b for b, seq_id in enumerate(ahead.ks)}  # rows of the launch's argmax
        for seq, k in drafting:  # the catch-up computed up to the target's token (``rollback``), then k - 1 rounds
            self.computed[seq.seq_id] += k - 1
        chosen = [s for s, _ in drafting]
        fixed = self.drafter.fixed_guesses(chosen, [k for _, k in drafting])
        if fixed is not None:
            return LaunchedDrafts({s.seq_id: Draft(tuple(own)) for s, own in zip(chosen, fixed)}, ahead.future)
        rows = {s.seq_id: order[s.seq_id] * ahead.width + np.arange(k) for s, k in drafting}
        return LaunchedDrafts({}, ahead.future, rows)

    def _forget(self, seq_ids: Iterable[int]) -> None:
        """Rounds launched for sequences ``seq_ids`` that the step after does not take: each
        one's catch-up computed its last token, which its next one computes again (a catch-up
        needs a token to start from)."""
        for seq_id in seq_ids:
            if seq_id in self.computed:
                self.computed[seq_id] -= 1

    def _advance(self, seq: Sequence) -> int:
        """One more of the sequence's tokens goes to the draft: the position it takes."""
        start = self.computed[seq.seq_id]
        self.computed[seq.seq_id] = start + 1
        return start

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Make room in the draft's pool for the sequence plus k guesses; False if it cannot."""
        if seq.seq_id not in self.computed:
            self.pool.add_sequence(seq.seq_id, seq.all_ids)
            self.computed[seq.seq_id] = 0
        needed = self.pool.pages_needed(seq.seq_id, seq.num_tokens + k)
        if not self.pool.can_allocate(needed):
            return False
        self.pool.ensure_capacity(seq.seq_id, seq.num_tokens + k)
        return True

    def rollback(self, seq: Sequence) -> None:
        """Forget the draft's K/V beyond what the target accepted (seq.num_computed); where the
        next rounds were launched behind the verification, the draft holds K/V up to the
        target's new token (its rounds computed the kept guesses, the launched step the last
        of them where all were kept, and the target's token), and the rounds' pages stay.
        (Pages freed here or by ``release`` may still be written by rounds queued on the
        device: whoever gets them next writes later in the same stream.)"""
        if seq.seq_id in self.computed:
            if self.ahead is not None and seq.seq_id in self.ahead.ks:
                self.computed[seq.seq_id] = seq.num_tokens
                most = self.ahead.ks[seq.seq_id][1][0]  # guesses where it keeps none: the most
                self.pool.truncate(seq.seq_id, seq.num_tokens + most - 1)  # the rounds' pages stay
                return
            keep = min(self.computed[seq.seq_id], seq.num_computed)
            self.computed[seq.seq_id] = keep
            self.pool.truncate(seq.seq_id, keep)

    def release(self, seq: Sequence) -> None:
        """The sequence is gone: free its draft pages."""
        if self.computed.pop(seq.seq_id, None) is not None:
            self.pool.free(seq.seq_id)


@dataclass(frozen=True)
class DraftAhead:
    """A draft model's next rounds, launched behind the verification they follow
    (``DraftRun.launch_after``): for which sequences, how many guesses each, and their future
    (sequence b's guesses at rows b * width + r of its argmax)."""

    ks: dict[int, tuple[int, tuple[int, ...]]]  # seq_id -> (its output's length then, guesses per
    #   accepted count a = 0, 1, ...), in the launch's order
    width: int  # guesses a sequence's row of the future's argmax holds (the most launched)
    future: TokensFuture

    def guesses(self, seq: Sequence) -> int:
        """How many guesses the rounds launched for ``seq`` computed, given what it kept since
        (0: none were launched for it)."""
        if seq.seq_id not in self.ks:
            return 0
        before, per_count = self.ks[seq.seq_id]
        kept = len(seq.output_ids) - before - 1  # the target's token after them
        return per_count[kept] if 0 <= kept < len(per_count) else 0


@dataclass
class _Launched:
    """A step queued on the runner (future None: planned, but the runner refused to start it)."""

    out: SchedulerOutput
    future: TopFuture | None
    t0: float  # planning began
    t1: float  # planned
    t2: float  # launched


class OverlapSteps:
    """Asynchronous scheduling: the engine's step loop with one step launched ahead, so that the
    host prepares step N+1 while the device runs step N.

        step() ─▶ plan N+1 (one more slot per decoding sequence) ─▶ launch N+1, its input
                  tokens taken on the device from N's argmax ─▶ wait for N ─▶ stop rules,
                  text, trace of N

    A decode step's only input the host cannot know ahead is the token the step before chose;
    for plain greedy rows the runner keeps that token where it computed it and feeds it to the
    next launch (a ``Feed``), so the host reads step N's results while N+1 runs. Positions,
    slots and page tables are known ahead: a decoding sequence needs exactly one more slot.

    Only a continuation overlaps: every running sequence computed in step N, reached its end,
    and decodes one more plain greedy token; nobody waits for a free seat; the pool has the
    pages. Anything else (a prompt still prefilling, sampling, an admission, a preemption)
    drains the pipeline: step N finishes and the next ``step()`` runs as the step-through
    engine does. A sequence that ends at step N (end token, stop string, abort) still has a row
    in N+1: it is computed, dropped and never emitted; its pages were freed with the sequence.
    A sequence certain to end at N (max_tokens, the context) gets no row.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ahead: _Launched | None = None

    def step(self) -> StepTrace:
        """Launch the next step if it can overlap, then finish the one before and trace it."""
        eng = self.engine
        current, self.ahead = self.ahead, None
        if current is not None and not _live(current.out.chunks):
            current = None  # every row ended (aborts) while it ran: nothing to report
        if current is None:
            t0 = time.perf_counter()
            out = eng.scheduler.schedule()
            t1 = time.perf_counter()
            if not eng._greedy_only(out.chunks):
                return eng._run(out, t0, t1)
            try:
                current = _Launched(out, eng._launch_top(eng._pack(out.chunks, {})[0], out.chunks), t0, t1,
                                    time.perf_counter())
            except InvalidLogitsError:  # a runner that computes at once met a bad row
                return eng._run(out, t0, t1)
        if current.future is not None:
            self.ahead = self._launch_next(current)
        return self._finish(current)

    def _launch_next(self, current: _Launched) -> _Launched | None:
        """Plan and launch the continuation of ``current``; None where it must drain."""
        t0 = time.perf_counter()
        planned = self._plan(current.out.chunks)
        if planned is None:
            return None
        out, rows = planned
        eng = self.engine
        t1 = time.perf_counter()
        # Placeholder tokens: the Feed puts current's argmax in their place on the runner's side.
        batch = make_batch([([0], c.start, eng.pool.pages(c.seq.seq_id), False) for c in out.chunks],
                           eng.pool.page_size)
        assert current.future is not None
        try:
            future: TopFuture | None = eng._launch_top(batch, out.chunks, Feed(current.future, rows))
        except InvalidLogitsError:  # computed at once and met a bad row: run it after current
            future = None
        return _Launched(out, future, t0, t1, time.perf_counter())

    def _plan(self, chunks: list[Chunk]) -> tuple[SchedulerOutput, np.ndarray] | None:
        """The step after ``chunks`` if it is a plain continuation: one decode token for each
        running sequence not certain to end now, pages allocated for it; and the rows of
        ``chunks`` whose argmax feeds each. None where the scheduler might choose otherwise."""
        eng = self.engine
        scheduler, pool = eng.scheduler, eng.pool
        live = [c for c in chunks if c.seq.finish_reason is None]
        if not scheduler.runs_exactly([c.seq for c in live]):
            return None  # someone else is running (admitted, or skipped for lack of budget)
        if any(not c.samples for c in live):
            return None  # a prompt still prefilling
        config = scheduler.config
        if (scheduler.waiting and config.batching == "continuous"
                and len(live) < config.max_num_seqs):
            return None  # a waiting request may take a seat: the scheduler decides
        limit = eng.model.config.max_model_len
        nxt, rows = [], []
        for row, c in enumerate(chunks):
            seq = c.seq
            if seq.finish_reason is not None:
                continue
            if len(seq.output_ids) + 1 >= seq.params.max_tokens or c.end + 1 >= limit:
                continue  # ends by length at this step
            nxt.append(Chunk(seq, c.end, c.end + 1, "decode"))
            rows.append(row)
        if not nxt or len(nxt) > config.max_num_batched_tokens or not eng._greedy_only(nxt):
            return None
        needed = sum(pool.pages_needed(c.seq.seq_id, c.end) for c in nxt)
        if not pool.can_allocate(needed):
            return None  # the scheduler would preempt
        allocated = [page for c in nxt for page in pool.ensure_capacity(c.seq.seq_id, c.end)]
        return SchedulerOutput(nxt, [], [], allocated, []), np.asarray(rows, dtype=np.int64)

    def _finish(self, launched: _Launched) -> StepTrace:
        """Wait for a launched step, then choose, check stops and trace its live rows."""
        eng = self.engine
        live = [i for i, c in enumerate(launched.out.chunks) if c.seq.finish_reason is None]
        out = dataclasses.replace(launched.out, chunks=[launched.out.chunks[i] for i in live])
        if launched.future is None:
            return eng._run(out, launched.t0, launched.t1)
        top = launched.future.result()
        t3 = time.perf_counter()
        rows = np.asarray(live, dtype=np.int64)
        steps, freed = eng._greedy_advance(out.chunks, TopLogits(top.ids[rows], top.values[rows],
                                                                 top.logsumexp[rows]),
                                           [slice(i, i + 1) for i in range(len(rows))], {})
        return eng._finish_step(out, steps, freed, launched.t0, launched.t1, launched.t2, t3,
                                launched.future.device_seconds)


def _live(chunks: list[Chunk]) -> bool:
    return any(c.seq.finish_reason is None for c in chunks)


def _invalid_row() -> TokenChoice:
    raise InvalidLogitsError("logits contain NaN or +inf; the model produced invalid output")


def _check_drafter(model: Model, drafter: Drafter, num_draft: int) -> None:
    if not 1 <= num_draft <= 16:
        raise TinyInferError(f"num_draft must be between 1 and 16, got {num_draft}")
    if isinstance(drafter, DraftModelDrafter) and drafter.model.config.vocab_size != model.config.vocab_size:
        raise TinyInferError(
            f"the draft model's vocabulary ({drafter.model.config.vocab_size}) differs from the "
            f"target's ({model.config.vocab_size}): they must share a tokenizer"
        )
