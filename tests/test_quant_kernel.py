"""The Triton int8 / int4 product kernels: their arithmetic pinned to the reference's dequantize.

Three levels: the kernels' layout and arithmetic in NumPy (``quant_words``, any machine); the
kernels themselves under Triton's CPU interpreter (where Triton is installed); and on a CUDA
GPU, the compiled kernels and the torch runner using them (marked ``gpu``).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tests.interpreted import run_interpreted
from tinyinfer.errors import TinyInferError
from tinyinfer.quant import QuantConfig, dequantize, quantize, stored_codes
from tinyinfer.runners import quant_words
from tinyinfer.runners import torch_layers as layers

FORMATS = ["int8", "int8-g32", "int8-g64", "int8-g128", "int4-g32", "int4-g64", "int4-g128",
           "int4-g32-asym", "int4-g64-asym", "int4-g128-asym", "int4-g32-min", "int4-g128-min"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (scripts/gpu_quant_kernels.py runs the same checks there)")


def weight(fmt: str, shape: tuple[int, int], seed: int = 0):
    rng = np.random.default_rng(seed)
    return quantize((rng.standard_normal(shape) * rng.uniform(0.01, 3)).astype(np.float32),
                    QuantConfig.parse(fmt))


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_reads_every_code_at_every_place_in_a_word(bits):
    per = quant_words.PER_WORD[bits]
    codes = np.arange(2 ** bits)  # every stored code: nibbles 0..15, or bytes -128..127
    if bits == 8:
        codes = codes - 128
    for j in range(per):
        for filler in (0, -1):  # the other codes of the word all zeros, or all ones
            data = np.full((len(codes), per), filler, np.int64)
            data[:, j] = codes
            words = np.zeros(len(codes), np.int64)
            for i in range(per):
                words |= (data[:, i] & (2 ** bits - 1)) << (bits * i)
            decoded = quant_words.decode(words.astype(np.uint32).view(np.int32), j, bits)
            np.testing.assert_array_equal(decoded, quant_words.CODE_BASE[bits] + codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_arithmetic_is_the_reference_dequantize(fmt):
    """Words, scales and offsets, decoded and multiplied as the kernel does, in float32: the
    reference's weight exactly (the minimum formats within a rounding of the folded offset)."""
    qw = weight(fmt, (40, 512))
    packed = quant_words.pack_words(qw)
    assert packed.words.shape == (40, 512 * qw.config.bits // 32)
    span = qw.group_size * qw.config.bits // 32  # W, words in a group: code 3 of word i meets 2 W + 2 i + 1
    words = np.arange(512 * qw.config.bits // 32)
    np.testing.assert_array_equal(quant_words.decode(packed.words, 3, packed.bits) - quant_words.CODE_BASE[packed.bits],
                                  stored_codes(qw)[:, words // span * qw.group_size + 2 * span + 2 * (words % span) + 1])
    ours, ref = quant_words.dequantize_words(packed), dequantize(qw)
    if qw.config.minimum:
        np.testing.assert_allclose(ours, ref, rtol=0, atol=2 ** -16 * float(np.abs(qw.scales).max()) * 256)
    else:
        np.testing.assert_array_equal(ours, ref)


def test_offsets_are_float16_where_that_is_exact_else_float32():
    assert quant_words.pack_words(weight("int4-g32-min", (8, 64))).offsets.dtype == np.float16
    assert quant_words.pack_words(weight("int4-g32-asym", (8, 64))).offsets.dtype == np.float32
    assert quant_words.pack_words(weight("int4-g32", (8, 64))).offsets is None
    assert quant_words.pack_words(weight("int8", (8, 64))).zero == 0


def test_shapes_the_kernels_do_not_take_keep_torch_paths():
    assert quant_words.fits(weight("int4-g32", (8, 96)))
    assert not quant_words.fits(weight("int4-g64", (8, 96)))  # a ragged last group
    assert not quant_words.fits(weight("int8", (8, 90)))  # rows not whole words
    assert not quant_words.fits(weight("int4-g32", (8, 100)))


def test_the_layout_puts_a_words_codes_in_one_group_and_each_pair_on_a_contiguous_run_of_inputs():
    """Codes 2q and 2q + 1 of word i of a group of G = PER W inputs hold the group's columns
    2 W q + 2 i and the next."""
    assert quant_words.columns(64, 4, 32).tolist()[:16] == [0, 1, 8, 9, 16, 17, 24, 25,
                                                           2, 3, 10, 11, 18, 19, 26, 27]
    assert quant_words.columns(64, 4, 32)[32:40].tolist() == [32 + c for c in (0, 1, 8, 9, 16, 17, 24, 25)]
    assert quant_words.columns(12, 8, 12).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]  # per-row int8
    for bits, group in ((4, 32), (4, 128), (8, 32), (8, 96)):
        assert sorted(quant_words.columns(384, bits, group)) == list(range(384))


def test_kernel_inputs_regroup_columns_by_code_and_sum_each_words_inputs():
    x = torch.arange(2 * 16, dtype=torch.bfloat16).view(2, 16)
    xg, sums = layers.kernel_inputs(x, 8, 8)  # groups of two words: code 2q + r of word i is column 4q + 2i + r
    assert xg.shape == (2, 4, 4) and xg.dtype == torch.float32
    assert xg[0].tolist() == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    held = quant_words.columns(16, 8, 8).reshape(-1, 4)  # [word, code]
    assert xg[1].tolist() == x[1, held.T].float().tolist()  # xg[t, j, w]: the input code j of word w meets
    assert sums.tolist() == x.float()[:, held].sum(-1).tolist()
    xg, sums = layers.kernel_inputs(x, 4, 16)  # int4, one group of two words
    held = quant_words.columns(16, 4, 16).reshape(-1, 8)
    assert xg.shape == (2, 8, 2) and xg[1].tolist() == x[1, held.T].float().tolist()
    assert sums.tolist() == x.float()[:, held].sum(-1).tolist()


def test_the_runner_refuses_the_kernels_where_they_cannot_run(without_triton_interpreter):
    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.runners.torch_weights import random_weights
    from tinyinfer.config import config_from_dict

    config = config_from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=64))
    weights = random_weights(config, device="cpu", dtype="float32")
    with pytest.raises(TinyInferError, match="quant_kernel must be one of"):
        TorchRunner(config, weights, device="cpu", quant_kernel="fast")
    if not torch.cuda.is_available():
        with pytest.raises(TinyInferError, match="use quant_kernel='torch'"):
            TorchRunner(config, weights, device="cpu", quant_kernel="triton")
    assert TorchRunner(config, weights, device="cpu").describe()["quant_kernel"] == "torch"
    assert TorchRunner(config, weights, device="cpu", quant_kernel="auto").quant_kernel == "torch"


INTERPRETED = """
import numpy as np, torch
from tinyinfer.quant import QuantConfig, quantize, dequantize
from tinyinfer.runners import torch_layers as layers, torch_quant_kernel as qk
rng = np.random.default_rng(0)
configs = [qk.Config(16, 64, num_stages=1), qk.Config(8, 32, split_k=2), qk.Config(16, 256, tma=True),
           qk.Config(8, 64, split_k=2, num_stages=4, tma=True), qk.Config(16, 128, dot=True),
           qk.Config(16, 128, split_k=2, dot=True, tma=True)]
for fmt, shape in [("int4-g32", (24, 128)), ("int4-g64-asym", (40, 256)), ("int4-g32-min", (17, 96)),
                   ("int8", (24, 160)), ("int8-g32", (33, 128)), ("int4-g128", (16, 384))]:
    qw = quantize(rng.standard_normal(shape).astype(np.float32), QuantConfig.parse(fmt))
    w = layers.kernel_weight(qw, torch.device("cpu"))
    for rows in (1, 3, 5, 20):
        x = rng.standard_normal((rows, shape[1])).astype(np.float32)
        ref = x.astype(np.float64) @ dequantize(qw).astype(np.float64).T
        for config in configs:
            if rows > 3 and not config.dot:  # elementwise: a program per row
                continue
            xg, xsum = layers.kernel_inputs(torch.from_numpy(x), w.bits, w.group_size)
            y = qk.quant_matmul(xg, xsum, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero,
                                torch.float32, config).numpy()
            err = np.abs(y - ref).max() / np.abs(ref).max()
            assert err < 1e-5, (fmt, rows, config, err)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_quant_kernels.py runs the kernels on a GPU")
def test_the_kernels_compute_the_dequantized_product_in_the_interpreter():
    """Every program kind (elementwise, matrix units, split K; words through pointers or tensor
    descriptors, pipelined or not) on float32 inputs, run by Triton's CPU interpreter: within
    1e-5 of x @ dequantize(W)^T."""
    run_interpreted(INTERPRETED)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 16, 70])
def test_the_compiled_kernels_compute_the_dequantized_product(fmt, rows):
    """bf16 activations on the GPU: within 1e-2 (relative norm) of the float64 product, the
    kernel choosing its own program."""
    qw = weight(fmt, (1000, 2048), seed=rows)
    w = layers.device_weight(qw, torch.device("cuda"), torch.bfloat16, kernel="triton")
    assert isinstance(w, layers.KernelWeight)
    x = torch.randn((rows, 2048), device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ torch.from_numpy(dequantize(qw)).cuda().double().T
    got = layers.linear(x, w, None).double()
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["int8", "int4-g128", "int4-g32-asym", "int4-g32-min"])
def test_the_runner_with_the_kernels_tracks_the_reference(fmt):
    """A small Llama in bf16 with torch.compile and CUDA graphs (the kernels' products inside
    them): logits within 3e-2 of the float64 reference holding the same quantized weights."""
    from tinyinfer.config import config_from_dict
    from tinyinfer.quant import quantize_weights
    from tinyinfer.runners.numpy_ref import NumpyRunner
    from tinyinfer.runners.runner import make_batch
    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.runners.torch_weights import random_weights

    config = config_from_dict(dict(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   max_position_embeddings=256))
    floats = {k: v.numpy() for k, v in random_weights(config, device="cpu", dtype="float32",
                                                       std=0.3 / 16).items()}
    weights = quantize_weights(floats, QuantConfig.parse(fmt))
    ref_runner = NumpyRunner(config, weights, dtype="float64")
    fast = TorchRunner(config, weights, device="cuda", quant_kernel="triton")
    assert isinstance(fast.w.layers[0].qkv[0], layers.KernelWeight) and fast.cuda_graphs
    prompt = list(range(3, 40))
    kv_ref, kv_fast = ref_runner.new_kv_cache(8, 16), fast.new_kv_cache(8, 16)
    steps = [make_batch([(prompt, 0, [0, 1, 2], False)], 16)] + [
        make_batch([([7 + i], len(prompt) + i, [0, 1, 2], False)], 16) for i in range(4)]
    for batch in steps:
        ref, ours = ref_runner.forward(batch, kv_ref), fast.forward(batch, kv_fast)
        assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 3e-2


@pytest.mark.gpu
@needs_cuda
def test_auto_takes_the_triton_kernels_wherever_they_fit():
    cuda = torch.device("cuda")
    kinds = {fmt: type(layers.device_weight(weight(fmt, (256, 1024)), cuda, torch.bfloat16, kernel="auto"))
             for fmt in ("int4-g128", "int4-g32-min", "int8", "int8-g32")}
    assert set(kinds.values()) == {layers.KernelWeight}
    torch_int4 = layers.device_weight(weight("int4-g128", (256, 1024)), cuda, torch.bfloat16, kernel="torch")
    assert isinstance(torch_int4, layers.Int4Weight) and torch_int4.tile_map is not None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tiles_split_k_until_the_processors_have_work_and_not_past_two_steps_a_split():
    from tinyinfer.runners import torch_quant_kernel as qk

    gate_up, down = qk.pick_config(1, 28672, 4096, 4, 132), qk.pick_config(1, 4096, 14336, 4, 132)
    assert not gate_up.dot and gate_up.split_k == 1  # 3,584 programs already
    assert down.block_n == 8 and down.split_k == 1  # one row: split only while multiprocessors would idle (512 tiles)
    assert gate_up.block_n == 16 and qk.pick_config(1, 4096, 4096, 4, 132).block_n == 8  # 16 rows for many outputs
    assert qk.pick_config(1, 4096, 4096, 4, 132).split_k == 1  # 512 tiles: no processor idles
    assert qk.pick_config(1, 512, 4096, 4, 132).split_k == 4  # 64 tiles -> 256 programs
    head = qk.pick_config(1, 128256, 4096, 8, 132)  # int8: 16 x 512 for a vocabulary's outputs (and
    # long rows), else 8 x 256
    assert (head.block_n, head.block_k) == (16, 512) and qk.pick_config(1, 28672, 4096, 8, 132).block_n == 8
    small = qk.pick_config(1, 1024, 1024, 8, 132)
    assert small.block_n == 8 and small.split_k == 2  # 128 tiles -> 256 programs
    assert qk.pick_config(1, 64, 1024, 8, 132).split_k == 1  # 2 loop steps of 512: a split would keep one
    assert qk.pick_config(16, 4096, 14336, 4, 132).split_k == 16  # matrix units: ~4 programs a processor
    assert qk.pick_config(2, 4096, 4096, 4, 132).dot is False  # int4: a program per row
    assert qk.pick_config(2, 4096, 4096, 8, 132).dot and qk.pick_config(300, 4096, 4096, 8, 132).dot
    assert qk.rows_per_tile(300, qk.pick_config(300, 4096, 4096, 8, 132)) == qk.MAX_ROWS_PER_TILE
    assert qk.pick_config(1, 4096, 4096, 8, 132, tma=True).tma and not qk.pick_config(1, 4096, 4096, 8, 132).tma
    assert qk.tma_fits(torch.zeros((4, 8), dtype=torch.int32))  # rows of 32 bytes
    assert not qk.tma_fits(torch.zeros((4, 6), dtype=torch.int32))  # 24 bytes: no descriptor


PREFILL_INTERPRETED = """
import numpy as np, torch
from tinyinfer.quant import QuantConfig, quantize, dequantize
from tinyinfer.runners import torch_layers as layers, torch_quant_prefill as qp
rng = np.random.default_rng(0)
# words: every format's weight bit for bit, and the product through buffer chunks of 32 rows
qp.CHUNK = 32 * 384
for fmt, shape in [("int4-g32", (24, 128)), ("int4-g64-asym", (40, 256)), ("int4-g32-min", (17, 96)),
                   ("int8", (70, 160)), ("int8-g32", (33, 128)), ("int4-g128", (100, 384))]:
    qw = quantize(rng.standard_normal(shape).astype(np.float32), QuantConfig.parse(fmt))
    w = layers.kernel_weight(qw, torch.device("cpu"))
    out = torch.full(shape, float("nan"))
    qp.dequantize_words_into(out, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero)
    assert np.array_equal(out.numpy(), dequantize(qw)), fmt
    x = rng.standard_normal((layers.DEQUANT_ROWS, shape[1])).astype(np.float32)
    y = layers.linear(torch.from_numpy(x), w, None).numpy()
    ref = x.astype(np.float64) @ dequantize(qw).astype(np.float64).T
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5, fmt
# torch's tiled int4 layout (each tile row's nibbles in words of their own), here with a made-up
# order of the columns (the real one is torch's packer's, found on the GPU): every nibble must
# land at its column, with its group's scale and zero
for tile_k, group in ((32, 32), (64, 32), (128, 128), (128, 256)):
    n, k = 48, 256
    nibbles = rng.integers(0, 16, (n, k))
    columns = rng.permutation(tile_k)  # nibble j of a row's word q is column columns[8 q + j]
    tiles = nibbles.reshape(n // 8, 8, k // tile_k, tile_k).transpose(0, 2, 1, 3)  # [N/8, K tiles, 8, tile_k]
    held = tiles[..., columns].reshape(n // 8, k // tile_k, 8, tile_k // 8, 8)
    words = (held << (4 * np.arange(8))).sum(-1).reshape(n // 8, k // tile_k, tile_k)
    packed = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    sz = torch.from_numpy(rng.standard_normal((k // group, n, 2)).astype(np.float32))
    out = torch.full((40, k), float("nan"))
    tile_map = torch.from_numpy(np.argsort(columns).astype(np.int32))  # column c: nibble tile_map[c] of the row
    qp.dequantize_int4pack_into(out, packed, sz, group, tile_map, first_row=8)
    g = np.arange(k) // group
    want = (nibbles - 8).astype(np.float32) * sz[g, :, 0].numpy().T + sz[g, :, 1].numpy().T  # float32
    assert np.array_equal(out.numpy(), want[8:48]), (tile_k, group)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_quant_prefill.py runs the kernels on a GPU")
def test_prefill_dequantizes_exactly_in_the_interpreter():
    """Many rows: the dequantize kernels give the reference's weights bit for bit (words) and put
    each nibble of torch's tiled layout where the tile map says; the product through buffer chunks
    is within 1e-5 of x @ dequantize(W)^T (float32, Triton's CPU interpreter)."""
    run_interpreted(PREFILL_INTERPRETED)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["int8", "int4-g128", "int4-g32-asym", "int4-g64-min"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_prefill_rows_dequantize_then_multiply_on_the_gpu(fmt, kernel):
    """From DEQUANT_ROWS (INT4PACK_DEQUANT_ROWS) rows on, both layouts (words, torch's tiled int4) go through the bf16
    buffer: within 1e-2 (relative norm) of the float64 product, rows past one buffer chunk too."""
    from tinyinfer.runners import torch_quant_prefill as qp

    qw = weight(fmt, (qp.CHUNK // 2048 + 200, 2048))
    w = layers.device_weight(qw, torch.device("cuda"), torch.bfloat16, kernel=kernel)
    assert isinstance(w, layers.KernelWeight) or w.tile_map is not None
    rows = layers.DEQUANT_ROWS if isinstance(w, layers.KernelWeight) else layers.INT4PACK_DEQUANT_ROWS
    x = torch.randn((rows + 3, 2048), device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ torch.from_numpy(dequantize(qw)).cuda().double().T
    assert float((layers.linear(x, w, None).double() - ref).norm() / ref.norm()) < 1e-2
