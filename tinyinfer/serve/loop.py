"""One engine loop for every connection: a thread that owns the engine, fed through a queue.

The engine is synchronous and not thread-safe, so exactly one thread touches it. HTTP
handlers (on the asyncio loop) submit a `Job` — one or more sequences — and read its
`Delta` events from an asyncio queue. Between two steps the thread admits new jobs and
aborts cancelled ones, which is continuous batching seen from the server:

    handler ──submit──▶ commands ──▶ engine thread: add / abort, step(), stream_text
       ▲                                                        │
       └──────────── job.events (call_soon_threadsafe) ◀─────────┘
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from tinyinfer.engine import Completion, Engine
from tinyinfer.errors import TinyInferError
from tinyinfer.sampling import SamplingParams
from tinyinfer.serve.metrics import EngineStats, Metrics
from tinyinfer.serve.schemas import APIError, engine_error
from tinyinfer.trace import SeqStep

log = logging.getLogger("tinyinfer.serve.server")

_STOP = object()


@dataclass(frozen=True)
class Usage:
    """What one sequence cost, in OpenAI's terms."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Delta:
    """One sampled token of one choice: its text (possibly empty) and, at the end, its usage."""

    index: int  # choice index within the job
    text: str  # new text since the previous delta (stop-string prefixes are held back)
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    finish_reason: str | None = None
    usage: Usage | None = None  # set on the last delta of a choice


@dataclass(frozen=True)
class Failure:
    """The job ended without finishing: the server is shutting down or the engine failed."""

    error: APIError


class Job:
    """A request's sequences as the handler sees them: acceptance, then a stream of events."""

    _ids = itertools.count()

    def __init__(self, entries: Sequence[tuple[list[int], SamplingParams]], n: int,
                 loop: asyncio.AbstractEventLoop, input_field: str | None = None) -> None:
        self.id = f"job{next(self._ids)}"
        self.entries = list(entries)  # prompt by prompt, n choices each
        self.n = n
        self.input_field = input_field  # prompt or messages: what a refused input names
        self.arrival = time.perf_counter()
        self._loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.events: asyncio.Queue[Delta | Failure] = asyncio.Queue()

    def _call(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def accept(self) -> None:
        self._call(_resolve, self.accepted, None)

    def reject(self, error: APIError) -> None:
        self._call(_resolve, self.accepted, error)

    def put(self, event: Delta | Failure) -> None:
        self._call(self.events.put_nowait, event)


def _put_all(items: list[tuple[asyncio.Queue[Delta | Failure], Delta]]) -> None:
    for events, delta in items:
        events.put_nowait(delta)


def deliver(events: list[tuple[Job, Delta]]) -> None:
    """Hand one step's deltas to their jobs: one wake-up of each event loop, not one per token."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Delta | Failure], Delta]]] = {}
    for job, delta in events:
        by_loop.setdefault(job._loop, []).append((job.events, delta))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop has closed: nobody is listening any more
            pass


def _resolve(future: asyncio.Future[None], error: APIError | None) -> None:
    if future.done():  # the handler stopped waiting (timeout or disconnect)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _internal_error() -> APIError:
    return APIError(500, "the engine failed while running this request; see the server log",
                    type="server_error")


def _shutdown_error() -> APIError:
    return APIError(503, "the server shut down before this request finished; send it again "
                         "(to this server once it is back, or to another)",
                    type="server_error", code="shutting_down", headers={"Retry-After": "5"})


class EngineLoop:
    """Runs `engine.step()` in its own thread while any request is unfinished."""

    def __init__(self, engine: Engine, metrics: Metrics, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        # Sequences that may be in flight at once: the running batch plus the queue.
        self.capacity = engine.scheduler.config.max_num_seqs + max_queue
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._reserved = 0  # sequences submitted and not yet finished or aborted
        self._closing = False
        self._owners: dict[str, tuple[Job, int]] = {}  # engine request id → (job, choice index)
        # Leader request id → (job, choice indexes that wait for the leader's prompt pages).
        self._siblings: dict[str, tuple[Job, list[int]]] = {}
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- handler side

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._run, name="tinyinfer-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new jobs, abort the unfinished ones, and end the thread."""
        with self._lock:
            self._closing = True
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join()

    def expire(self) -> None:
        """The shutdown's grace period is over: refuse new jobs and end every unfinished one
        with a 503 (its handler answers it: an error event and [DONE], or a JSON error)."""
        with self._lock:
            self._closing = True
        self._commands.put(("expire", None))

    def check_room(self, sequences: int) -> None:
        """Refuse at once (400, 503 or 429) what submit would refuse now: the cheap check a
        handler makes before tokenizing anything."""
        with self._lock:
            self._check_room(sequences)

    def _check_room(self, sequences: int) -> None:
        if sequences > self.capacity:
            raise APIError(400, f"this request asks for {sequences} sequences (prompts x n) but "
                                f"the server holds at most {self.capacity}; send fewer", param="n")
        if self._closing:
            raise APIError(503, "the server is shutting down; retry against another instance",
                           type="server_error", code="shutting_down", headers={"Retry-After": "5"})
        if self._reserved + sequences > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.capacity} sequences "
                                "running or queued); retry after a moment",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})

    def submit(self, entries: Sequence[tuple[list[int], SamplingParams]], n: int,
               loop: asyncio.AbstractEventLoop, input_field: str | None = None) -> Job:
        """Queue a job, or refuse it at once when the server is full or closing (``input_field``:
        the request's field for the input, which an error about it names)."""
        with self._lock:
            self._check_room(len(entries))
            self._reserved += len(entries)
            job = Job(entries, n, loop, input_field)
            # Inside the lock: every accepted add is queued before stop() queues _STOP.
            self._commands.put(("add", job))
        return job

    def cancel(self, job: Job) -> None:
        """Abort whatever of the job is still running (client gone or timed out)."""
        self._commands.put(("cancel", job))

    # ---------------------------------------------------------------- engine thread

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and takes new jobs."""
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def _run(self) -> None:
        try:
            while self._handle_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except Exception:  # noqa: BLE001 - a bug here must fail requests, never hang them
            log.exception("the engine loop failed; refusing new requests")
        finally:
            with self._lock:
                self._closing = True
            self._shut_down()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds and cancels (waiting for one when idle); False once told to stop."""
        try:
            command = self._commands.get(block=block)
            while True:
                if command is _STOP:
                    return False
                kind, job = command  # type: ignore[misc]
                if kind == "add":
                    self._add(job)
                elif kind == "cancel":
                    self._abort(job)
                else:  # "expire": the grace period of a shutdown is over
                    self._fail_all(_shutdown_error())
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _add(self, job: Job) -> None:
        """Add a job's sequences, or none of them.

        Choices 1..n-1 of a prompt at least one page long wait until choice 0 has computed
        the prompt: admitted then, they find its pages in the prefix cache instead of
        computing the same prompt n times (siblings admitted in one step could not share).
        """
        later = {leader: list(range(leader + 1, leader + job.n))
                 for leader in range(0, len(job.entries), job.n)
                 if job.n > 1 and len(job.entries[leader][0]) >= self.engine.pool.page_size}
        waiting = {i for siblings in later.values() for i in siblings}
        added: list[str] = []
        try:
            for index in range(len(job.entries)):
                if index not in waiting:
                    added.append(self._add_one(job, index))
        except Exception as exc:  # noqa: BLE001 - a refused job must never stop the loop
            for request_id in added:
                self._drop(request_id)
            self._unreserve(len(job.entries) - len(added))
            if isinstance(exc, TinyInferError):
                job.reject(engine_error(exc, job.input_field))
            else:
                log.exception("adding %s failed", job.id)
                job.reject(_internal_error())
            return
        for leader, siblings in later.items():
            self._siblings[f"{job.id}-{leader}"] = (job, siblings)
        self.metrics.add_tokens(prompt=sum(len(p) for p, _ in job.entries))
        job.accept()

    def _add_one(self, job: Job, index: int) -> str:
        prompt, params = job.entries[index]
        request_id = self.engine.add_request(prompt, params, f"{job.id}-{index}")
        self._owners[request_id] = (job, index)
        return request_id

    def _abort(self, job: Job) -> None:
        for leader in [r for r, (j, _) in self._siblings.items() if j is job]:
            self._unreserve(len(self._siblings.pop(leader)[1]))
        for request_id in [r for r, (j, _) in self._owners.items() if j is job]:
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        """Abort a sequence, free its pages and forget it."""
        self.engine.abort_request(request_id)
        self._finish(request_id, self.engine.release(request_id))

    def _finish(self, request_id: str, completion: Completion) -> Usage:
        job, _ = self._owners.pop(request_id)
        self._unreserve(1)
        m = completion.metrics
        ttft = tpot = None
        if m is not None and m.first_token is not None:
            ttft = m.first_token - job.arrival
            if len(completion.token_ids) > 1 and m.finished is not None:
                tpot = (m.finished - m.first_token) / (len(completion.token_ids) - 1)
        self.metrics.observe_sequence(completion.finish_reason or "abort", ttft, tpot,
                                      time.perf_counter() - job.arrival)
        return Usage(len(completion.prompt_ids), len(completion.token_ids),
                     m.cached_tokens if m is not None else 0)

    def _unreserve(self, count: int) -> None:
        with self._lock:
            self._reserved -= count

    def _step(self) -> None:
        try:
            trace = self.engine.step()
            # The engine's guard ended these sequences alone ("error"); their jobs fail whole.
            failed = {self._owners[s.request_id][0]: s.request_id
                      for s in trace.seqs if s.finish_reason == "error"}
            events = [(job, self._delta(s)) for s in trace.seqs if s.token_id is not None
                      and (job := self._owners[s.request_id][0]) not in failed]
            for job, request_id in failed.items():
                message = self.engine.completion(request_id).error or "the request failed"
                log.warning("%s", message)
                self._abort(job)
                job.put(Failure(APIError(500, message, type="server_error")))
        except Exception:  # noqa: BLE001 - fail the running jobs, keep serving the next ones
            log.exception("engine step failed")
            self._fail_all(_internal_error())
            return
        self.metrics.add_tokens(generated=len(events))
        self._publish()  # before the events, so a client that saw its end sees the pages freed
        deliver(events)

    def _delta(self, step: SeqStep) -> Delta:
        """The event for one sampled token; releases the sequence if it just finished."""
        request_id = step.request_id
        job, index = self._owners[request_id]
        text = self.engine.stream_text(request_id)
        top = ()
        if job.entries[index][1].logprobs:
            top = self.engine.completion(request_id).top_logprobs[-1]
        usage = None
        if step.finish_reason is not None:
            usage = self._finish(request_id, self.engine.release(request_id))
        if request_id in self._siblings:  # its prompt is computed and cached: admit the others
            for sibling in self._siblings.pop(request_id)[1]:
                self._add_one(job, sibling)
        return Delta(index, text, step.token_id, step.logprob, top,  # type: ignore[arg-type]
                     step.finish_reason, usage)

    def _fail_all(self, error: APIError) -> None:
        jobs = {id(job): job for job, _ in (*self._owners.values(), *self._siblings.values())}
        for _, siblings in self._siblings.values():
            self._unreserve(len(siblings))
        self._siblings.clear()
        for request_id in list(self._owners):
            try:
                self._drop(request_id)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("aborting %s failed", request_id)
                self._owners.pop(request_id, None)
        for job in jobs.values():
            job.put(Failure(error))

    def _shut_down(self) -> None:
        """Abort what still runs and refuse what was queued but never added."""
        error = _shutdown_error()
        self._fail_all(error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not _STOP and command[0] == "add":  # type: ignore[index]
                self._unreserve(len(command[1].entries))  # type: ignore[index]
                command[1].reject(error)  # type: ignore[index]
        self._publish()

    def _publish(self) -> None:
        pool = self.engine.pool
        self.stats = EngineStats(
            running=len(self.engine.scheduler.running), waiting=len(self.engine.scheduler.waiting),
            kv_pages_used=pool.num_used_pages, kv_pages_total=pool.num_pages,
            kv_pages_cached=pool.num_cached_pages, prefix_hit_tokens=pool.prefix_hits,
            prefix_queried_tokens=pool.prefix_queries, steps=self.engine.step_count)
