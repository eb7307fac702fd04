"""Quantization formats: packing, round trips and their error bounds, KV codes, memory table."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyinfer.config import config_from_dict
from tinyinfer.quant import (GROUP_SIZES, QuantConfig, QuantizationError, codes_and_zeros, concat_out,
                             dequantize, dequantize_kv, error_histograms, format_memory_table, histogram,
                             layer_error, memory_row, pack_int4, quantize, quantize_kv, stored_codes, unpack_int4,
                             weight_memory_table)

FORMATS = ([QuantConfig(8), QuantConfig(8, 32)]
           + [QuantConfig(4, g, sym) for g in GROUP_SIZES for sym in (True, False)]
           + [QuantConfig(4, 32, symmetric=False, minimum=True)])

LLAMA_2_7B = {  # config.json of meta-llama/Llama-2-7b-hf
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
}


def per_element_scale(qw) -> np.ndarray:
    """Each weight's own scale.  -> [out, in]."""
    return np.repeat(qw.scales.astype(np.float32), qw.group_size, axis=1)[:, :qw.in_features]


def weights_strategy(max_in: int = 300):
    """2-D float32 weights of any small shape, values spanning signs, zeros and magnitudes."""
    shapes = st.tuples(st.integers(1, 6), st.integers(1, max_in))
    values = st.floats(-1e3, 1e3, width=32, allow_subnormal=False)
    return hnp.arrays(np.float32, shapes, elements=values)


# ---------------------------------------------------------------- packing


def test_pack_int4_layout_is_low_nibble_first():
    packed = pack_int4(np.array([[1, 2, 3]]))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [[0x21, 0x03]]  # odd length: the last byte's high nibble is padding


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 5), st.integers(1, 257)), elements=st.integers(0, 15)))
def test_pack_unpack_round_trip(codes):
    packed = pack_int4(codes)
    assert packed.shape == (codes.shape[0], math.ceil(codes.shape[1] / 2))
    np.testing.assert_array_equal(unpack_int4(packed, codes.shape[1]), codes)


def test_pack_rejects_codes_outside_a_nibble():
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(np.array([3, 16]))


# ---------------------------------------------------------------- round trips


@settings(max_examples=60, deadline=None)
@given(w=weights_strategy(), fmt=st.sampled_from(FORMATS))
def test_round_trip_error_is_at_most_half_a_scale_step(w, fmt):
    qw = quantize(w, fmt)
    out, n = w.shape
    groups = math.ceil(n / (fmt.group_size or n))
    assert qw.shape == (out, n) and qw.scales.shape == (out, groups) and qw.scales.dtype == np.float16
    if fmt.bits == 8:
        assert qw.data.dtype == np.int8 and qw.data.shape == (out, n)
    else:
        assert qw.data.dtype == np.uint8 and qw.data.shape == (out, math.ceil(n / 2))
    assert (qw.zeros is None) == (fmt.symmetric or fmt.minimum)
    assert (qw.mins is None) == (not fmt.minimum)
    qmin, qmax = (-128, 127) if fmt.bits == 8 else (0, 15)
    if fmt.minimum:
        codes = stored_codes(qw)
        assert np.all(qw.mins.astype(np.float32) <= np.minimum.reduceat(w, range(0, n, fmt.group_size), axis=1))
    else:
        codes, zeros = codes_and_zeros(qw)
        assert zeros.min() >= qmin and zeros.max() <= qmax
    assert codes.min() >= qmin and codes.max() <= qmax
    error = np.abs(dequantize(qw) - w)
    bound = per_element_scale(qw) / 2
    assert np.all(error <= bound * (1 + 1e-5) + 1e-30)


@settings(max_examples=30, deadline=None)
@given(w=weights_strategy())
def test_int8_is_per_output_channel(w):
    qw = quantize(w, QuantConfig(8))
    assert qw.scales.shape == (w.shape[0], 1)
    # A row's scale is sized by that row alone: its largest magnitude lands on the code grid's end.
    amax = np.abs(w).max(axis=1).astype(np.float64)
    scales = qw.scales[:, 0].astype(np.float64)
    assert np.all(scales >= amax / 128) and np.all(scales <= amax / 127 * (1 + 2 ** -10) + 2 ** -24)
    changed = w.copy()
    changed[0] = 7.0
    np.testing.assert_array_equal(quantize(changed, QuantConfig(8)).scales[1:], qw.scales[1:])


@pytest.mark.parametrize("group", GROUP_SIZES)
def test_ragged_last_group_has_its_own_scale(group):
    rng = np.random.default_rng(group)
    n = 2 * group + 7  # two full groups and a short one
    w = rng.standard_normal((3, n)).astype(np.float32)
    qw = quantize(w, QuantConfig(4, group))
    assert qw.num_groups == 3
    bumped = w.copy()
    bumped[:, 0] = 100.0  # only the first group's range changes
    qb = quantize(bumped, QuantConfig(4, group))
    np.testing.assert_array_equal(qb.scales[:, 1:], qw.scales[:, 1:])
    assert np.all(qb.scales[:, 0] > qw.scales[:, 0])
    tail = w[:, 2 * group:]
    expected = np.maximum(-np.minimum(tail.min(1), 0) / 8, np.maximum(tail.max(1), 0) / 7)
    np.testing.assert_allclose(qw.scales[:, 2].astype(np.float32), expected, rtol=2 ** -10)


def test_smaller_groups_and_more_bits_lose_less():
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    errors = {fmt.name: layer_error("w", w, quantize(w, fmt)).relative for fmt in FORMATS}
    assert errors["int8"] < errors["int4-g32"] < errors["int4-g64"] < errors["int4-g128"]
    assert errors["int8"] < 0.01 < errors["int4-g32"] < 0.15


def test_asymmetric_groups_fit_one_sided_weights_better():
    w = np.random.default_rng(1).uniform(0.5, 1.5, (16, 128)).astype(np.float32)
    sym = layer_error("w", w, quantize(w, QuantConfig(4, 64))).relative
    asym = layer_error("w", w, quantize(w, QuantConfig(4, 64, symmetric=False))).relative
    assert asym < sym / 1.5


def test_zero_rows_quantize_to_exact_zeros():
    w = np.zeros((2, 70), np.float32)
    w[1, 3] = -0.5
    for fmt in FORMATS:
        qw = quantize(w, fmt)
        assert np.all(qw.scales[0] == 0)
        np.testing.assert_array_equal(dequantize(qw)[0], 0.0)
        assert dequantize(qw)[1, 3] == pytest.approx(-0.5, abs=float(qw.scales.max()) / 2)


def test_concat_out_matches_quantizing_each_part():
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal((n, 96)).astype(np.float32) for n in (4, 2, 2)]
    fmt = QuantConfig(4, 32, symmetric=False)
    fused = concat_out([quantize(p, fmt) for p in parts])
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(quantize(p, fmt)) for p in parts]))


def test_bad_weights_are_refused():
    with pytest.raises(QuantizationError, match="2-D"):
        quantize(np.ones(8, np.float32), QuantConfig(8))
    with pytest.raises(QuantizationError, match="NaN"):
        quantize(np.array([[1.0, np.nan]], np.float32), QuantConfig(8))
    with pytest.raises(QuantizationError, match="float16 scale"):
        quantize(np.array([[1e9, 1.0]], np.float32), QuantConfig(8))


# ---------------------------------------------------------------- formats by name


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_names_round_trip(fmt):
    assert QuantConfig.parse(fmt.name) == fmt


def test_int4_defaults_to_groups_of_128():
    assert QuantConfig.parse("int4") == QuantConfig(4, 128)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), "bits must be 8 or 4"),
    (dict(bits=4, group_size=16), "group size must be one of"),
    (dict(bits=4), "group size must be one of"),
    (dict(bits=8, group_size=16), "group size must be one of"),
    (dict(bits=8, symmetric=False), "int8 is symmetric"),
    (dict(bits=4, group_size=32, minimum=True), "asymmetric int4 only"),
    (dict(bits=8, minimum=True), "asymmetric int4 only"),
])
def test_bad_formats_say_what_to_use(kwargs, message):
    with pytest.raises(QuantizationError, match=message):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("name", ["int5", "int4-g48", "int4-g64-sym", "fp8", "int8-g48", "int8-asym"])
def test_unknown_names_are_refused(name):
    with pytest.raises(QuantizationError):
        QuantConfig.parse(name)


# ---------------------------------------------------------------- int8 KV


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 40)),
                  elements=st.floats(-300, 300, width=32)))
def test_kv_codes_are_within_half_a_step_per_token_and_head(x):
    codes, scales = quantize_kv(x)
    assert codes.dtype == np.int8 and codes.shape == x.shape
    assert scales.dtype == np.float16 and scales.shape == x.shape[:2]
    error = np.abs(dequantize_kv(codes, scales) - x)
    assert np.all(error <= scales.astype(np.float32)[..., None] / 2 * (1 + 1e-5) + 1e-30)


# ---------------------------------------------------------------- statistics


def test_error_statistics_and_histograms():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 100)).astype(np.float32)
    qw = quantize(w, QuantConfig(4, 32))
    err = w.astype(np.float64) - dequantize(qw)
    stats = layer_error("layers.0.q.weight", w, qw)
    assert stats.relative == pytest.approx(np.linalg.norm(err) / np.linalg.norm(w))
    assert stats.max_abs == pytest.approx(np.abs(err).max())
    assert stats.max_abs <= float(qw.scales.max()) / 2 * (1 + 1e-5)
    weights_hist, errors_hist = error_histograms(w, qw, bins=21)
    assert sum(weights_hist.counts) == sum(errors_hist.counts) == w.size
    assert len(errors_hist.edges) == 22
    assert weights_hist.edges[0] == pytest.approx(w.min()) and weights_hist.edges[-1] == pytest.approx(w.max())
    assert max(abs(errors_hist.edges[0]), abs(errors_hist.edges[-1])) <= stats.max_abs * (1 + 1e-6)
    assert histogram(np.array([0.0, 1.0, 1.0]), bins=2).counts == (1, 2)


# ---------------------------------------------------------------- memory


def test_llama2_7b_table_reproduces_claim_c11():
    """C11: a 7B model is ~14 GB at 16-bit and ~4 GB at 4-bit, counted from the real config."""
    config = config_from_dict(LLAMA_2_7B)
    rows = {r.format: r for r in weight_memory_table(config)}
    assert rows["bf16"].total_bytes == 2 * config.num_parameters == 13_476_831_232
    assert rows["fp32"].total_bytes == 4 * config.num_parameters
    assert 13e9 < rows["bf16"].total_bytes < 14.5e9
    assert 3.5e9 < rows["int4-g128"].total_bytes < 4.0e9
    assert 6.5e9 < rows["int8"].total_bytes < 7.2e9
    # Smaller groups cost more scales: 16 bits per group over 128, 64, 32 weights.
    g128, g64, g32 = (rows[f"int4-g{g}"].overhead_bytes for g in (128, 64, 32))
    assert g64 == 2 * g128 and g32 == 2 * g64
    assert rows["int4-g128-asym"].total_bytes > rows["int4-g128"].total_bytes
    text = format_memory_table(list(rows.values())).splitlines()
    assert text[2].split()[:4] == ["bf16", "13.48", "GB", "16.00"]
    assert text[4].split()[:4] == ["int4-g128", "3.86", "GB", "4.59"]


def test_memory_row_counts_every_quantized_byte():
    config = config_from_dict({**LLAMA_2_7B, "hidden_size": 64, "intermediate_size": 100,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "vocab_size": 50})
    from tinyinfer.quant import is_quantized_name
    from tinyinfer.weights import internal_shapes

    rng = np.random.default_rng(4)
    shapes = internal_shapes(config)
    for fmt in FORMATS:
        quantized = [quantize(rng.standard_normal(s).astype(np.float32), fmt)
                     for name, s in shapes.items() if is_quantized_name(name)]
        row = memory_row(config, fmt.name)
        assert row.linear_bytes + row.overhead_bytes == sum(q.nbytes for q in quantized)
        assert row.parameters == config.num_parameters
