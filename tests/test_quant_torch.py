"""Quantized models on the torch runner: same logits and greedy tokens as the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinyinfer
from tinyinfer.quant import QuantConfig, dequantize, quantize
from tinyinfer.runners import torch_layers as layers

PROMPT = [3, 17, 42, 5, 99, 1, 250, 7, 64, 128, 11, 300, 2, 45, 77, 190, 23]
FORMATS = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int8-g32", "int4-g32-min"]


def relative(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def matmul_case(out: int, n: int, fmt: str, dtype: torch.dtype = torch.float32):
    """x, a quantized weight on the CPU in the runner's layout, and the reference product."""
    rng = np.random.default_rng(out * 1000 + n)
    x = rng.standard_normal((5, n)).astype(np.float32)
    qw = quantize(rng.standard_normal((out, n)).astype(np.float32), QuantConfig.parse(fmt))
    weight = layers.device_weight(qw, torch.device("cpu"), dtype)
    return torch.from_numpy(x).to(dtype), weight, x @ dequantize(qw).T


@pytest.mark.parametrize("fmt, shape, kind", [
    ("int8", (24, 40), layers.Int8Weight),
    ("int4-g32", (32, 96), layers.Int4Weight),  # whole groups, rows a multiple of 16: the kernel
    ("int4-g64-asym", (48, 128), layers.Int4Weight),
    ("int4-g32-min", (32, 96), layers.Int4Weight),  # GGUF's Q4_1: the kernel's own float zero
    ("int4-g32", (24, 96), layers.GroupWeight),  # rows not a multiple of 16
    ("int4-g64", (32, 160), layers.GroupWeight),  # ragged last group
    ("int4-g128-asym", (16, 77), layers.GroupWeight),  # odd width
    ("int4-g32-min", (24, 96), layers.GroupWeight),
    ("int8-g32", (24, 96), layers.GroupWeight),  # GGUF's Q8_0: no torch kernel takes groups
])
def test_each_matmul_path_computes_the_dequantized_product(fmt, shape, kind):
    x, weight, expected = matmul_case(*shape, fmt)
    assert isinstance(weight, kind)
    ours = layers.linear(x, weight, None).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_bias_is_added_after_the_quantized_product():
    x, weight, expected = matmul_case(32, 64, "int4-g32")
    bias = torch.arange(32, dtype=torch.float32)
    ours = layers.linear(x, weight, bias).numpy()
    np.testing.assert_allclose(ours, expected + bias.numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-untied", "gpt2", "qwen2-bias"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_runner_agrees_with_the_reference_on_quantized_models(oracle_model, name, fmt):
    folder, _ = oracle_model(name)
    reference = tinyinfer.load(folder, quantize=fmt)
    fast = tinyinfer.load(folder, quantize=fmt, runner="torch", device="cpu", dtype="float32")
    ref_logits, fast_logits = reference.logits(PROMPT), fast.logits(PROMPT)
    assert relative(fast_logits, ref_logits) < 1e-5
    np.testing.assert_array_equal(fast_logits.argmax(-1), ref_logits.argmax(-1))


def test_bf16_quantized_logits_track_the_reference(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    reference = tinyinfer.load(folder, quantize="int4-g32")
    fast = tinyinfer.load(folder, quantize="int4-g32", runner="torch", device="cpu", dtype="bfloat16")
    assert relative(fast.logits(PROMPT), reference.logits(PROMPT)) < 0.03


@pytest.mark.parametrize("fmt, dtype", [("int4-g32", "bfloat16"), ("int8", "float32"), (None, "float32")])
def test_cpu_default_dtype_is_bf16_for_int4_only(oracle_model, fmt, dtype):
    """torch's CPU int4 kernel is fast with bf16 activations only; everything else stays fp32."""
    folder, _ = oracle_model("llama-gqa-untied")
    fast = tinyinfer.load(folder, quantize=fmt, runner="torch", device="cpu")
    assert fast.runner.info.dtype == dtype


def test_engine_greedy_tokens_match_on_a_quantized_model(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    params = tinyinfer.SamplingParams(max_tokens=12, temperature=0)
    outputs = [tinyinfer.Engine(tinyinfer.load(folder, quantize="int4-g64-asym", **options))
               .generate([PROMPT, PROMPT[:5]], params) for options in ({}, {"runner": "torch", "device": "cpu", "dtype": "float32"})]
    reference, fast = ([c.token_ids for c in out] for out in outputs)
    assert fast == reference and all(len(ids) == 12 for ids in reference)


def test_quantized_checkpoint_runs_on_the_torch_runner(oracle_model, tmp_path):
    from tinyinfer.quant import quantize_weights, save_quantized
    from tinyinfer.weights import load_weights

    folder, _ = oracle_model("llama-mqa-tied")
    config = tinyinfer.load(folder).config
    qconfig = QuantConfig.parse("int4-g64-asym")
    save_quantized(tmp_path, quantize_weights(load_weights(folder, config), qconfig), qconfig)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    fast = tinyinfer.load(tmp_path, runner="torch", device="cpu", dtype="float32")
    reference = tinyinfer.load(folder, quantize=qconfig)
    assert relative(fast.logits(PROMPT), reference.logits(PROMPT)) < 1e-5


def test_only_linear_layers_and_the_head_may_arrive_quantized(oracle_model):
    from tinyinfer.errors import TinyInferError
    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.weights import load_weights

    folder, _ = oracle_model("llama-gqa-untied")
    config = tinyinfer.load(folder).config
    weights = load_weights(folder, config)
    weights["final_norm.weight"] = quantize(weights["final_norm.weight"][None, :], QuantConfig(8))
    with pytest.raises(TinyInferError, match="only the blocks' linear layers, the embedding and the LM head"):
        TorchRunner(config, weights, device="cpu")

