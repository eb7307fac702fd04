"""Frames: what the screen shows after each event, folded from step traces and user actions.

A frame is immutable. The TUI keeps every frame of a run in order, so stepping back is only
moving a cursor, and a recorded trace replays into the same frames without a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tinyinfer.trace import PoolView, RequestStart, SeqStep, StepTrace


@dataclass(frozen=True)
class Token:
    """One token as drawn: its id and its text."""

    token_id: int
    text: str


@dataclass(frozen=True)
class SeqView:
    """One request as the panels see it after a frame."""

    request_id: str
    seq_id: int | None  # known once a step has scheduled it
    prompt: tuple[Token, ...]  # empty when unknown (a trace recorded without them)
    prompt_len: int | None = None
    output: tuple[Token, ...] = ()
    state: str = "waiting"  # waiting, running or finished
    finish_reason: str | None = None
    computed: int = 0  # positions whose K/V are in the cache
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at its latest admission
    preemptions: int = 0
    arrival_step: int = 0  # engine steps done before it arrived
    first_token_step: int | None = None  # the engine step that sampled its first token
    samples: tuple[SeqStep, ...] = ()  # every step part that sampled a token for it

    @property
    def label(self) -> str:
        return f"seq {self.seq_id}" if self.seq_id is not None else self.request_id

    @property
    def last_sample(self) -> SeqStep | None:
        return self.samples[-1] if self.samples else None


@dataclass(frozen=True)
class Frame:
    """Everything on screen after one event: a step, or a request added or aborted."""

    index: int
    event: str  # "start", "step", "add" or "abort"
    note: str  # what happened, in words, for actions
    seqs: tuple[SeqView, ...]  # in arrival order
    traces: tuple[StepTrace, ...]  # every engine step so far
    pool: PoolView | None
    texts: dict[int, str] = dataclasses.field(default_factory=dict)  # token id -> text, as known

    def text(self, token_id: int) -> str | None:
        return self.texts.get(token_id)

    @property
    def trace(self) -> StepTrace | None:
        """The step this frame shows, if it is a step frame."""
        return self.traces[-1] if self.event == "step" else None

    @property
    def steps_done(self) -> int:
        return len(self.traces)

    def seq(self, seq_id: int) -> SeqView | None:
        return next((s for s in self.seqs if s.seq_id == seq_id), None)

    def request(self, request_id: str) -> SeqView | None:
        return next((s for s in self.seqs if s.request_id == request_id), None)

    @property
    def unfinished(self) -> tuple[SeqView, ...]:
        return tuple(s for s in self.seqs if s.state != "finished")

    def focus(self, seq_id: int | None) -> SeqView | None:
        """The sequence detail panels follow: the chosen one, else the first that just sampled."""
        chosen = self.seq(seq_id) if seq_id is not None else None
        if chosen is not None:
            return chosen
        sampled = [p.seq_id for p in (self.trace.seqs if self.trace else ()) if p.token_id is not None]
        running = [s for s in self.seqs if s.state == "running"]
        if sampled:
            return self.seq(sampled[0])
        return (running or list(self.seqs) or [None])[0]


def start_frame(seqs: tuple[SeqView, ...], pool: PoolView | None) -> Frame:
    return Frame(0, "start", "", seqs, (), pool)


def emitted(part: SeqStep) -> tuple[int, ...]:
    """Tokens a step part added to the output: one, or several when it verified a draft."""
    if part.emitted:
        return part.emitted
    return () if part.token_id is None else (part.token_id,)


def _known_texts(frame: Frame, trace: StepTrace) -> dict[int, str]:
    """Token texts after a step: what earlier frames knew and what this trace describes."""
    texts = dict(frame.texts)
    for part in trace.seqs:
        texts.update((c.token_id, c.text) for c in part.candidates)
    texts.update(trace.token_texts)
    return texts


def arrived(request: RequestStart, texts: dict[int, str], arrival_step: int) -> SeqView:
    """A request as a trace announces it: waiting, with its prompt's tokens."""
    prompt = tuple(Token(t, texts.get(t, f"#{t}")) for t in request.prompt_ids)
    return SeqView(request.request_id, None, prompt, prompt_len=len(prompt), arrival_step=arrival_step)


def after_step(frame: Frame, trace: StepTrace) -> Frame:
    """Fold one engine step (and the requests queued just before it) into a new frame."""
    texts = _known_texts(frame, trace)
    seqs = {s.request_id: s for s in frame.seqs}
    new = [r for r in trace.requests if r.request_id not in seqs]
    for r in new:
        seqs[r.request_id] = arrived(r, texts, frame.steps_done)
    step_no = frame.steps_done + 1
    for seq_id in trace.preempted:
        rid = next(r for r, s in seqs.items() if s.seq_id == seq_id)
        s = seqs[rid]
        seqs[rid] = dataclasses.replace(s, state="waiting", computed=0, preemptions=s.preemptions + 1)
    for part in trace.seqs:
        s = seqs.get(part.request_id) or SeqView(part.request_id, part.seq_id, (),
                                                  arrival_step=frame.steps_done)
        rejected = len(part.draft_tokens) - part.accepted  # guesses whose K/V was rolled back
        changes: dict = dict(seq_id=part.seq_id, state="running", computed=part.end - rejected)
        if part.seq_id in trace.admitted:
            changes["cached_tokens"] = part.cached_tokens
        if part.token_id is not None:
            ids = emitted(part)
            fallback = (lambda t: part.token_text) if len(ids) == 1 else (lambda t: f"#{t}")
            tokens = tuple(Token(t, texts.get(t) or fallback(t)) for t in ids)
            changes.update(output=s.output + tokens, samples=s.samples + (part,),
                           first_token_step=s.first_token_step or step_no,
                           prompt_len=s.prompt_len or part.end - len(s.output))
        if part.finish_reason is not None:
            changes.update(state="finished", finish_reason=part.finish_reason)
        seqs[part.request_id] = dataclasses.replace(s, **changes)
    note = ", ".join(f"{r.request_id} arrived" for r in new)
    return Frame(frame.index + 1, "step", note, tuple(seqs.values()), frame.traces + (trace,),
                 trace.pool, texts)


def after_add(frame: Frame, seq: SeqView, pool: PoolView) -> Frame:
    """A request was queued between steps."""
    return Frame(frame.index + 1, "add", f"{seq.request_id} added ({len(seq.prompt)} prompt tokens)",
                 frame.seqs + (seq,), frame.traces, pool, frame.texts)


def after_abort(frame: Frame, request_id: str, pool: PoolView) -> Frame:
    """A request was aborted between steps; its pages are back in the pool."""
    seqs = tuple(dataclasses.replace(s, state="finished", finish_reason="abort")
                 if s.request_id == request_id else s for s in frame.seqs)
    label = next(s.label for s in frame.seqs if s.request_id == request_id)
    return Frame(frame.index + 1, "abort", f"{label} aborted: its pages are free",
                 seqs, frame.traces, pool, frame.texts)


def replay_frames(traces: list[StepTrace]) -> list[Frame]:
    """Frames of a recorded run: requests appear as the trace announces them (a trace recorded
    without announcements: when it first schedules them)."""
    first = traces[0] if traces else None
    texts = dict(first.token_texts) if first else {}
    seqs = tuple(arrived(r, texts, 0) for r in first.requests) if first else ()
    pool = first.pool if first else None
    if pool is not None:  # as it was before the first step: every page free
        pool = dataclasses.replace(pool, used=0, free=pool.num_pages, cached=0, cached_pages=(),
                                   prefix_hits=0, prefix_queries=0,
                                   owners=((),) * pool.num_pages)
    frames = [start_frame(seqs, pool)]
    for trace in traces:
        frames.append(after_step(frames[-1], trace))
    return frames
