"""Lesson 05 checker: your sampling pipeline against tinyinfer.sampling, the engine's own."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import CaseFailed, Checklist, expect_close, expect_equal, show
from tinyinfer.sampling import SamplingParams, probs_from_logits, sample_from_probs

checks = Checklist()

FIXED = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 0.25, -2.0])


def engine_probs(logits: np.ndarray, **params: float) -> np.ndarray:
    return probs_from_logits(logits, SamplingParams(**params))


def normalised(p: object, what: str) -> np.ndarray:
    """A filter's output scaled to sum 1 (filters may leave renormalising to the end)."""
    arr = np.asarray(p, dtype=np.float64)
    if arr.shape != FIXED.shape:
        raise CaseFailed(f"{what} should return a [V] array like its input", f"shape {FIXED.shape}", f"shape {arr.shape}")
    if not np.isfinite(arr).all() or arr.sum() <= 0:
        raise CaseFailed(f"{what} should keep at least one token with finite probability", got=show(arr))
    return arr / arr.sum()


def random_logits(rng: np.random.Generator, vocab: int = 50) -> np.ndarray:
    return 3 * rng.standard_normal(vocab)


@checks.case("temperatures 1, 0.5 and 2 on fixed logits", "softmax_with_temperature",
             "divide the logits by the temperature, subtract the max, exponentiate, divide by the sum")
def temperature_fixed(ex: ModuleType) -> None:
    for t in (1.0, 0.5, 2.0):
        expect_close(ex.softmax_with_temperature(FIXED, t), engine_probs(FIXED, temperature=t),
                     f"softmax_with_temperature(logits, {t})", rtol=1e-9, atol=1e-12)


@checks.case("temperature 0 is greedy, ties go to the lower id", "softmax_with_temperature",
             "temperature 0: a one-hot vector at np.argmax(logits), which picks the first maximum")
def temperature_zero(ex: ModuleType) -> None:
    tied = np.array([1.0, 4.0, 2.0, 4.0])
    for logits in (FIXED, tied):
        expect_close(ex.softmax_with_temperature(logits, 0.0), engine_probs(logits, temperature=0.0),
                     f"softmax_with_temperature({logits.tolist()}, 0)")


@checks.case("logits in the thousands do not overflow", "softmax_with_temperature",
             "np.exp(1000) is inf: subtract the largest logit first, which leaves softmax unchanged")
def temperature_large(ex: ModuleType) -> None:
    logits = FIXED * 500
    expect_close(ex.softmax_with_temperature(logits, 0.7), engine_probs(logits, temperature=0.7),
                 "softmax_with_temperature(500 x logits, 0.7)", rtol=1e-9, atol=1e-12)


@checks.case("k = 1, 3, 8 and 0 (off)", "top_k_filter",
             "keep = np.argsort(-logits, kind='stable')[:k]; zero every other token")
def top_k(ex: ModuleType) -> None:
    p = engine_probs(FIXED)
    for k in (1, 3, 8, 0):
        expect_close(normalised(ex.top_k_filter(p.copy(), FIXED, k), "top_k_filter"),
                     engine_probs(FIXED, top_k=k), f"top_k_filter(probs, logits, {k}), renormalised", rtol=1e-9)


@checks.case("top_p = 0.3, 0.75, 0.95 and 1 (off)", "top_p_filter",
             "sort by logit, cumsum the probabilities, keep through the first token whose cumsum reaches the target")
def top_p(ex: ModuleType) -> None:
    p = engine_probs(FIXED)
    for top in (0.3, 0.75, 0.95, 1.0):
        expect_close(normalised(ex.top_p_filter(p.copy(), FIXED, top), "top_p_filter"),
                     engine_probs(FIXED, top_p=top), f"top_p_filter(probs, logits, {top}), renormalised", rtol=1e-9)


@checks.case("top-p after top-k: probabilities that no longer sum to 1", "top_p_filter",
             "the target is top_p * probs.sum(), and tokens top-k zeroed must stay zero")
def top_p_after_k(ex: ModuleType) -> None:
    p = engine_probs(FIXED)
    kept = ex.top_k_filter(p.copy(), FIXED, 4)
    expect_close(normalised(ex.top_p_filter(np.asarray(kept, dtype=float), FIXED, 0.7), "top_p_filter"),
                 engine_probs(FIXED, top_k=4, top_p=0.7), "top_p_filter after top_k_filter(k=4), top_p=0.7", rtol=1e-9)


@checks.case("min_p = 0.05, 0.2 and 0 (off)", "min_p_filter",
             "threshold = min_p * probs.max(); keep probs >= threshold")
def min_p(ex: ModuleType) -> None:
    p = engine_probs(FIXED)
    for m in (0.05, 0.2, 0.0):
        expect_close(normalised(ex.min_p_filter(p.copy(), m), "min_p_filter"),
                     engine_probs(FIXED, min_p=m), f"min_p_filter(probs, {m}), renormalised", rtol=1e-9)


@checks.case("40 random logit vectors and settings (seed 1)", "processed_probs",
             "temperature first, then top-k, top-p, min-p in that order, then divide by the sum")
def pipeline(ex: ModuleType) -> None:
    rng = np.random.default_rng(1)
    for i in range(40):
        logits = random_logits(rng)
        params = dict(temperature=float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 5, 20])),
                      top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05, 0.3])))
        expect_close(ex.processed_probs(logits, **params), engine_probs(logits, **params),
                     f"processed_probs(random logits #{i}, {params})", rtol=1e-9, atol=1e-12)


@checks.case("the same seed draws the same token as the engine (seed 2)", "sample",
             "cdf = np.cumsum(probs); u = rng.random() * cdf[-1]; np.searchsorted(cdf, u, side='right')")
def draws(ex: ModuleType) -> None:
    rng = np.random.default_rng(2)
    for i in range(100):
        p = engine_probs(random_logits(rng, 20), top_k=int(rng.integers(0, 8)))
        seed = int(rng.integers(1 << 30))
        got = ex.sample(p, np.random.default_rng(seed))
        expect_equal(got, sample_from_probs(p, np.random.default_rng(seed)),
                     f"sample(probs #{i}, default_rng({seed}))")


@checks.case("one uniform number per draw", "sample",
             "call rng.random() exactly once: a second call shifts every later draw of the request")
def one_draw(ex: ModuleType) -> None:
    p = engine_probs(FIXED)
    rng, twin = np.random.default_rng(3), np.random.default_rng(3)
    ex.sample(p, rng)
    twin.random()
    expect_equal(rng.random(), twin.random(), "the generator's next number after one sample()")
