"""The runner contract: what every model runner takes and returns, one mixed batch per step.

``ModelRunner`` declares all the engine, benchmarks and TUI may call; ``RunnerInfo`` says what
a runner is (dtype, device, bytes per K/V value, tensor-parallel ranks).

A step may hold several sequences at once, some prefilling a chunk of their prompt and some
decoding one token. All their new tokens are packed into one flat list; ``query_starts``
says where each sequence's tokens begin. K and V of the new tokens are written to the paged
cache at ``slot_mapping`` (slot = page_id * page_size + offset); each sequence then attends
over its whole context, gathered through its page table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from tinyinfer.config import ModelConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.sampling import top_and_logsumexp

# How K/V are stored: "auto" in the runner's compute dtype; "int8" as int8 codes with one
# float16 scale per token and KV head (quant.quantize_kv), about half of 16-bit's bytes.
KV_CACHE_DTYPES = ("auto", "int8")
# How tensor-parallel ranks sum partial results (runners/tp/shard.py says what each does).
ALL_REDUCES = ("auto", "nccl", "symm_mem", "push")


@dataclass(frozen=True)
class Batch:
    """The tokens one forward pass computes, and where their K/V live."""

    token_ids: np.ndarray  # [T] int64, the new tokens of every sequence, packed
    positions: np.ndarray  # [T] int64, each token's position in its sequence
    query_starts: np.ndarray  # [B + 1] int64, sequence b owns token rows [qs[b], qs[b+1])
    context_lens: np.ndarray  # [B] int64, tokens in each sequence's KV after this step
    page_tables: tuple[tuple[int, ...], ...]  # [B][pages] page ids, in order
    slot_mapping: np.ndarray  # [T] int64, cache slot each new token's K/V is written to
    logits_rows: np.ndarray  # [R] int64, rows of T whose next-token logits are wanted

    @property
    def num_seqs(self) -> int:
        return len(self.page_tables)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def make_batch(
    seqs: list[tuple[list[int], int, list[int], bool]], page_size: int,
) -> Batch:
    """Pack sequences into a Batch.

    Each entry is ``(new_token_ids, start_position, page_table, all_logits)``: the tokens to
    compute, the position of the first one, the sequence's pages, and whether logits are wanted
    for every new token (verification, full-sequence scoring) or only the last.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    context_lens = []
    logits_rows: list[int] = []
    for new_tokens, start, table, all_logits in seqs:
        n = len(new_tokens)
        first_row = len(token_ids)
        token_ids.extend(new_tokens)
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
        starts.append(first_row + n)
        context_lens.append(start + n)
        if all_logits:
            logits_rows.extend(range(first_row, first_row + n))
        else:
            logits_rows.append(first_row + n - 1)
    as_i64 = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return Batch(
        token_ids=as_i64(token_ids),
        positions=as_i64(positions),
        query_starts=as_i64(starts),
        context_lens=as_i64(context_lens),
        page_tables=tuple(tuple(t) for _, _, t, _ in seqs),
        slot_mapping=as_i64(slots),
        logits_rows=as_i64(logits_rows),
    )


@dataclass(frozen=True)
class TopLogits:
    """The k largest logits of each row and each row's log-sum-exp: all greedy decoding needs.

    A runner on a GPU can reduce [R, V] logits to this on the device, so that a large
    vocabulary never crosses to the host (see ``forward_top``).
    """

    ids: np.ndarray  # [R, k] int64, most likely first
    values: np.ndarray  # [R, k] raw logits (float32 from a device, float64 from top_logits)
    logsumexp: np.ndarray  # [R], as values


class TopFuture:
    """A launched ``forward_top`` (``launch_top``): ``result()`` waits for its TopLogits.

    ``argmax`` holds each row's most likely id [R] where the runner computed it (a device
    tensor, or NumPy), so that the next launch can take its input tokens from it (a ``Feed``)
    before the host has seen them.
    """

    def __init__(self, argmax: Any, wait: Callable[[], TopLogits],
                 device_seconds: Callable[[], float | None] = lambda: None):
        self.argmax = argmax
        self._wait = wait
        self._device_seconds = device_seconds
        self._result: TopLogits | None = None

    @classmethod
    def done(cls, top: TopLogits) -> TopFuture:
        """A result computed already (a runner that cannot queue work behind the host's back)."""
        return cls(top.ids[:, 0], lambda: top)

    def result(self) -> TopLogits:
        """The TopLogits, waiting for the device if it has not finished."""
        if self._result is None:
            self._result = self._wait()
        return self._result

    @property
    def device_seconds(self) -> float | None:
        """The step's time on the device, its first queued operation to its last (CUDA events;
        waits for the result); None where the runner does not measure it."""
        self.result()
        return self._device_seconds()

    def host_argmax(self) -> np.ndarray:
        """Each row's argmax on the host [R] (waits for the result)."""
        return self.result().ids[:, 0]


class TokensFuture:
    """Launched greedy rounds (``launch_rounds``): ``result()`` waits for their argmaxes.

    ``argmax`` holds them flattened, [B (n + 1)] (row b (n + 1) + r: sequence b's argmax of the
    launch, r = 0, or of round r), where the runner computed them (a device tensor), so that a
    later launch can take its tokens from them before the host has seen them (a ``Feed``: the
    verification of the guesses); None where they exist on the host only (the stepwise rule).
    """

    def __init__(self, wait: Callable[[], np.ndarray], argmax: Any = None):
        self.argmax = argmax
        self._wait = wait
        self._result: np.ndarray | None = None

    def result(self) -> np.ndarray:
        """Each sequence's argmax of the launch and of every round [B, n + 1] int64 (-1 in a
        round the sequence sat out)."""
        if self._result is None:
            self._result = self._wait()
        return self._result

    def host_argmax(self) -> np.ndarray:
        """``argmax``'s rows on the host [B (n + 1)] (waits for the rounds)."""
        return self.result().reshape(-1)


@dataclass(frozen=True)
class Feed:
    """Input tokens from an earlier launch: token i of the batch is the argmax of row ``rows[i]``
    of ``source``, or where ``rows[i]`` is -1 the batch's own token i (asynchronous scheduling:
    a decode step's input is the step before's output; speculative decoding: a verification's
    guesses are the draft rounds' argmaxes, beside each sequence's last token, which the host
    knows)."""

    source: TopFuture | TokensFuture
    rows: np.ndarray  # [T] int64, rows of the source's argmax, one per token of the batch (-1: own)

    def host_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        """The batch's tokens ``token_ids`` [T] with the fed ones in place, on the host (waits for
        the source): runners that run at once, or take their feed through the host."""
        fed = self.rows >= 0
        tokens = np.array(token_ids, dtype=np.int64)
        tokens[fed] = self.source.host_argmax()[self.rows[fed]]
        return tokens


@dataclass(frozen=True)
class Rounds:
    """Greedy rounds after a launch (``launch_rounds``): in round r each sequence b decodes one
    token, its own argmax of the step before (for r = 0, of its last logits row of the launch),
    at position ``positions[r, b]``, its K/V written to ``slots[r, b]``. -1 in both: b sits the
    round out (it has guessed all it may), and every later one."""

    positions: np.ndarray  # [n, B] int64
    slots: np.ndarray  # [n, B] int64

    def __post_init__(self) -> None:
        out = self.positions < 0
        if self.positions.shape != self.slots.shape or self.positions.ndim != 2:
            raise TinyInferError(f"rounds: positions {self.positions.shape} and slots "
                                 f"{self.slots.shape} must both be [rounds, sequences]")
        if not np.array_equal(out, self.slots < 0) or (out[:-1] & ~out[1:]).any():
            raise TinyInferError("rounds: a sequence sits a round out with -1 in both positions "
                                 "and slots, and then every later round")

    @property
    def num_rounds(self) -> int:
        return int(self.positions.shape[0])

    def staged(self, scratch_slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, slots) [n, B] as a launch that runs every sequence in every round takes
        them: a round a sequence sits out decodes at position 0 into the scratch slot."""
        out = self.slots < 0
        return np.where(out, 0, self.positions), np.where(out, scratch_slot, self.slots)


@dataclass(frozen=True)
class AfterVerification:
    """A draft model's next step and rounds, launched while the verification they follow still
    runs (``launch_rounds_after``): what each sequence feeds depends on how many of its guesses
    the target accepts, so its inputs are given for every accepted count a, and the runner picks
    them where the verification's argmax lies (on the device: the host need not read it first).

    Sequence b's verification checked guesses ``guesses[b, :k_b]`` against its rows
    ``rows[b, :k_b + 1]`` of the verification's argmax; it accepts a = the guesses before the
    first that differs from the target's choice (``verify_greedy``'s rule). Its step then
    feeds the last q verified tokens up to the target's choice after its accepted guesses
    (argmax rows ``rows[b, a - q + 1 .. a]``) at ``positions[b, a, :q]``, writing their K/V at
    ``slots[b, a, :q]`` (-1 in both: the row sits out, e.g. a token the draft computed
    already), and then ``positions[b, a, q:]`` / ``slots[b, a, q:]`` are its rounds (``Rounds``,
    -1: sits out; a sequence that keeps more guesses may run fewer rounds, as its lookahead
    allows)."""

    verification: TopFuture
    rows: np.ndarray  # [B, k + 1] int64: rows of the verification's argmax (-1 past k_b + 1)
    guesses: np.ndarray  # [B, k] int64: the guesses checked (-1 past k_b)
    positions: np.ndarray  # [B, k + 1, q + n] int64
    slots: np.ndarray  # [B, k + 1, q + n] int64
    page_tables: tuple[tuple[int, ...], ...]  # [B] each sequence's draft pages
    q: int  # tokens a sequence's step feeds (rows sitting out included)

    @property
    def num_seqs(self) -> int:
        return len(self.page_tables)

    @property
    def num_rounds(self) -> int:
        return int(self.positions.shape[2]) - self.q

    def chosen(self) -> tuple[Batch, Rounds]:
        """The step and rounds as the host builds them once the verification has run (waits for
        it): rows that sit out dropped from the step."""
        ids = self.verification.host_argmax()
        verified = np.where(self.rows >= 0, ids[np.maximum(self.rows, 0)], -1)
        accepted = accepted_counts(verified, self.guesses)
        tokens, positions, slots, starts = [], [], [], [0]
        round_positions, round_slots = [], []
        for b, a in enumerate(accepted.tolist()):
            step = self.positions[b, a, :self.q]
            live = np.flatnonzero(step >= 0)
            tokens.append(verified[b, a - self.q + 1 + live])
            positions.append(step[live])
            slots.append(self.slots[b, a, :self.q][live])
            starts.append(starts[-1] + len(live))
            round_positions.append(self.positions[b, a, self.q:])
            round_slots.append(self.slots[b, a, self.q:])
        positions_all = np.concatenate(positions)
        batch = Batch(token_ids=np.concatenate(tokens), positions=positions_all,
                      query_starts=np.asarray(starts, dtype=np.int64),
                      context_lens=np.asarray([p[-1] + 1 for p in positions], dtype=np.int64),
                      page_tables=self.page_tables, slot_mapping=np.concatenate(slots),
                      logits_rows=np.arange(len(positions_all), dtype=np.int64))
        return batch, Rounds(np.stack(round_positions, axis=1), np.stack(round_slots, axis=1))


def accepted_counts(verified: np.ndarray, guesses: np.ndarray) -> np.ndarray:
    """Each sequence's accepted count [B] from its verified argmaxes [B, k + 1] and guesses
    [B, k]: the leading guesses equal to the target's choices (``verify_greedy``'s rule; -1, no
    guess, never is)."""
    same = (verified[:, :-1] == guesses) & (guesses >= 0)
    return np.cumprod(same, axis=1).sum(axis=1)


def launch_rounds_after_stepwise(runner: ModelRunner, kv_cache: Any, after: AfterVerification) -> TokensFuture:
    """``launch_rounds_after`` as the host does it: wait for the verification, pick each
    sequence's step and rounds, ``launch_rounds`` them (the rule; the way of a runner that
    computes each launch at once, or of any without a faster one)."""
    batch, rounds = after.chosen()
    return runner.launch_rounds(batch, kv_cache, rounds)


def last_logits_rows(batch: Batch) -> np.ndarray:
    """Each sequence's last row among the batch's logits rows [B] (an index into the logits)."""
    return np.searchsorted(batch.logits_rows, batch.query_starts[1:]) - 1


def launch_rounds_stepwise(runner: ModelRunner, batch: Batch, kv_cache: Any, rounds: Rounds) -> TokensFuture:
    """``launch_rounds`` as one ``launch_top`` per round, each fed its argmaxes from the round
    before (a Feed): the rule every runner follows, and the way of any runner (or batch) without
    a faster one. Nothing is waited for until ``result()``."""
    num_seqs = batch.num_seqs
    launched = [(runner.launch_top(batch, kv_cache, 1), last_logits_rows(batch))]  # (future, row of each seq)
    for r in range(rounds.num_rounds):
        live = np.flatnonzero(rounds.slots[r] >= 0)
        if not len(live):
            break
        positions = rounds.positions[r, live]
        step = Batch(token_ids=np.zeros(len(live), dtype=np.int64), positions=positions,
                     query_starts=np.arange(len(live) + 1, dtype=np.int64), context_lens=positions + 1,
                     page_tables=tuple(batch.page_tables[b] for b in live),
                     slot_mapping=rounds.slots[r, live], logits_rows=np.arange(len(live), dtype=np.int64))
        source, source_rows = launched[-1]
        rows = np.full(num_seqs, -1, dtype=np.int64)
        rows[live] = np.arange(len(live))
        launched.append((runner.launch_top(step, kv_cache, 1, Feed(source, source_rows[live])), rows))

    def wait() -> np.ndarray:
        ids = np.full((num_seqs, rounds.num_rounds + 1), -1, dtype=np.int64)
        for r, (future, rows) in enumerate(launched):
            top, live = future.result().ids[:, 0], rows >= 0
            ids[live, r] = top[rows[live]]
        return ids

    return TokensFuture(wait)


def fed_batch(batch: Batch, feed: Feed | None) -> Batch:
    """The batch with its token ids taken from ``feed`` (read on the host), if there is one."""
    return batch if feed is None else dataclasses.replace(batch, token_ids=feed.host_tokens(batch.token_ids))


@dataclass(frozen=True)
class RankShare:
    """What one tensor-parallel rank owns, as [start, stop) ranges of the whole model's units.

    Every rank holds every KV page, but only its KV heads' slice of it.
    """

    rank: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # KV heads: this slice of every page lives on this rank
    mlp_units: tuple[int, int]  # intermediate units of gate/up (GPT-2: fc) and down (proj)
    vocab_rows: tuple[int, int]  # rows of the embedding and the LM head


@dataclass(frozen=True)
class RankTiming:
    """One rank's share of the last step: seconds computing, in all-reduces, gathering logits.

    ``forward_s`` is the forward pass alone, all-reduces included, as the device saw it (on a
    GPU from its first kernel to its last, by CUDA events): next to the step's wall time it
    shows how long the device waited for the host, and ``forward_s - all_reduce_s`` across
    ranks shows whether one rank's kernels are slower than the others'.
    """

    rank: int
    compute_s: float
    all_reduce_s: float
    gather_s: float
    num_all_reduces: int
    forward_s: float = 0.0


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is, for sizing the KV pool, benchmarks and displays."""

    name: str  # "numpy" or "torch"
    dtype: str  # compute and K/V dtype: "float32", "bfloat16", ...
    device: str  # "cpu", "cuda:0", ...
    itemsize: int  # bytes of one K or V value in the cache (int8 K/V: 1)
    weight_bytes: int  # weights one decode step streams (tensor parallelism: rank 0's shard)
    tensor_parallel: int = 1  # ranks the model is split over
    rank_shares: tuple[RankShare, ...] = ()  # who owns which heads (one rank: empty)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    kv_scale_bytes: int = 0  # bytes of scale per token, KV head and K or V (int8 K/V: 2)

    def kv_bytes_per_token(self, config: ModelConfig) -> int:
        """Bytes of K and V one token takes in this runner's cache, all layers, scales included."""
        return config.kv_bytes_per_token(self.itemsize, self.kv_scale_bytes)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The K/V storage asked for, if it is one of KV_CACHE_DTYPES; else a TinyInferError."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise TinyInferError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{kv_cache_dtype!r}: pass int8 for an int8 K/V cache, auto for the "
                             "compute dtype")
    return kv_cache_dtype


def top_logits(logits: np.ndarray, k: int) -> TopLogits:
    """Reduce logits [R, V] to TopLogits on the host, by the same rule as greedy sampling:
    ``forward_top`` for a runner that has no faster way."""
    rows = [top_and_logsumexp(row, k) for row in logits]
    return TopLogits(ids=np.array([ids for ids, _, _ in rows], dtype=np.int64).reshape(len(rows), -1),
                     values=np.array([values for _, values, _ in rows]).reshape(len(rows), -1),
                     logsumexp=np.array([lse for _, _, lse in rows]))


@runtime_checkable
class ModelRunner(Protocol):
    """Everything the engine, benchmarks and the TUI may ask of a runner; every runner implements
    all of it (tests/test_runner_contract.py checks)."""

    config: ModelConfig
    name: str  # "numpy" or "torch"
    # Attention capture: set ``capture_attention`` and the next ``forward`` leaves, per sequence
    # of its batch and per layer, the last query row's attention weights [H, N] in
    # ``last_attention``. Only the reference runner computes them; the others leave it empty.
    capture_attention: bool
    last_attention: Sequence[list[np.ndarray]]
    # Per rank, how the last forward step spent its time (tensor parallelism; one process: empty).
    last_timings: tuple[RankTiming, ...]

    @property
    def info(self) -> RunnerInfo:
        """Name, dtype, device, bytes per K/V value, weight bytes, tensor-parallel ranks."""

    def new_kv_cache(self, num_pages: int, page_size: int) -> Any:
        """Allocate K/V storage for ``num_pages`` pages of ``page_size`` tokens each."""

    def forward(self, batch: Batch, kv_cache: Any) -> np.ndarray:
        """Run one batch; write its K/V into ``kv_cache``; return float32 logits [R, vocab]."""

    def forward_top(self, batch: Batch, kv_cache: Any, k: int) -> TopLogits:
        """The same forward pass, with logits reduced to their top k per row (on the device when
        the runner can). The engine uses it when every row is plain greedy."""

    def launch_top(self, batch: Batch, kv_cache: Any, k: int, feed: Feed | None = None) -> TopFuture:
        """``forward_top`` without waiting for it: on a device that queues work, return once the
        step is queued, its top k on their way to the host (asynchronous scheduling); elsewhere
        compute it now. With ``feed``, the batch's fed token ids are placeholders: each is an
        earlier launch's argmax (of a ``launch_top`` or a ``launch_rounds``), taken where that
        launch left it (on the device: no round trip)."""

    def launch_rounds(self, batch: Batch, kv_cache: Any, rounds: Rounds) -> TokensFuture:
        """Greedy drafting: ``batch``, then ``rounds`` of one token per sequence, each fed the
        sequence's argmax of the step before where it lies (on the device: no round trip), all
        queued before the host waits (``launch_rounds_stepwise`` is the rule; a runner may run
        the rounds as one launch, e.g. one CUDA graph, and leave their argmaxes on the device,
        ``TokensFuture.argmax``, for a later launch's Feed)."""

    def launch_rounds_after(self, kv_cache: Any, after: AfterVerification) -> TokensFuture:
        """``launch_rounds`` for a step that follows a verification still under way: each
        sequence's step and rounds chosen by how many of its guesses the verification accepts
        (``AfterVerification``), where its argmax lies (on the device: queued before the host has
        read the verification; ``launch_rounds_after_stepwise`` is the rule)."""

    def copy_page(self, kv_cache: Any, src: int, dst: int) -> None:
        """Copy one page's K/V (all layers), for sequences forked from a shared prefix."""

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel runner's worker processes. Safe to
        call twice; nothing to do for a runner of one process."""
