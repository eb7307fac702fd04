"""Tests for tinyinfer.sampling: params, penalties, filters, seeded sampling, stop strings."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinyinfer.errors import SamplingParamsError, TinyInferError
from tinyinfer.sampling import (
    MAX_LOGPROBS,
    TUI_TOP_CANDIDATES,
    SamplingParams,
    StopHoldback,
    TokenChoice,
    apply_penalties,
    find_stop,
    log_softmax,
    make_rng,
    probs_from_logits,
    sample_from_probs,
    sample_next,
)


def softmax(x: np.ndarray) -> np.ndarray:
    """Plain softmax written independently of the module under test."""
    e = np.exp(x - np.max(x))
    return e / e.sum()


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert p.max_tokens == 64 and p.temperature == 1.0 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_normalises_stop_and_numbers():
    p = SamplingParams(
        stop=["\n", "END"], stop_token_ids=[2, np.int64(7)], temperature=1, seed=np.int64(3)
    )
    assert p.stop == ("\n", "END")
    assert p.stop_token_ids == (2, 7) and all(type(i) is int for i in p.stop_token_ids)
    assert type(p.temperature) is float and type(p.seed) is int
    assert SamplingParams(stop="###").stop == ("###",)


def test_params_are_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


INVALID = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": False}, "max_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 1e-310}, "repetition_penalty"),  # would overflow logits to +inf
    ({"repetition_penalty": 1e300}, "repetition_penalty"),  # would send seen logits to -inf
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": None}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID, ids=[f"{n}={k[n]!r}" for k, n in INVALID])
def test_invalid_params_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert name in message
    assert "(got " in message and str(kwargs[name]).strip("[]") in message  # the bad value is shown
    assert isinstance(info.value, TinyInferError)


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, temperature=0.0, logprobs=20, min_tokens=64)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, logprobs=0, seed=0, max_tokens=1)


# ---------------------------------------------------------------- penalties


LOGITS = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(LOGITS, params, prompt_ids=[0], output_ids=[1, 3, 3])
    np.testing.assert_allclose(out, [1.0, -2.0, 0.5, 1.5])


def test_frequency_and_presence_count_output_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(LOGITS, params, prompt_ids=[0, 2, 2], output_ids=[1, 3, 3])
    # token 1 seen once: -1 - 0.5 - 0.25; token 3 seen twice: 3 - 1.0 - 0.25; prompt ignored
    np.testing.assert_allclose(out, [2.0, -1.75, 0.5, 1.75])


def test_all_penalties_together_match_hand_computation():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    logits = LOGITS.copy()
    out = apply_penalties(logits, params, prompt_ids=[0], output_ids=[1, 3, 3])
    np.testing.assert_allclose(out, [1.0, -2.75, 0.5, 0.25])
    assert out.dtype == np.float64
    np.testing.assert_array_equal(logits, LOGITS)  # input untouched


def test_no_penalties_return_an_equal_copy():
    out = apply_penalties(LOGITS, SamplingParams(), [0, 1], [3])
    np.testing.assert_array_equal(out, LOGITS)
    assert out is not LOGITS


def test_penalties_reject_out_of_vocab_ids():
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(LOGITS, SamplingParams(frequency_penalty=1.0), [], [4])


# ---------------------------------------------------------------- processed distribution


def test_neutral_params_leave_softmax_unchanged():
    x = (np.random.default_rng(0).normal(size=300) * 4).astype(np.float32)
    neutral = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    p = probs_from_logits(x, neutral)
    np.testing.assert_allclose(p, softmax(x.astype(np.float64)), rtol=1e-12, atol=0)
    assert p.dtype == np.float64


def test_temperature_scales_logits():
    x = np.array([1.0, 2.0, 4.0])
    p = probs_from_logits(x, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(p, softmax(x / 0.5))
    # a tiny temperature is numerically safe and approaches argmax
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(temperature=1e-300)), [0, 0, 1])


def test_top_k_keeps_k_best_with_ties_to_lowest_id():
    x = np.array([1.0, 3.0, 2.0, 3.0, 2.0])
    p = probs_from_logits(x, SamplingParams(top_k=3))
    expected = np.array([0, np.e**3, np.e**2, np.e**3, 0]) / (2 * np.e**3 + np.e**2)
    np.testing.assert_allclose(p, expected)


def test_top_p_keeps_smallest_set_reaching_mass():
    x = np.log(np.array([0.1, 0.5, 0.25, 0.15]))
    three = [0, 0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9]
    two = [0, 2 / 3, 1 / 3, 0]
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(top_p=0.75)), two)
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(top_p=0.76)), three)
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(top_p=0.01)), [0, 1, 0, 0])


def test_min_p_keeps_tokens_above_fraction_of_max():
    x = np.log(np.array([0.1, 0.5, 0.25, 0.15]))
    three = [0, 0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9]
    two = [0, 2 / 3, 1 / 3, 0]
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(min_p=0.35)), two)
    np.testing.assert_allclose(probs_from_logits(x, SamplingParams(min_p=0.3)), three)


def test_greedy_is_one_hot_at_first_argmax():
    x = np.array([0.5, 2.0, -np.inf, 2.0])
    np.testing.assert_array_equal(probs_from_logits(x, SamplingParams(temperature=0)), [0, 1, 0, 0])


def test_neg_inf_logits_get_zero_probability():
    x = np.array([-np.inf, 0.0, -np.inf, 1.0])
    p = probs_from_logits(x, SamplingParams())
    assert p[0] == 0 and p[2] == 0
    np.testing.assert_allclose(p[[1, 3]], softmax(np.array([0.0, 1.0])))


@pytest.mark.parametrize(
    "bad", [np.array([0.0, np.nan]), np.array([np.inf, 0.0]), np.full(3, -np.inf), np.zeros((2, 2))]
)
def test_invalid_logits_are_rejected(bad):
    with pytest.raises(ValueError):
        probs_from_logits(bad, SamplingParams())


finite_logits = hnp.arrays(
    np.float64,
    st.integers(1, 40),
    elements=st.floats(-20, 20, allow_nan=False, allow_infinity=False),
)

# Big, flat vocabularies: the nucleus then holds hundreds of tokens, past the first window
# that the top-p search sorts, so the widening path runs too.
wide_logits = hnp.arrays(
    np.float64,
    st.integers(100, 3000),
    elements=st.floats(-3, 3, allow_nan=False, allow_infinity=False),
)


@st.composite
def logits_some_neg_inf(draw):
    """Logit vectors where some (never all) entries are -inf, as masks produce."""
    x = draw(finite_logits)
    mask = np.array(draw(st.lists(st.booleans(), min_size=x.size, max_size=x.size)))
    mask[int(np.argmax(x))] = False
    x[mask] = -np.inf
    return x


filter_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)


def _check_common(p: np.ndarray, x: np.ndarray) -> None:
    """Invariants every processed distribution has: sums to 1, non-empty, no -inf token."""
    assert p.shape == x.shape
    assert np.all(p >= 0)
    assert math.isclose(p.sum(), 1.0, rel_tol=1e-12)
    assert np.count_nonzero(p) >= 1
    assert np.all(p[np.isneginf(x)] == 0)
    kept = p > 0
    if not kept.all():  # the filters cut from the bottom: nothing dropped outranks a survivor
        dropped = ~kept & np.isfinite(x)
        if dropped.any():
            assert x[kept].min() >= x[dropped].max()


@settings(max_examples=100, deadline=None)
@given(x=logits_some_neg_inf(), params=filter_params, seed=st.integers(0, 2**32))
def test_filters_property(x, params, seed):
    p = probs_from_logits(x, params)
    _check_common(p, x)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        assert p[sample_from_probs(p, rng)] > 0  # an excluded token is never sampled


@settings(max_examples=100, deadline=None)
@given(x=finite_logits, k=st.integers(1, 45))
def test_top_k_property(x, k):
    p = probs_from_logits(x, SamplingParams(top_k=k))
    _check_common(p, x)
    assert np.count_nonzero(p) == min(k, x.size)


@settings(max_examples=100, deadline=None)
@given(x=st.one_of(finite_logits, wide_logits), top_p=st.floats(0.01, 1.0))
def test_top_p_property(x, top_p):
    p = probs_from_logits(x, SamplingParams(top_p=top_p))
    _check_common(p, x)
    full = softmax(x)
    kept = np.flatnonzero(p > 0)
    mass = full[kept].sum()
    assert mass >= top_p - 1e-9  # the nucleus reaches top_p
    assert mass - full[kept].min() < top_p + 1e-9  # and dropping its weakest member would not
    np.testing.assert_allclose(p[kept], full[kept] / mass, rtol=1e-9)


@settings(max_examples=100, deadline=None)
@given(x=finite_logits, min_p=st.floats(0.0, 1.0))
def test_min_p_property(x, min_p):
    p = probs_from_logits(x, SamplingParams(min_p=min_p))
    _check_common(p, x)
    full = softmax(x)
    threshold = min_p * full.max()
    assert np.all(full[p > 0] >= threshold * (1 - 1e-12))
    assert np.all(full[p == 0] < threshold * (1 + 1e-12))


# ---------------------------------------------------------------- drawing tokens


def test_sample_from_probs_follows_probs_chi_square():
    """Chi-square goodness of fit at significance 0.001 (critical value 20.515 for 5 d.o.f.)."""
    probs = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    n = 20_000
    rng = np.random.default_rng(1234)
    counts = np.bincount([sample_from_probs(probs, rng) for _ in range(n)], minlength=probs.size)
    expected = probs * n
    critical = 20.515
    assert ((counts - expected) ** 2 / expected).sum() < critical
    # the same counts are far from a different distribution, so the test has power
    wrong = np.array([0.10, 0.10, 0.10, 0.20, 0.25, 0.25]) * n
    assert ((counts - wrong) ** 2 / wrong).sum() > critical


def test_sample_from_probs_uses_exactly_one_draw():
    rng, twin = make_rng(5), make_rng(5)
    sample_from_probs(np.array([0.2, 0.3, 0.5]), rng)
    twin.random()
    assert rng.random() == twin.random()


def test_sample_from_probs_never_picks_zero_mass_token():
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    rng = make_rng(0)
    assert {sample_from_probs(probs, rng) for _ in range(500)} == {1, 3}


def test_sample_from_probs_rejects_bad_input():
    with pytest.raises(ValueError):
        sample_from_probs(np.array([0.5, -0.1, 0.6]), make_rng(0))
    with pytest.raises(ValueError):
        sample_from_probs(np.zeros(3), make_rng(0))


def _generate(seed: int | None, steps: int = 200) -> list[int]:
    """Sample a token stream from fixed logits, feeding outputs back for the penalties."""
    vocab = np.random.default_rng(99).normal(size=(steps, 50)) * 2
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, frequency_penalty=0.3, seed=seed)
    rng = make_rng(params.seed)
    out: list[int] = []
    for logits in vocab:
        out.append(sample_next(logits, params, [1, 2, 3], out, rng).token_id)
    return out


def test_same_seed_same_tokens_different_seed_different_tokens():
    a = _generate(7)
    assert a == _generate(7)
    assert a != _generate(8)
    assert len(set(a)) > 5  # genuinely random, not stuck on one token


def test_greedy_is_argmax_and_draws_nothing():
    rng = make_rng(3)
    state = rng.bit_generator.state
    logits = np.random.default_rng(1).normal(size=100)
    choice = sample_next(logits, SamplingParams(temperature=0.0), [], [], rng)
    assert choice.token_id == int(np.argmax(logits))
    assert rng.bit_generator.state == state
    tie = np.array([0.0, 5.0, 1.0, 5.0])
    assert sample_next(tie, SamplingParams(temperature=0.0), [], [], rng).token_id == 1


def test_make_rng_without_seed_is_fresh():
    draws = {make_rng(None).integers(2**62) for _ in range(4)}
    assert len(draws) == 4


# ---------------------------------------------------------------- sample_next details


def test_token_choice_reports_raw_logprob_and_processed_top():
    x = np.log(np.array([0.1, 0.4, 0.3, 0.2]))
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2)
    choice = sample_next(x, params, [1], [], make_rng(0))
    assert isinstance(choice, TokenChoice)
    # repetition penalty pushes token 1 below token 2; logprob is still the raw model's
    assert choice.token_id == 2
    assert math.isclose(choice.logprob, math.log(0.3), rel_tol=1e-12)
    assert choice.top == ((2, 1.0),)
    ids = [i for i, _ in choice.top_logprobs]
    assert ids == [1, 2]
    np.testing.assert_allclose([lp for _, lp in choice.top_logprobs], np.log([0.4, 0.3]))


def test_top_candidates_sorted_and_sized():
    x = np.random.default_rng(4).normal(size=64)
    rng = make_rng(0)
    default = sample_next(x, SamplingParams(), [], [], rng)
    assert len(default.top) == TUI_TOP_CANDIDATES and default.top_logprobs == ()
    probs = [q for _, q in default.top]
    assert probs == sorted(probs, reverse=True)
    assert [i for i, _ in default.top] == list(np.argsort(-x)[:TUI_TOP_CANDIDATES])
    assert default.prob == pytest.approx(probs_from_logits(x, SamplingParams())[default.token_id])
    many = sample_next(x, SamplingParams(logprobs=MAX_LOGPROBS), [], [], rng)
    assert len(many.top) == len(many.top_logprobs) == MAX_LOGPROBS > TUI_TOP_CANDIDATES
    best_raw = np.sort(log_softmax(x))[::-1][:MAX_LOGPROBS]
    np.testing.assert_allclose([lp for _, lp in many.top_logprobs], best_raw)
    assert sample_next(x, SamplingParams(logprobs=0), [], [], rng).top_logprobs == ()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = np.array([0.0, 0.0, 10.0, 9.0, 1.0])  # eos=2 and stop id 3 dominate
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3, 1000))
    early = sample_next(x, params, [], [4], make_rng(0), eos_token_id=2)
    assert early.token_id == 4
    assert sample_next(x, params, [], [4, 4], make_rng(0), eos_token_id=2).token_id == 2
    # without an eos id only the stop ids are masked
    assert sample_next(x, params, [], [], make_rng(0)).token_id == 2


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world", ["world"], 6),
        ("hello world", ["xyz"], None),
        ("hello world", [], None),
        ("a.b\nc", ["\n", "."], 1),
        ("abcabc", ["bc", "ca"], 1),
        ("stop at start", ["stop"], 0),
    ],
)
def test_find_stop(text, stops, expected):
    assert find_stop(text, stops) == expected


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello wor", ["world"], 3),
        ("hello", ["world"], 0),
        ("hello w", ["world", "wo"], 1),
        ("x<|e", ["<|end|>", "|e"], 3),
        ("ab", ["abcdef"], 2),
        ("", ["abc"], 0),
        ("end", ["x"], 0),  # one-character stops are found whole, never held back
    ],
)
def test_stop_holdback(text, stops, expected):
    assert StopHoldback(stops).holdback(text) == expected


def test_stop_holdback_follows_a_growing_text():
    """Fed piece by piece, the automaton agrees with a from-scratch answer at every length."""
    stops = ["abab", "abac", "bb", "aab"]
    text = "abababacabbaababaabab"
    growing = StopHoldback(stops)
    for end in range(len(text) + 1):
        assert growing.holdback(text[:end]) == StopHoldback(stops).holdback(text[:end]), end
        longest = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])),
                      default=0)
        assert growing.holdback(text[:end]) == longest


@pytest.mark.parametrize("logprobs", [None, 0, 3])
def test_greedy_shortcuts_equal_the_full_pipeline(logprobs):
    """The engine's greedy fast paths (full row, or top-k from the device) report the same choice."""
    from tinyinfer.sampling import greedy_choice, greedy_choices_from_top, is_plain_greedy

    rng = np.random.default_rng(5)
    logits = rng.normal(size=500).astype(np.float32) * 4
    params = SamplingParams(temperature=0, logprobs=logprobs)
    assert is_plain_greedy(params, 0, 20)
    full = sample_next(logits, params, [1, 2], [], np.random.default_rng(0))
    quick = greedy_choice(logits, params)
    assert (quick.token_id, quick.top) == (full.token_id, full.top)
    assert quick.logprob == pytest.approx(full.logprob, rel=1e-9)
    assert [t for t, _ in quick.top_logprobs] == [t for t, _ in full.top_logprobs]
    assert [v for _, v in quick.top_logprobs] == pytest.approx([v for _, v in full.top_logprobs])
    order = np.argsort(-logits)[:20]
    lse = float(np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) + logits.max())
    from_top, second = greedy_choices_from_top(np.stack([order, order[::-1]]),
                                               np.stack([logits[order], logits[order][::-1]]),
                                               np.array([lse, lse]), [params, params])
    assert second.token_id == order[-1]  # each row reports its own first id
    assert from_top.token_id == full.token_id and from_top.top == full.top
    assert from_top.logprob == pytest.approx(full.logprob, rel=1e-6)
    assert [t for t, _ in from_top.top_logprobs] == [t for t, _ in full.top_logprobs]
    assert not is_plain_greedy(SamplingParams(temperature=0, repetition_penalty=1.2), 0, 20)
    assert not is_plain_greedy(SamplingParams(temperature=0.5), 0, 20)
