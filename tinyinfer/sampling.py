"""Logits → next token: penalties, temperature, top-k / top-p / min-p, seeded sampling, stops.

The pipeline is split in two on purpose: `probs_from_logits` turns logits into the processed
distribution p (what speculative decoding verifies against), and `sample_from_probs` turns p
into one token with exactly one uniform draw (so seeded streams stay reproducible).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tinyinfer.errors import InvalidLogitsError, SamplingParamsError

MAX_LOGPROBS = 20
# Repetition penalties divide (or multiply) logits: inside this range a finite float32 logit stays
# finite in float64 by far, and every practical setting (about 1 to 2) fits.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
TUI_TOP_CANDIDATES = 16  # candidates a trace keeps: enough for a Next token panel's rows
# Cumulative sums of float64 probabilities drift by a few ulps; a nucleus that reaches
# top_p up to this slack counts as reaching it, so hand-built cases behave as written.
_TOP_P_SLACK = 1e-12


# Plug points: functions this module calls by their global name, so that the course can put a
# student's version in their place (lessons/support.py: plugged). tests/test_lessons.py checks
# that the engine still reaches every one.
PLUG_POINTS = ("probs_from_logits", "sample_from_probs")


def _fail(name: str, value: object, valid: str) -> SamplingParamsError:
    """Build the error for one bad parameter: its name, the bad value and the valid range."""
    got = value if isinstance(value, (int, float)) else f"{type(value).__name__} {value}"
    return SamplingParamsError(f"{name} must be {valid} (got {got})", name)


def _is_int(value: object) -> bool:
    """True for integers (Python or NumPy) but not bools, which are ints only by accident."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value: object, low: int, high: int | None, valid: str) -> int:
    """Return `value` as an int if it is an integer in [low, high], else raise."""
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise _fail(name, value, valid)
    return int(value)


def _check_float(name: str, value: object, in_range: Callable[[float], bool], valid: str) -> float:
    """Return `value` as a float if it is a finite real number passing `in_range`, else raise."""
    is_real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not is_real or not math.isfinite(value) or not in_range(value):
        raise _fail(name, value, valid)
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; validated on construction so the engine can trust it."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        """Check every field's type and range; normalise numbers and sequences in place."""
        fields = {
            "max_tokens": _check_int("max_tokens", self.max_tokens, 1, None, "an integer >= 1"),
            "temperature": _check_float(
                "temperature",
                self.temperature,
                lambda t: t >= 0,
                "a finite number >= 0 (0 means greedy)",
            ),
            "top_k": _check_int("top_k", self.top_k, 0, None, "an integer >= 0 (0 is off)"),
            "top_p": _check_float(
                "top_p",
                self.top_p,
                lambda p: 0 < p <= 1,
                "a number in (0, 1] (1 turns top-p off)",
            ),
            "min_p": _check_float(
                "min_p",
                self.min_p,
                lambda p: 0 <= p <= 1,
                "a number in [0, 1] (0 turns min-p off)",
            ),
            "repetition_penalty": _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                lambda r: REPETITION_PENALTY_RANGE[0] <= r <= REPETITION_PENALTY_RANGE[1],
                "a number in [{:g}, {:g}] (1 turns it off)".format(*REPETITION_PENALTY_RANGE),
            ),
            "presence_penalty": _check_float(
                "presence_penalty",
                self.presence_penalty,
                lambda x: -2 <= x <= 2,
                "a number in [-2, 2] (0 turns it off)",
            ),
            "frequency_penalty": _check_float(
                "frequency_penalty",
                self.frequency_penalty,
                lambda x: -2 <= x <= 2,
                "a number in [-2, 2] (0 turns it off)",
            ),
            "seed": None
            if self.seed is None
            else _check_int("seed", self.seed, 0, None, "an integer >= 0 or unset"),
            "stop": _check_stop(self.stop),
            "stop_token_ids": _check_stop_token_ids(self.stop_token_ids),
            "logprobs": None
            if self.logprobs is None
            else _check_int(
                "logprobs",
                self.logprobs,
                0,
                MAX_LOGPROBS,
                f"an integer in [0, {MAX_LOGPROBS}] or unset",
            ),
        }
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise _fail("ignore_eos", self.ignore_eos, "True or False")
        fields["ignore_eos"] = bool(self.ignore_eos)
        fields["min_tokens"] = _check_int(
            "min_tokens",
            self.min_tokens,
            0,
            fields["max_tokens"],
            f"an integer in [0, max_tokens={fields['max_tokens']}]",
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0), which needs no randomness."""
        return self.temperature == 0.0


def _check_stop(stop: object) -> tuple[str, ...]:
    """Accept one stop string or a list/tuple of non-empty strings; return a tuple."""
    if isinstance(stop, str):
        stop = (stop,)
    valid = "a non-empty string or a list of non-empty strings"
    if not isinstance(stop, (list, tuple)):
        raise _fail("stop", stop, valid)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise _fail("stop", stop, valid)
    return tuple(stop)


def _check_stop_token_ids(ids: object) -> tuple[int, ...]:
    """Accept a list/tuple of token ids >= 0; return a tuple of ints."""
    valid = "a list of integer token ids >= 0"
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise _fail("stop_token_ids", ids, valid)
    return tuple(int(i) for i in ids)


def _as_logits(logits: np.ndarray) -> np.ndarray:
    """Return logits as a float64 [V] copy, rejecting shapes and values no model should emit."""
    x = np.array(logits, dtype=np.float64)  # copy: callers' arrays are never modified
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [V], got shape {x.shape}")
    top = x.max()  # NaN if any is NaN: one pass finds both NaN and +inf
    if np.isnan(top) or np.isposinf(top):
        raise InvalidLogitsError("logits contain NaN or +inf; the model produced invalid output")
    return x


def _token_counts(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Count how often each token id occurs: [V] int64."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {arr.min()}..{arr.max()}")
    return np.bincount(arr, minlength=vocab_size)


def apply_penalties(
    logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> np.ndarray:
    """Return new [V] float64 logits with repetition, presence and frequency penalties applied."""
    x = _as_logits(logits)  # [V]
    vocab_size = x.size
    if params.repetition_penalty != 1.0:
        # CTRL / HF style: any token already seen is made less likely whatever its sign.
        seen = (_token_counts(prompt_ids, vocab_size) + _token_counts(output_ids, vocab_size)) > 0
        r = params.repetition_penalty
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        # OpenAI style: only generated tokens count, so the prompt can be quoted freely.
        counts = _token_counts(output_ids, vocab_size)  # [V]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return x


def _top_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first, ties broken toward the lowest id."""
    if n == 1 < values.size:  # argmax takes the first of equal maxima, in one pass
        return np.array([int(np.argmax(values))])
    if n >= values.size:
        candidates = np.arange(values.size)
    else:
        threshold = np.partition(values, values.size - n)[values.size - n]  # n-th largest
        candidates = np.flatnonzero(values >= threshold)
    order = np.lexsort((candidates, -values[candidates]))  # by value desc, then id asc
    return candidates[order][:n]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities [V] float64 of raw logits: the model's own, unprocessed distribution."""
    x = _as_logits(logits)
    if np.isneginf(x).all():
        raise InvalidLogitsError("every logit is -inf, so no token can be chosen")
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def _keep_nucleus(p: np.ndarray, x: np.ndarray, top_p: float) -> np.ndarray:
    """Zero every token outside the smallest best-ranked set whose mass reaches top_p."""
    ranked = np.where(p > 0, x, -np.inf)  # [V]; tokens already cut can never rejoin
    alive = np.count_nonzero(p)
    target = top_p * p.sum() - _TOP_P_SLACK
    # Sorting all V tokens is slow and the nucleus is usually small: sort the best m
    # tokens only, and widen m until their mass reaches the target.
    m = min(64, alive)
    while True:
        best = _top_indices(ranked, m)  # [m], best logit first
        cumulative = np.cumsum(p[best])
        if cumulative[-1] >= target or m == alive:
            break
        m = min(4 * m, alive)
    n_keep = min(int(np.searchsorted(cumulative, target, side="left")) + 1, m)
    out = np.zeros_like(p)
    keep = best[:n_keep]
    out[keep] = p[keep]
    return out


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Processed distribution p [V] float64: temperature, top-k, top-p, min-p, renormalised.

    Excluded tokens get exactly 0 and the most likely token always survives. Temperature 0
    gives a one-hot at the argmax (ties go to the lowest id).
    """
    x = _as_logits(logits)  # [V]
    if np.isneginf(x).all():
        raise InvalidLogitsError("every logit is -inf, so no token can be chosen")
    if params.greedy:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0  # np.argmax returns the first maximum
        return p
    e = np.exp((x - x.max()) / params.temperature)  # [V]; shift first: exp never overflows
    p = e / e.sum()
    # Rank by the logits themselves: shifting, scaling and exp can round distinct logits to ties.
    if 0 < params.top_k < p.size:
        kept = _top_indices(x, params.top_k)
        masked = np.zeros_like(p)
        masked[kept] = p[kept]
        p = masked
    if params.top_p < 1.0:
        p = _keep_nucleus(p, x, params.top_p)
    if params.min_p > 0.0:
        # The ratio to the max is unchanged by renormalising, so min-p can use p as it stands.
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def sample_from_probs(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from probs [V] by inverse CDF, using exactly one uniform number."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.isfinite(p).all() or (p < 0).any() or p.sum() <= 0:
        raise ValueError(
            "probs must be a non-empty 1-D array of finite, non-negative numbers with positive sum"
        )
    cdf = np.cumsum(p)  # [V], non-decreasing; a zero-probability token adds an empty interval
    u = rng.random() * cdf[-1]  # in [0, total), so the index is always < V
    return int(np.searchsorted(cdf, u, side="right"))


def make_rng(seed: int | None) -> np.random.Generator:
    """A NumPy generator for one request: reproducible from a seed, fresh entropy for None."""
    return np.random.default_rng(seed)


@dataclass(frozen=True)
class TokenChoice:
    """The chosen token with what UIs and the OpenAI API report about the choice."""

    token_id: int
    logprob: float  # log p(token) under the raw model distribution (OpenAI's logprobs)
    top: tuple[tuple[int, float], ...]  # (id, processed p > 0), most likely first
    top_logprobs: tuple[tuple[int, float], ...]  # (id, raw logprob) when params.logprobs is set
    prob: float  # p(token) after penalties, temperature and filters: the chance it was drawn with


def processed_probs(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    eos_token_id: int | None = None,
) -> np.ndarray:
    """The distribution p [V] a request samples from: penalties, min_tokens mask, filters."""
    x = apply_penalties(logits, params, prompt_ids, output_ids)  # [V]
    if len(output_ids) < params.min_tokens:
        # Ending tokens are forbidden until min_tokens are out; ids beyond V can never appear.
        banned = [*params.stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))]
        banned = [t for t in banned if 0 <= t < x.size]
        x[banned] = -np.inf
    return probs_from_logits(x, params)


def describe_choice(
    logits: np.ndarray, p: np.ndarray, token: int, params: SamplingParams
) -> TokenChoice:
    """What UIs and the API report about a chosen token: raw logprob, top candidates."""
    raw_logprobs = log_softmax(logits)  # [V]
    n_top = max(params.logprobs or 0, TUI_TOP_CANDIDATES)
    top = tuple((int(i), float(p[i])) for i in _top_indices(p, n_top) if p[i] > 0)
    top_logprobs = ()
    if params.logprobs:
        top_logprobs = tuple(
            (int(i), float(raw_logprobs[i])) for i in _top_indices(raw_logprobs, params.logprobs)
        )
    return TokenChoice(
        token_id=token, logprob=float(raw_logprobs[token]), top=top, top_logprobs=top_logprobs,
        prob=float(p[token]),
    )


def is_plain_greedy(params: SamplingParams, num_output: int, k: int) -> bool:
    """Whether the top-k logits alone decide this token: greedy, no penalties, no masking."""
    return (params.greedy and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and num_output >= params.min_tokens
            and (params.logprobs or 0) <= k)


def greedy_choices_from_top(ids: np.ndarray, values: np.ndarray, logsumexp: np.ndarray,
                            params: Sequence[SamplingParams]) -> list[TokenChoice]:
    """Each row's greedy token from its top-k logits ([R, k] ids and values, largest first) and
    log-sum-exp [R]: one NumPy pass for all rows, then plain Python numbers per row."""
    logprobs = values - np.asarray(logsumexp, dtype=values.dtype)[:, None]  # [R, k]
    first_ids, first_logprobs = ids[:, 0].tolist(), logprobs[:, 0].tolist()
    choices = []
    for row, p in enumerate(params):
        n = p.logprobs or 0
        top_logprobs = tuple(zip(ids[row, :n].tolist(), logprobs[row, :n].tolist())) if n else ()
        token = first_ids[row]
        choices.append(TokenChoice(token, first_logprobs[row], ((token, 1.0),), top_logprobs, prob=1.0))
    return choices


def top_and_logsumexp(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, float]:
    """A full logits row [V] in two passes: its n largest (ids and float64 values, largest first,
    ties toward the lowest id) and its log-sum-exp. All plain greedy decoding needs."""
    x = _as_logits(logits)  # [V]; rejects NaN like the full pipeline does
    ids = _top_indices(x, n)
    m = x[ids[0]]
    return ids, x[ids], float(m + np.log(np.exp(x - m).sum()))


def greedy_choice(logits: np.ndarray, params: SamplingParams) -> TokenChoice:
    """Plain greedy from a full logits row [V]."""
    ids, values, logsumexp = top_and_logsumexp(logits, max(params.logprobs or 0, 1))
    return greedy_choices_from_top(ids[None], values[None], np.array([logsumexp]), [params])[0]


def sample_next(
    logits: np.ndarray,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    rng: np.random.Generator,
    *,
    eos_token_id: int | None = None,
) -> TokenChoice:
    """Pick the next token for one sequence: penalties, min_tokens mask, p, then sample or argmax."""
    p = processed_probs(logits, params, prompt_ids, output_ids, eos_token_id=eos_token_id)
    token = int(np.argmax(p)) if params.greedy else sample_from_probs(p, rng)
    return describe_choice(logits, p, token, params)


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in text, or None; the engine cuts there."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class StopHoldback:
    """How many trailing characters of a growing text could begin a stop string, so must not
    stream yet. One Knuth-Morris-Pratt automaton per stop string reads each new character once
    (amortised O(1)), so long stop strings cost no more per token than short ones; each string's
    failure table is built only as far as the text has matched it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._borders: list[list[int]] = [[0] for _ in self._stops]  # border[q-1]: of stop[:q]
        self._states = [0] * len(self._stops)  # longest stop prefix the text now ends with
        self._read = 0  # characters of the text read so far

    def _border(self, i: int, q: int) -> int:
        """Length of the longest proper prefix of stops[i][:q] that is also its suffix."""
        stop, border = self._stops[i], self._borders[i]
        while len(border) < q:  # extend the failure table by one entry (amortised O(1))
            j, k = len(border), border[-1]
            while k > 0 and stop[j] != stop[k]:
                k = border[k - 1]
            border.append(k + (stop[j] == stop[k]))
        return border[q - 1]

    def holdback(self, text: str) -> int:
        """The holdback for `text`, which must extend the text of the previous call."""
        new, self._read = text[self._read:], len(text)
        longest = 0
        for i, stop in enumerate(self._stops):
            q = self._states[i]
            for char in new:
                while q > 0 and stop[q] != char:
                    q = self._border(i, q)
                q += stop[q] == char
                if q == len(stop):  # the whole stop string: keep only what could start another
                    q = self._border(i, q)
            self._states[i] = q
            longest = max(longest, q)
        return longest
