"""Continuous batching: which sequences compute which tokens in the next step.

Each step has a token budget. Running sequences go first, oldest first: a decoding sequence
needs one token, a sequence still prefilling gets the next chunk of its prompt. Whatever
budget is left admits waiting requests (first come, first served), whose prompts may be
split into chunks across steps (chunked prefill). When the page pool runs dry, the newest
running sequence is preempted: its pages are freed and it waits again, to be recomputed.

Two baselines exist for measurement: ``static`` batching admits nobody until the whole
running batch has finished, and ``contiguous`` allocation reserves a full context's pages
for every request up front.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tinyinfer.engine_config import DEFAULTS
from tinyinfer.errors import TinyInferError
from tinyinfer.kv import PagePool
from tinyinfer.sampling import SamplingParams


@dataclass
class Sequence:
    """One request's tokens and progress; the engine owns it, the scheduler moves it."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    rng: np.random.Generator
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    _all_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._all_ids = self.prompt_ids + self.output_ids

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output, kept as one list (read it, slice it; never modify it)."""
        return self._all_ids

    def append(self, token_id: int) -> None:
        """Add a generated token to the output."""
        self.output_ids.append(token_id)
        self._all_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self._all_ids)

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the latest sampled one still lack K/V."""
        return self.num_computed < self.num_tokens - 1 or not self.output_ids


class Chunk(NamedTuple):
    """Positions [start, end) of a sequence to compute this step.

    A named tuple: immutable like a frozen dataclass, at half the cost to make, and the
    scheduler makes one per running sequence per step."""

    seq: Sequence
    start: int
    end: int
    kind: str  # "prefill" or "decode"
    cached_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so a next token is sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[Chunk]
    admitted: list[Sequence]
    preempted: list[Sequence]
    pages_allocated: list[int]
    prefix_hit_pages: list[int]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = DEFAULTS.max_num_batched_tokens
    batching: str = DEFAULTS.batching  # or "static"
    kv_allocation: str = DEFAULTS.kv_allocation  # or "contiguous"
    max_model_len: int = 1024
    num_lookahead_slots: int = 0  # extra slots a decoding sequence may fill (speculative drafts)

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise TinyInferError(f"batching must be 'continuous' or 'static', not {self.batching}")
        if self.kv_allocation not in ("paged", "contiguous"):
            raise TinyInferError(
                f"kv_allocation must be 'paged' or 'contiguous', not {self.kv_allocation}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise TinyInferError("max_num_seqs and max_num_batched_tokens must be at least 1")


class Scheduler:
    """Waiting and running queues over one page pool."""

    def __init__(self, config: SchedulerConfig, pool: PagePool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks: running sequences first, then admissions."""
        out = SchedulerOutput([], [], [], [], [])
        budget = self.config.max_num_batched_tokens
        batch_was_running = bool(self.running)
        drafting = self.config.num_lookahead_slots > 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            kind = "prefill" if seq.is_prefilling else "decode"
            extra = self.lookahead(seq) if drafting and kind == "decode" else 0
            if not self._make_room(seq, seq.num_computed + n + extra, out):
                continue  # seq itself was preempted; it was the last running one
            out.chunks.append(Chunk(seq, seq.num_computed, seq.num_computed + n, kind))
            budget -= n + extra
            i += 1
        if self.config.batching == "continuous" or not batch_was_running:
            budget = self._admit(budget, out)
        return out

    def runs_exactly(self, seqs: list[Sequence]) -> bool:
        """Whether ``seqs`` are the running sequences, in their order, and nobody else runs (a
        step planned ahead of the scheduler continues them alone)."""
        return len(seqs) == len(self.running) and all(a is b for a, b in zip(seqs, self.running))

    def lookahead(self, seq: Sequence, emitted: int = 0) -> int:
        """Draft slots a decoding sequence may use: never past its max_tokens (once it has
        ``emitted`` more tokens: a step planned ahead)."""
        room = seq.params.max_tokens - len(seq.output_ids) - emitted - 1
        return max(0, min(self.config.num_lookahead_slots, room))

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Ensure seq's pages cover num_tokens, preempting the newest sequences if needed."""
        needed = self.pool.pages_needed(seq.seq_id, num_tokens)  # most decode steps: 0
        if not needed:
            return True
        while not self.pool.can_allocate(needed):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        out.pages_allocated += self.pool.ensure_capacity(seq.seq_id, num_tokens)
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        static = self.config.batching == "static"
        while self.waiting and len(self.running) < self.config.max_num_seqs and (budget > 0 or static):
            seq = self.waiting[0]
            cached = self.pool.add_sequence(seq.seq_id, seq.all_ids)
            n = min(seq.num_tokens - cached, budget)
            reserve = self._reservation(seq, cached + n)
            if not self.pool.can_allocate(self.pool.pages_needed(seq.seq_id, reserve)):
                self.pool.free(seq.seq_id)
                break
            self.waiting.popleft()
            hit_pages = self.pool.page_table(seq.seq_id)[: cached // self.pool.page_size]
            out.prefix_hit_pages += hit_pages
            out.pages_allocated += self.pool.ensure_capacity(seq.seq_id, reserve)
            seq.num_computed = cached
            self.running.append(seq)
            out.admitted.append(seq)
            if n > 0:
                out.chunks.append(Chunk(seq, cached, cached + n, "prefill", cached_tokens=cached))
                budget -= n
        return budget

    def _reservation(self, seq: Sequence, num_tokens: int) -> int:
        """Token slots to hold at admission: what is computed now, or a whole context."""
        if self.config.kv_allocation == "contiguous":
            return self.config.max_model_len
        return num_tokens

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages and put it back at the head of the queue."""
        self.running.remove(seq)
        self.pool.free(seq.seq_id)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> list[int]:
        """Release a finished or aborted sequence wherever it is; return pages freed."""
        if seq in self.running:
            self.running.remove(seq)
            return self.pool.free(seq.seq_id)
        if seq in self.waiting:
            self.waiting.remove(seq)
        return []

