"""What happened in one engine step — the only thing front ends read.

Every record is a frozen dataclass of plain values, so a run can be written as JSON lines
and replayed without a model (the TUI steps backwards this way).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Iterable, Iterator

from tinyinfer.runners.runner import RankShare


@dataclass(frozen=True)
class Candidate:
    """One possible next token and its probability after sampling filters."""

    token_id: int
    prob: float
    text: str


@dataclass(frozen=True)
class SeqStep:
    """One sequence's part of a step: the positions computed and, if it ended, the token sampled."""

    seq_id: int
    request_id: str
    kind: str  # "prefill" (a prompt chunk, possibly the whole prompt) or "decode" (one token)
    start: int  # first position computed this step
    end: int  # one past the last position computed
    cached_tokens: int = 0  # prompt tokens skipped thanks to the prefix cache (on admission)
    token_ids: tuple[int, ...] = ()  # the ids at positions [start, end) fed to the model
    token_id: int | None = None  # the sampled token, if this chunk reached the end
    token_text: str = ""  # its text; at detail "none" only where the request has stop strings
    logprob: float | None = None
    token_prob: float | None = None  # its probability after the request's sampling filters
    candidates: tuple[Candidate, ...] = ()
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    # detail="full" only: raw logits of the most likely tokens (UIs re-apply sampling filters
    # live), and the last query's attention weights per layer and head (reference runner).
    # speculative decoding: guesses checked this step, how many survived, all tokens emitted
    draft_tokens: tuple[int, ...] = ()
    accepted: int = 0
    emitted: tuple[int, ...] = ()
    top_logits: tuple[tuple[int, float], ...] = ()
    # (T, log Σ exp(logit / T)) over every logit not in top_logits, at T = 0.1, 0.2, ... 2.0
    rest_logsumexp: tuple[tuple[float, float], ...] = ()
    attention: tuple[tuple[tuple[float, ...], ...], ...] = ()  # [layer][head][context]

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> SeqStep:
        """The record ``SeqStep(**values)`` makes, built for the engine's per-sequence loop:
        a frozen dataclass's __init__ sets its 19 fields one object.__setattr__ at a time
        (~2 µs per record), where filling the new record's __dict__ at once takes a third."""
        record = object.__new__(cls)
        filled = record.__dict__
        filled.update(_SEQ_STEP_DEFAULTS)
        filled.update(values)
        if len(filled) != len(_SEQ_STEP_NAMES) or not _SEQ_STEP_NAMES.issuperset(values):
            raise TypeError(f"SeqStep needs {sorted(_SEQ_STEP_REQUIRED - values.keys())}, "
                            f"has no fields {sorted(values.keys() - _SEQ_STEP_NAMES)}")
        return record


_SEQ_STEP_NAMES = frozenset(f.name for f in fields(SeqStep))
_SEQ_STEP_DEFAULTS = {f.name: f.default for f in fields(SeqStep) if f.default is not MISSING}
_SEQ_STEP_REQUIRED = _SEQ_STEP_NAMES - _SEQ_STEP_DEFAULTS.keys()


@dataclass(frozen=True)
class RequestStart:
    """A request queued since the step before: its prompt's token ids (their texts ride in
    StepTrace.token_texts), so a replay shows every prompt."""

    request_id: str
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class PoolView:
    """The page pool after the step: who owns each page."""

    num_pages: int
    page_size: int
    used: int
    free: int
    cached: int
    owners: tuple[tuple[int, ...], ...]  # per page: seq ids referencing it
    cached_pages: tuple[int, ...]  # pages carrying a prefix hash
    page_bytes: int = 0  # K and V bytes of one page across all layers, in the runner's dtype
    prefix_hits: int = 0  # prompt tokens served from the prefix cache so far
    prefix_queries: int = 0  # prompt tokens looked up so far
    ranks: tuple[RankShare, ...] = ()  # tensor parallelism: who owns which heads (one rank: empty)


@dataclass(frozen=True)
class StepTrace:
    """Everything one `Engine.step()` did."""

    step: int
    seqs: tuple[SeqStep, ...]
    admitted: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    finished: tuple[int, ...] = ()
    pages_allocated: tuple[int, ...] = ()
    pages_freed: tuple[int, ...] = ()
    prefix_hit_pages: tuple[int, ...] = ()
    num_batched_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    pool: PoolView | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage; they add up to the step
    # tensor parallelism: each rank's share of "forward", keyed rank{r}_compute / _all_reduce /
    # _forward (seconds; empty on one process or when no forward pass ran)
    rank_timings: dict[str, float] = field(default_factory=dict)
    # detail basic and full: requests queued since the step before, and the text of every token
    # id that no earlier step of this engine described (prompts, samples, drafts, candidates)
    requests: tuple[RequestStart, ...] = ()
    token_texts: tuple[tuple[int, str], ...] = ()
    # The forward pass's time on the device, from its first queued operation to its results on
    # the host (CUDA events; None where the runner does not measure it, or no top-k step ran).
    # Next to the wall time between steps it shows how long the device sat idle.
    device_seconds: float | None = None

    @property
    def prefill_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs if s.kind == "prefill")

    @property
    def decode_tokens(self) -> int:
        return sum(s.end - s.start for s in self.seqs if s.kind == "decode")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(line: str) -> "StepTrace":
        return _step_from_dict(json.loads(line))


def _step_from_dict(d: dict[str, Any]) -> StepTrace:
    seqs = tuple(
        SeqStep(**{**s, "candidates": tuple(Candidate(**c) for c in s["candidates"]),
                   "draft_tokens": tuple(s["draft_tokens"]), "emitted": tuple(s["emitted"]),
                   "token_ids": tuple(s["token_ids"]),
                   "top_logits": tuple(tuple(x) for x in s["top_logits"]),
                   "rest_logsumexp": tuple(tuple(x) for x in s.get("rest_logsumexp", ())),
                   "attention": tuple(tuple(tuple(h) for h in layer) for layer in s["attention"])})
        for s in d["seqs"]
    )
    pool = d.get("pool")
    pool_view = None if pool is None else PoolView(
        **{**pool, "owners": tuple(tuple(o) for o in pool["owners"]),
           "cached_pages": tuple(pool["cached_pages"]),
           "ranks": tuple(RankShare(r["rank"], *(tuple(r[k]) for k in ("heads", "kv_heads", "mlp_units",
                                                                       "vocab_rows")))
                          for r in pool.get("ranks", ()))})
    tuples = ("admitted", "preempted", "finished", "pages_allocated", "pages_freed",
              "prefix_hit_pages")
    nested = ("seqs", "pool", "requests", "token_texts")
    rest = {k: tuple(d[k]) if k in tuples else d[k] for k in d if k not in nested}
    requests = tuple(RequestStart(r["request_id"], tuple(r["prompt_ids"])) for r in d.get("requests", ()))
    texts = tuple((int(t), str(x)) for t, x in d.get("token_texts", ()))
    return StepTrace(seqs=seqs, pool=pool_view, requests=requests, token_texts=texts, **rest)


def write_trace(path: str, traces: Iterable[StepTrace]) -> None:
    """Save traces as JSON lines."""
    with open(path, "w", encoding="utf-8") as f:
        for trace in traces:
            f.write(trace.to_json() + "\n")


def read_trace(path: str) -> Iterator[StepTrace]:
    """Load traces written by write_trace."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield StepTrace.from_json(line)
