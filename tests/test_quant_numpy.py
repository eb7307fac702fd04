"""The reference runner's product with quantized weights (`quantized_matmul`) against the plain
definition, dequantize then multiply; the definition itself; and what the runner holds in memory."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

import tinyinfer
from tinyinfer.quant import (
    QuantConfig,
    QuantizedWeight,
    dequantize,
    group_offsets,
    quantize,
    stored_codes,
    weights_nbytes,
)
from tinyinfer.runners.numpy_ref import (
    CODE_PRODUCT_ROWS,
    NumpyRunner,
    linear,
    quantized_matmul,
)
from tinyinfer.runners.runner import make_batch

FORMATS = ["int8", "int8-g32", "int8-g64", "int4-g32", "int4-g64", "int4-g128", "int4-g32-asym",
           "int4-g64-asym", "int4-g32-min", "int4-g128-min"]
SHAPES = [(1, 1), (5, 70), (13, 129), (37, 200), (64, 256)]  # odd widths and ragged last groups
PROMPT = [3, 17, 42, 5, 99, 1, 250, 7, 64, 128, 11, 300, 2, 45, 77, 190, 23]


def random_weight(shape: tuple[int, int], fmt: str, seed: int) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    # A shifted, scaled Gaussian: one-sided groups give zero points and minimums far from 0.
    w = rng.standard_normal(shape) * rng.uniform(0.01, 2.0) + rng.uniform(-1.0, 1.0)
    return quantize(w.astype(np.float32), QuantConfig.parse(fmt))


def per_element(per_group: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    return np.repeat(per_group, qw.group_size, axis=1)[:, :qw.in_features]


def rounding_bound(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    """Sum of |every term| either order of summation adds up: codes times scales, and offsets."""
    scales = per_element(qw.scales.astype(np.float64), qw)
    terms = np.abs(stored_codes(qw)) * scales + np.abs(per_element(group_offsets(qw).astype(np.float64), qw))
    return np.abs(x.astype(np.float64)) @ terms.T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, CODE_PRODUCT_ROWS])
def test_code_product_is_dequantize_then_matmul(fmt, shape, rows):
    qw = random_weight(shape, fmt, seed=shape[0] * 1000 + shape[1])
    x = np.random.default_rng(rows).standard_normal((rows, shape[1]))
    bound = rounding_bound(x, qw)
    # float64: against code * scale + offset in float64 (exact: dequantize's float32 rounds the
    # "-min" sums), to ~1e-16 of the terms, so any difference in what is computed shows.
    weight = stored_codes(qw) * per_element(qw.scales.astype(np.float64), qw) + per_element(group_offsets(qw), qw)
    exact = x @ weight.T
    np.testing.assert_allclose(quantized_matmul(x, qw), exact, rtol=0, atol=1e-13 * bound.max())
    # float32 (the runner's default): the sums run in another order, within float32 rounding.
    x32 = x.astype(np.float32)
    got = quantized_matmul(x32, qw)
    assert got.dtype == np.float32 and got.shape == (rows, shape[0])
    np.testing.assert_array_less(np.abs(got - x32 @ dequantize(qw).T), 1e-5 * bound + 1e-30)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_multiplies_few_rows_by_codes_and_many_by_the_dequantized_weight(fmt):
    qw = random_weight((29, 97), fmt, seed=7)
    bias = np.random.default_rng(1).standard_normal(29).astype(np.float32)
    few = np.random.default_rng(2).standard_normal((CODE_PRODUCT_ROWS, 97)).astype(np.float32)
    many = np.random.default_rng(3).standard_normal((CODE_PRODUCT_ROWS + 1, 97)).astype(np.float32)
    np.testing.assert_array_equal(linear(few, qw, bias), quantized_matmul(few, qw) + bias)
    np.testing.assert_array_equal(linear(many, qw, bias), many @ dequantize(qw).T + bias)  # bit for bit


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_is_code_times_scale_plus_offset_bit_for_bit(fmt, shape):
    qw = random_weight(shape, fmt, seed=shape[1])
    scales = per_element(qw.scales.astype(np.float32), qw)
    definition = stored_codes(qw).astype(np.float32) * scales + per_element(group_offsets(qw), qw)
    got = dequantize(qw)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_array_equal(got.view(np.uint32), definition.view(np.uint32))


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g32-asym", "int4-g64-min"])
def test_codes_stored_in_any_memory_layout(fmt):
    """Checkpoints can hand over codes as transposed or strided views (GPT-2's Conv1D weights)."""
    qw = random_weight((12, 64), fmt, seed=5)
    strided = dataclasses.replace(qw, data=np.asfortranarray(qw.data))
    assert not strided.data.flags.c_contiguous
    np.testing.assert_array_equal(dequantize(strided), dequantize(qw))
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_array_equal(quantized_matmul(x, strided), quantized_matmul(x, qw))


def decode(runner: NumpyRunner, steps: int) -> list[np.ndarray]:
    """Prefill PROMPT (many rows), then greedy decode steps of one row each: every step's logits."""
    page_size = 16
    pages = list(range(4))
    kv = runner.new_kv_cache(len(pages), page_size)
    logits = [runner.forward(make_batch([(PROMPT, 0, pages, False)], page_size), kv)[0]]
    for i in range(steps):
        token = int(logits[-1].argmax())
        logits.append(runner.forward(make_batch([([token], len(PROMPT) + i, pages, False)], page_size), kv)[0])
    return logits


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g32-min"])
def test_quantized_decode_matches_the_dequantized_model(oracle_model, fmt):
    """Prefill (many rows) is the dequantized model bit for bit; decode steps (one row each, the
    code product) agree within float32 rounding and choose the same greedy tokens."""
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, quantize=fmt)
    as_float = {n: dequantize(w) if isinstance(w, QuantizedWeight) else w for n, w in model.runner.w.items()}
    ours, theirs = decode(model.runner, 8), decode(NumpyRunner(model.config, as_float), 8)
    np.testing.assert_array_equal(ours[0], theirs[0])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
        assert a.argmax() == b.argmax()


def test_runner_holds_the_codes_and_no_float_copy(oracle_model):
    """weight_bytes counts the codes, scales and offsets the runner holds; a decode step allocates
    at most one linear weight's converted codes at a time, not a float copy of the model."""
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, quantize="int4-g32")
    runner = model.runner
    held = {n: w for n, w in runner.w.items() if isinstance(w, QuantizedWeight)}
    assert runner.info.weight_bytes == weights_nbytes(runner.w)
    assert sum(w.nbytes for w in held.values()) == sum(
        sum(QuantConfig.parse("int4-g32").stored_bytes(*w.shape)) for w in held.values())
    float_linear = sum(4 * w.shape[0] * w.shape[1] for w in held.values())
    largest = max(4 * w.shape[0] * (w.num_groups * w.group_size) for w in held.values())
    decode(runner, 1)  # warm up
    tracemalloc.start()
    try:
        decode(runner, 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < float_linear / 2
    assert peak < 4 * largest + 64 * 1024  # codes as floats, their padded copy, small arrays
    assert all(runner.w[n] is w for n, w in held.items())  # still the stored codes after decoding
