"""Quantized models: the reference runner, int8 K/V, quantized checkpoints and `tinyinfer quantize`."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest

import tinyinfer
from tinyinfer.cli import quantize as cli_quantize
from tinyinfer.errors import CheckpointError, TinyInferError
from tinyinfer.quant import (
    QuantConfig,
    QuantizationError,
    QuantizedWeight,
    dequantize,
    memory_row,
    quantize,
    quantize_weights,
    save_quantized,
)
from tinyinfer.runners.numpy_ref import NumpyRunner, linear
from tinyinfer.weights import load_weights, read_safetensors

PROMPT = [3, 17, 42, 5, 99, 1, 250, 7, 64, 128, 11, 300, 2, 45, 77, 190, 23]
FORMATS = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int8-g32", "int4-g32-min"]


def run_quantize(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_quantize.add_parser(parser.add_subparsers(dest="command"))
    return cli_quantize.run(parser.parse_args(["quantize", *argv]))


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_linear_computes_the_dequantized_product():
    """Few rows multiply by the codes (equal to float32 rounding), many rows by the dequantized
    weight (bit for bit); tests/test_quant_numpy.py checks every format and odd shapes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 70)).astype(np.float32)
    w = rng.standard_normal((5, 70)).astype(np.float32)
    qw = quantize(w, QuantConfig(4, 32, symmetric=False))
    expected = x @ dequantize(qw).T
    np.testing.assert_allclose(linear(x[:3], qw), expected[:3], rtol=0, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_array_equal(linear(x, qw), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_computes_the_dequantized_model(oracle_model, fmt):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, quantize=fmt)
    assert model.quantization == QuantConfig.parse(fmt)
    weights = model.runner.w
    assert isinstance(weights["layers.0.q.weight"], QuantizedWeight)
    assert not isinstance(weights["lm_head"], QuantizedWeight)
    assert not isinstance(weights["embed"], QuantizedWeight)
    as_float = {n: dequantize(w) if isinstance(w, QuantizedWeight) else w for n, w in weights.items()}
    reference = NumpyRunner(model.config, as_float)
    expected = tinyinfer.Model(model.config, reference, folder, "dequantized").logits(PROMPT)
    np.testing.assert_array_equal(model.logits(PROMPT), expected)


def test_more_bits_stay_closer_to_the_float_model(oracle_model):
    folder, _ = oracle_model("gpt2")
    exact = tinyinfer.load(folder).logits(PROMPT)
    int8 = relative(tinyinfer.load(folder, quantize="int8").logits(PROMPT), exact)
    int4 = relative(tinyinfer.load(folder, quantize="int4-g32").logits(PROMPT), exact)
    assert 0 < int8 < int4 < 0.5


def test_int8_kv_cache_stores_codes_and_stays_close(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder)
    exact = model.logits(PROMPT)
    runner = NumpyRunner(model.config, load_weights(folder, model.config), kv_cache_dtype="int8")
    cache = runner.new_kv_cache(num_pages=4, page_size=8)
    assert cache.k[0].dtype == np.int8 and cache.k_scale is not None and cache.k_scale[0].shape == (4, 8, 2)
    quantized = tinyinfer.Model(model.config, runner, folder, "kv-int8").logits(PROMPT)
    assert 0 < relative(quantized, exact) < 0.02


def test_int8_kv_copy_page_copies_scales(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    config = tinyinfer.load(folder).config
    runner = NumpyRunner(config, load_weights(folder, config), kv_cache_dtype="int8")
    cache = runner.new_kv_cache(num_pages=3, page_size=4)
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((4, config.num_kv_heads, config.head_dim)).astype(np.float32)
    cache.write(0, np.arange(4), kv, -kv)
    runner.copy_page(cache, 0, 2)
    k, v = cache.gather(0, (2,), 4)
    original_k, original_v = cache.gather(0, (0,), 4)
    np.testing.assert_array_equal(k, original_k)
    np.testing.assert_array_equal(v, original_v)
    np.testing.assert_allclose(k, kv, atol=float(np.abs(kv).max()) / 127)


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name, argv, fmt", [
    ("llama-gqa-untied", ["--bits", "8"], "int8"),
    ("gpt2", ["--bits", "4", "--group-size", "32", "--asymmetric"], "int4-g32-asym"),
    ("qwen2-bias", ["--bits", "4"], "int4-g128"),
])
def test_quantized_checkpoint_loads_to_the_same_logits(oracle_model, tmp_path, capsys, name, argv, fmt):
    folder, _ = oracle_model(name)
    out = tmp_path / "quantized"
    assert run_quantize("--model", str(folder), *argv, "-o", str(out)) == 0
    assert fmt in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "quantization.json"} <= {p.name for p in out.iterdir()}
    saved = tinyinfer.load(out)
    assert saved.quantization == QuantConfig.parse(fmt)
    at_load = tinyinfer.load(folder, quantize=fmt)
    np.testing.assert_array_equal(saved.logits(PROMPT), at_load.logits(PROMPT))


def test_checkpoint_bytes_match_the_memory_table(oracle_model, tmp_path):
    folder, _ = oracle_model("llama-gqa-untied")
    config = tinyinfer.load(folder).config
    for fmt in FORMATS:
        quantized = quantize_weights(load_weights(folder, config), QuantConfig.parse(fmt))
        out = save_quantized(tmp_path / fmt, quantized, QuantConfig.parse(fmt), float_dtype="bfloat16")
        path = out / "model.safetensors"
        header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        assert path.stat().st_size - header == memory_row(config, fmt).total_bytes


def test_bfloat16_floats_round_trip(oracle_model, tmp_path):
    folder, _ = oracle_model("llama-mqa-tied")
    config = tinyinfer.load(folder).config
    weights = load_weights(folder, config)
    save_quantized(tmp_path, quantize_weights(weights, QuantConfig(8)), QuantConfig(8), "bfloat16")
    stored = read_safetensors(tmp_path / "model.safetensors")["embed"]
    np.testing.assert_allclose(stored, weights["embed"], rtol=2 ** -8)
    assert not np.array_equal(stored, weights["embed"])


def test_quantize_command_refuses_bad_requests(oracle_model, tmp_path):
    folder, _ = oracle_model("llama-gqa-untied")
    with pytest.raises(QuantizationError, match="int8 is symmetric"):
        run_quantize("--model", str(folder), "--bits", "8", "--asymmetric", "-o", str(tmp_path / "a"))
    with pytest.raises(QuantizationError, match="asymmetric int4 only"):
        run_quantize("--model", str(folder), "--bits", "8", "--minimum", "-o", str(tmp_path / "a"))
    with pytest.raises(QuantizationError, match="group size must be one of"):
        run_quantize("--model", str(folder), "--bits", "4", "--group-size", "48", "-o", str(tmp_path / "b"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(TinyInferError, match="not an empty folder"):
        run_quantize("--model", str(folder), "--bits", "8", "-o", str(tmp_path / "full"))
    run_quantize("--model", str(folder), "--bits", "8", "-o", str(tmp_path / "q"))
    with pytest.raises(TinyInferError, match="already quantized"):
        run_quantize("--model", str(tmp_path / "q"), "--bits", "4", "-o", str(tmp_path / "qq"))
    with pytest.raises(TinyInferError, match="already quantized as int8"):
        tinyinfer.load(tmp_path / "q", quantize="int4")
    with pytest.raises(QuantizationError, match="unknown quantization"):
        tinyinfer.load(folder, quantize="int3")


def test_damaged_quantized_checkpoints_are_reported(oracle_model, tmp_path):
    folder, _ = oracle_model("llama-gqa-untied")
    good = tmp_path / "good"
    run_quantize("--model", str(folder), "--bits", "4", "--group-size", "64", "-o", str(good))

    broken_config = tmp_path / "config"
    shutil.copytree(good, broken_config)
    (broken_config / "quantization.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="re-run tinyinfer quantize"):
        tinyinfer.load(broken_config)

    impossible = tmp_path / "impossible"
    shutil.copytree(good, impossible)
    meta = json.loads((impossible / "quantization.json").read_text())
    (impossible / "quantization.json").write_text(json.dumps({**meta, "bits": 3}))
    with pytest.raises(CheckpointError, match="corrupt.*bits must be 8 or 4"):
        tinyinfer.load(impossible)

    wrong_bits = tmp_path / "bits"
    shutil.copytree(good, wrong_bits)
    meta = json.loads((wrong_bits / "quantization.json").read_text())
    (wrong_bits / "quantization.json").write_text(json.dumps({**meta, "bits": 8, "group_size": None}))
    with pytest.raises(CheckpointError, match="layers.0.q.weight.qdata"):
        tinyinfer.load(wrong_bits)

    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    tensors = read_safetensors(good / "model.safetensors")
    del tensors["layers.1.down.weight.scales"]
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.down.weight.scales.*missing"):
        tinyinfer.load(missing)
