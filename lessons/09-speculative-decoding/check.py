"""Lesson 09 checker: your acceptance rule against tinyinfer.speculative.verify, draw for draw."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import Checklist, expect, expect_close, expect_equal
from tinyinfer.sampling import SamplingParams, probs_from_logits
from tinyinfer.scheduler import Sequence
from tinyinfer.speculative import Draft, verify

checks = Checklist()
V = 6


def engine_tokens(logits: np.ndarray, draft: list[int], q: np.ndarray | None, params: SamplingParams,
                  seed: int) -> list[int]:
    """What the engine's verify emits for this draft, with a generator seeded `seed`."""
    seq = Sequence(0, "check", [0], params, np.random.default_rng(seed))
    result = verify(logits, Draft(tuple(draft), None if q is None else tuple(q)), seq)
    return [c.token_id for c in result.choices]


def case_data(rng: np.random.Generator, k: int, greedy: bool) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Target logits [k + 1, V], draft distributions [k, V] and k guesses (some right, some wrong)."""
    logits = 2 * rng.standard_normal((k + 1, V))
    q = rng.dirichlet(np.ones(V), k)
    if greedy:
        draft = [int(np.argmax(logits[i])) if rng.random() < 0.7 else int(rng.integers(V)) for i in range(k)]
    else:
        draft = [int(rng.choice(V, p=q[i])) for i in range(k)]
    return logits, q, draft


@checks.case("all right, first wrong, third wrong", "accept_greedy",
             "copy guesses while they equal the target's choice; then emit the target's choice and stop")
def greedy_fixed(ex: ModuleType) -> None:
    choices = [5, 1, 4, 2]
    for draft in ([5, 1, 4], [0, 1, 4], [5, 1, 0]):
        logits = np.full((4, V), -5.0)
        logits[np.arange(4), choices] = 5.0
        expect_equal(list(ex.accept_greedy(choices, draft)),
                     engine_tokens(logits, draft, None, SamplingParams(temperature=0), 0),
                     f"accept_greedy({choices}, {draft})")


@checks.case("random drafts of 1 to 6 guesses (seed 1)", "accept_greedy",
             "all k accepted means k + 1 tokens: the bonus comes from target_choices[k]")
def greedy_random(ex: ModuleType) -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        logits, _, draft = case_data(rng, int(rng.integers(1, 7)), greedy=True)
        choices = [int(np.argmax(row)) for row in logits]
        expect_equal(list(ex.accept_greedy(choices, draft)),
                     engine_tokens(logits, draft, None, SamplingParams(temperature=0), 0),
                     f"accept_greedy({choices}, {draft})")


@checks.case("draft-model guesses: same seed, same tokens as the engine (seed 2)", "accept_sampled",
             "one rng.random() per test in order; on rejection sample from normalised max(0, p - q)")
def sampled_random(ex: ModuleType) -> None:
    rng = np.random.default_rng(2)
    params = SamplingParams(temperature=1.0)
    for n in range(60):
        logits, q, draft = case_data(rng, int(rng.integers(1, 6)), greedy=False)
        p = np.stack([probs_from_logits(row, params) for row in logits])
        seed = int(rng.integers(1 << 30))
        got = ex.accept_sampled(p, q, list(draft), np.random.default_rng(seed))
        expect_equal(list(got), engine_tokens(logits, draft, q, params, seed),
                     f"accept_sampled, case {n} (k={len(draft)}, draft {draft}, rng seed {seed})")


@checks.case("prompt-lookup guesses: q is one-hot (seed 3)", "accept_sampled",
             "a deterministic guess has q[d] = 1, so it is accepted with probability p[d]")
def sampled_one_hot(ex: ModuleType) -> None:
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.8)
    for n in range(30):
        k = int(rng.integers(1, 5))
        logits = 2 * rng.standard_normal((k + 1, V))
        draft = rng.integers(0, V, k).tolist()
        q = np.eye(V)[draft]
        p = np.stack([probs_from_logits(row, params) for row in logits])
        seed = int(rng.integers(1 << 30))
        expect_equal(list(ex.accept_sampled(p, q, draft, np.random.default_rng(seed))),
                     engine_tokens(logits, draft, None, params, seed),
                     f"accept_sampled with one-hot q, case {n} (draft {draft}, rng seed {seed})")


@checks.case("the first emitted token follows the target's p, whatever q is (4000 draws)", "accept_sampled",
             "accepting with min(1, p/q) and resampling from max(0, p - q) together reproduce p exactly")
def sampled_distribution(ex: ModuleType) -> None:
    p = np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.1, 0.2, 0.3, 0.4]])
    rng = np.random.default_rng(4)
    n = 4000
    counts = np.zeros(4)
    for _ in range(n):
        d = int(rng.choice(4, p=q[0]))
        counts[ex.accept_sampled(p, q, [d], rng)[0]] += 1
    sigma = np.sqrt(p[0] * (1 - p[0]) / n)
    expect(bool(np.all(np.abs(counts / n - p[0]) < 5 * sigma)),
           "the first token's frequencies are not the target's distribution",
           f"expected about {p[0].tolist()}, got {np.round(counts / n, 3).tolist()}")


@checks.case("acceptance 0, 0.7 and 1 at k = 4, and 0.5 at k = 1", "expected_tokens_per_step",
             "(1 - a ** (k + 1)) / (1 - a); with a = 1 every guess survives: k + 1")
def expected(ex: ModuleType) -> None:
    for a, k in ((0.0, 4), (0.7, 4), (1.0, 4), (0.5, 1)):
        want = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
        expect_close(ex.expected_tokens_per_step(a, k), want, f"expected_tokens_per_step({a}, {k})")
