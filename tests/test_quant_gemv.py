"""The fused batch-1 products with int8 / int4 weights (runners/torch_quant_gemv.py), run by
Triton's CPU interpreter: torch_triton_gemv's layer functions handed quantized weights, against
torch_layers' functions holding the dequantized weights (dequantize, then multiply), and the
runner decoding through them against its unfused quantized products."""

from __future__ import annotations

import importlib.util

import pytest

from tests.interpreted import run_interpreted

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed; scripts/gpu_quant_fused.py runs "
                                         "the kernels on a GPU")

# float32 throughout: the kernel's per-word sums (scale * sum of (BASE + code) * x, plus shift *
# the word's inputs' sum) and the float32 products of the dequantized weights round differently;
# both stay within TOLERANCE of the largest output.
TOLERANCE = 2e-5
COMMON = f"""
import numpy as np, torch
from tinyinfer.quant import QuantConfig, quantize, dequantize
from tinyinfer.runners import torch_layers as L, torch_triton_gemv as G, torch_quant_gemv as Q
from tinyinfer.runners.torch_quant_kernel import Config
rng = np.random.default_rng(0)
torch.manual_seed(0)
def weight(fmt, shape):
    qw = quantize((rng.standard_normal(shape) * 0.1).astype(np.float32), QuantConfig.parse(fmt))
    return L.kernel_weight(qw, torch.device("cpu")), torch.from_numpy(dequantize(qw))
def close(got, ref, where):
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < {TOLERANCE}, (where, err)
"""


@needs_triton
def test_fused_layer_functions_with_quantized_weights_match_the_dequantized_ones():
    """Every format (int8 per row and in groups, int4 symmetric, with zero points, with minimums)
    through attention_input (residual add + RMSNorm before q|k|v), mlp_block (o + residual add,
    RMSNorm + gate|up + silu * up, down) and final_logits (add + norm + head, float32 out); 1 and 3
    rows, with and without biases; widths that fill no tile evenly. The residual sums are the
    dequantized model's bit for bit, the products within the stated tolerance."""
    code = COMMON + """
cases = [("int8", 1, False), ("int8-g32", 3, True), ("int4-g32", 1, True), ("int4-g64-asym", 3, False),
         ("int4-g32-min", 1, False), ("int4-g128", 3, True)]
for fmt, rows, bias in cases:
    d, f = (256, 128) if fmt == "int4-g128" else (128, 192) if "g64" in fmt else (128, 96)
    qkv_out, vocab = 72, 200
    x, r, attn = torch.randn(rows, d), torch.randn(rows, d), torch.randn(rows, d)
    norm = 1 + 0.1 * torch.randn(d)
    pairs = {name: weight(fmt, shape) for name, shape in
             dict(qkv=(qkv_out, d), o=(d, d), up=(2 * f, d), down=(d, f), head=(vocab, d)).items()}
    q = {k: v[0] for k, v in pairs.items()}
    w = {k: v[1] for k, v in pairs.items()}
    b = {k: torch.randn(w[k].shape[0]) if bias else None for k in w}
    got_x, got = G.attention_input(x, r, norm, None, q["qkv"], b["qkv"], 1e-5)
    ref_x, ref = L.attention_input(x, r, norm, None, w["qkv"], b["qkv"], 1e-5)
    assert torch.equal(got_x, ref_x), fmt
    close(got, ref, (fmt, "qkv"))
    got_x, got = G.mlp_block(x, attn, q["o"], b["o"], norm, None, q["up"], b["up"], q["down"], b["down"], 1e-5, True)
    ref_x, ref = L.mlp_block(x, attn, w["o"], b["o"], norm, None, w["up"], b["up"], w["down"], b["down"], 1e-5, True)
    close(got_x, ref_x, (fmt, "o + residual"))
    close(got, ref, (fmt, "mlp"))
    got = G.final_logits(x, r, norm, None, q["head"], 1e-5)
    assert got.dtype == torch.float32
    close(got, L.final_logits(x, r, norm, None, w["head"], 1e-5), (fmt, "head"))
print("ok")
"""
    run_interpreted(code)


@needs_triton
def test_every_program_kind_of_the_fused_quantized_product():
    """The product's programs beyond the default choice: split K (the last program of a tile adds
    the partials, then the epilogue; products without a norm, which takes whole rows), words
    through tensor descriptors, other tiles, pipelined loops of other depths; with the prologue
    (norm + residual) and the epilogues (gated, residual add)."""
    code = COMMON + """
def h_ref(x, up):
    gate, u = L.linear(x, up, None).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * u
configs = [Config(8, 64, split_k=3), Config(16, 64, split_k=2, num_warps=4, num_stages=4, tma=True),
           Config(32, 32, num_stages=1, tma=True)]
for fmt in ("int4-g32-min", "int8"):
    d, f = 160, 96
    x, r = torch.randn(2, d), torch.randn(2, d)
    norm = 1 + 0.1 * torch.randn(d)
    (qkv, qkv_f), (up, up_f), (down, down_f) = weight(fmt, (40, d)), weight(fmt, (2 * f, d)), weight(fmt, (d, f))
    h = torch.randn(2, f)
    for config in configs:
        where = (fmt, tuple(config))
        whole = config._replace(split_k=1)
        total = torch.empty_like(x)
        got = Q.fused_gemv(x, qkv, norm=norm, residual=r, sum_out=total, eps=1e-5, config=whole)
        ref_x, ref = L.attention_input(x, r, norm, None, qkv_f, None, 1e-5)
        assert torch.equal(total, ref_x), where
        close(got, ref, where)
        got = Q.fused_gemv(ref_x, up, norm=norm, eps=1e-5, gated=True, config=whole)
        gate, u = L.linear(L.norm(ref_x, norm, None, 1e-5), up_f, None).chunk(2, dim=-1)
        close(got, torch.nn.functional.silu(gate) * u, where)
        got = Q.fused_gemv(h, down, add=x, config=config)
        close(got, x + L.linear(h, down_f, None), where)
        close(Q.fused_gemv(ref_x, up, gated=True, config=config), h_ref(ref_x, up_f), where)
try:
    Q.fused_gemv(x, qkv, norm=norm, config=Config(8, 64, split_k=2))
    raise AssertionError("a norm with split K was taken")
except ValueError as error:
    assert "split_k 1" in str(error)
print("ok")
"""
    run_interpreted(code)


@needs_triton
def test_16_bit_inputs_are_read_two_to_a_word():
    """float16 and bfloat16 rows are read (and the residual sum written) as 32-bit words of two
    inputs each: the products within the compute dtype's rounding of the float32 ones (relative
    norm 2e-3 in float16, 1e-2 in bfloat16), the float16 residual sum torch's bit for bit (the
    interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest: not compared)."""
    code = COMMON + """
def rel(a, b):
    return float((a.float() - b).norm() / b.norm())
for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
    for fmt in ("int4-g32-min", "int8-g32"):
        d, f = 128, 96
        x, r, attn = (torch.randn(1, d).to(dtype) for _ in range(3))
        norm = (1 + 0.1 * torch.randn(d)).to(dtype)
        (qkv, qkv_f), (o, o_f), (up, up_f), (down, down_f) = (
            weight(fmt, shape) for shape in ((40, d), (d, d), (2 * f, d), (d, f)))
        total, got = G.attention_input(x, r, norm, None, qkv, None, 1e-5)
        ref_x, ref = L.attention_input(x.float(), r.float(), norm.float(), None, qkv_f, None, 1e-5)
        assert rel(got, ref) < tol, (dtype, fmt, rel(got, ref))
        if dtype == torch.float16:
            assert torch.equal(total, x + r)
        got_x, got = G.mlp_block(x, attn, o, None, norm, None, up, None, down, None, 1e-5, True)
        ref_x, ref = L.mlp_block(x.float(), attn.float(), o_f, None, norm.float(), None, up_f, None, down_f, None,
                                 1e-5, True)
        assert rel(got_x, ref_x) < tol and rel(got, ref) < 2 * tol, (dtype, fmt, rel(got_x, ref_x), rel(got, ref))
print("ok")
"""
    run_interpreted(code)


@needs_triton
@pytest.mark.parametrize("name, fmt", [("llama-gqa-untied", "int4-g32+head"), ("qwen2-bias", "int8")])
def test_runner_decodes_quantized_models_through_the_fused_products(name, fmt, oracle_model):
    """A model quantized in the Triton kernels' layout (with its head, and a tied one without):
    prefill, then batch-1 decode steps, a step of both sequences and a step of one sequence's two
    tokens through the fused products (decode_products="triton", under Triton's CPU interpreter;
    two rows run the products' row axis), against the same runner through its unfused quantized
    products (kernel_inputs, then the Triton product)."""
    folder, _ = oracle_model(name)
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    steps = [[([5, 9, 2], 0, a, False), ([4, 1], 0, b, False)]]
    steps += [[([7], 3, a, False)], [([31], 2, b, False)]]
    steps += [[([8], 4, a, False), ([6], 3, b, False)], [([3, 9], 5, a, True)]]
    code = f"""
import numpy as np, torch
from tinyinfer.model import open_checkpoint
from tinyinfer.quant import QuantConfig, quantize_weights
from tinyinfer.weights import load_weights
from tinyinfer.runners import torch_layers as L
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import TorchRunner
checkpoint = open_checkpoint({str(folder)!r})
config = checkpoint.config
weights = quantize_weights(load_weights(checkpoint.path, config), QuantConfig.parse({fmt!r}))
runners = [TorchRunner(config, weights, device="cpu", dtype="float32", quant_kernel="triton",
                       decode_products=products) for products in ("torch", "triton")]
assert isinstance(runners[1].w.layers[0].mlp_in[0], L.KernelWeight)
assert isinstance(runners[1].w.head, L.KernelWeight) == ("+head" in {fmt!r})
caches = [r.new_kv_cache(32, 4) for r in runners]
for entries in {steps!r}:
    ref, got = (r.forward(make_batch(entries, 4), kv) for r, kv in zip(runners, caches))
    assert np.abs(got - ref).max() <= {TOLERANCE} * np.abs(ref).max(), np.abs(got - ref).max()
print("ok")
"""
    run_interpreted(code)


def test_quantized_models_take_the_fused_products_where_they_measured_faster():
    """decode_products="auto" with quantized layers: fused for int8 at any size and for int4 up to
    a hidden size of 2048; wider int4 layers keep the compiled glue and the unfused products."""
    from tinyinfer.runners.torch_fast import quantized_fusion_pays

    assert quantized_fusion_pays({8}, 4096) and quantized_fusion_pays({8}, 2048)
    assert quantized_fusion_pays({4}, 2048) and not quantized_fusion_pays({4}, 4096)
    assert not quantized_fusion_pays({4, 8}, 4096)
    assert quantized_fusion_pays(set(), 4096)  # only the head quantized: the layers are 16-bit


@needs_triton
def test_tiles_of_the_fused_products_by_kind_and_shape():
    """torch_quant_gemv.pick_config: the tiles measured fastest on an H100 for the 8B and 1B
    shapes' products (docs/quantization.md), by format, kind and row length; never a split K
    under a norm, a split without one only where output tiles would leave processors idle.
    ``norm`` and ``gated`` have no defaults, so a caller cannot leave out what the choice
    depends on (a gate|up product on 8 x 1024 tiles ran 21.3 against 15.4 us)."""
    from tinyinfer.runners.torch_quant_gemv import pick_config
    from tinyinfer.runners.torch_quant_kernel import Config

    tiles = lambda config: (config.block_n, config.block_k, config.num_warps, config.num_stages)  # noqa: E731
    for n, k in ((6144, 4096), (14336, 4096), (8192, 2048)):  # 8B q|k|v, gate|up; 1B gate|up: 3 in flight
        assert tiles(pick_config(n, k, 8, 132, norm=True, gated=n != 6144)) == (16, 512, 2, 3)
    assert tiles(pick_config(4096, 4096, 8, 132, norm=False, gated=False)) == (8, 512, 2, 4)  # 8B o
    for n, k, norm in ((3072, 2048, True), (2048, 2048, False), (2048, 8192, False), (4096, 14336, False)):
        assert tiles(pick_config(n, k, 8, 132, norm=norm, gated=False)) == (8, 1024, 2, 4)  # 1B q|k|v, o; down
    # an LM head of short rows keeps 16 rows
    assert tiles(pick_config(128256, 2048, 8, 132, norm=True, gated=False)) == (16, 512, 2, 3)
    assert tiles(pick_config(4096, 4096, 4, 132, norm=False, gated=False)) == (64, 256, 4, 4)  # int4, 8B o
    for n, k, norm in ((3072, 2048, True), (2048, 2048, False), (2048, 8192, False), (4096, 14336, False)):
        assert tiles(pick_config(n, k, 4, 132, norm=norm, gated=False)) == (8, 1024, 2, 3)  # int4: 3 in flight
    assert tiles(pick_config(6144, 4096, 4, 132, norm=True, gated=False)) == (16, 512, 2, 3)
    assert pick_config(6144, 4096, 4, 132, tma=True, norm=True, gated=False) == Config(16, 512, 1, 2, 3, tma=True)
    assert pick_config(64, 4096, 8, 132, norm=False, gated=False).split_k > 1
    assert pick_config(64, 4096, 8, 132, norm=True, gated=False).split_k == 1
    assert pick_config(2048, 2048, 8, 132, norm=False, gated=False).split_k == 1  # 8 x 1024: 256 tiles
