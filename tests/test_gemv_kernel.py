"""The fused batch-1 decode products (runners/torch_triton_gemv.py), run by Triton's CPU
interpreter: each layer function against torch_layers' version of it, and the runner stepping
through them against its torch path."""

from __future__ import annotations

import importlib.util

import pytest

import tinyinfer
from tests.interpreted import run_interpreted
from tinyinfer.errors import TinyInferError

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed; scripts/gpu_fuse_check.py runs "
                                         "the kernels on a GPU")


@needs_triton
def test_fused_layer_functions_match_torch_layers_in_interpreter():
    """float32, sizes that fill no tile evenly, 1, 2 (the few-row program, for tiles without a
    split) and 3 rows, with and without biases, one split and several, one tile in flight and
    two: the same outputs as torch_layers (the residual sums bit for bit)."""
    code = """
import torch
from tinyinfer.runners import torch_layers as L
from tinyinfer.runners import torch_triton_gemv as G
torch.manual_seed(0)
def close(a, b):
    return float((a - b).norm() / b.norm()) < 1e-6
for rows, bias in ((1, False), (2, True), (3, True)):
    for config in (None, G.Config(16, 64, 2), G.Config(8, 32, 4), G.Config(8, 32, 2, ahead=2),
                   G.Config(4, 16, 1, 8, ahead=2)):
        d, f, qkv_out, vocab = 96, 160, 144, 200
        x, r, attn = torch.randn(rows, d), torch.randn(rows, d), torch.randn(rows, d)
        norm = 1 + 0.1 * torch.randn(d)
        w = {name: 0.1 * torch.randn(shape) for name, shape in
             dict(qkv=(qkv_out, d), o=(d, d), up=(2 * f, d), down=(d, f), head=(vocab, d)).items()}
        b = {name: torch.randn(w[name].shape[0]) if bias else None for name in w}
        total = torch.empty_like(x)
        got = G.gemv(x, w['qkv'], b['qkv'], norm=norm, residual=r, sum_out=total, eps=1e-5, config=config)
        ref_x, ref = L.attention_input(x, r, norm, None, w['qkv'], b['qkv'], 1e-5)
        assert torch.equal(total, ref_x) and close(got, ref), (rows, config)
        got_x = G.gemv(attn, w['o'], b['o'], add=x, config=config)
        h = G.gemv(got_x, w['up'], b['up'], norm=norm, eps=1e-5, gated=True, config=config)
        got = G.gemv(h, w['down'], b['down'], config=config)
        ref_x, ref = L.mlp_block(x, attn, w['o'], b['o'], norm, None, w['up'], b['up'], w['down'],
                                 b['down'], 1e-5, True)
        assert close(got_x, ref_x) and close(got, ref), (rows, config)
        got = G.gemv(x, w['head'], norm=norm, residual=r, sum_out=torch.empty_like(x), eps=1e-5,
                     out_dtype=torch.float32, config=config)
        assert close(got, L.final_logits(x, r, norm, None, w['head'], 1e-5)), (rows, config)
got_x, got = G.mlp_block(x, attn, w['o'], None, norm, None, w['up'], None, w['down'], None, 1e-5, True)
ref_x, ref = L.mlp_block(x, attn, w['o'], None, norm, None, w['up'], None, w['down'], None, 1e-5, True)
assert close(got_x, ref_x) and close(got, ref)
print('ok')
"""
    run_interpreted(code)


def same_logits_on_every_step(make_runners: str) -> str:
    """Interpreted code: ``make_runners`` builds ``runners`` (the torch path, then the fused
    products); both run the same steps (two prompts prefilled, three one-row decode steps of
    the first, a two-row step through the few-row program, then a three-row verification of the
    first through the row kernel), and every step's float32 logits of
    the second match the first's within 1e-5 relative."""
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    steps = [[([5, 9, 2, 11, 3, 8], 0, a, False), ([4, 4, 1], 0, b, False)]]
    steps += [[([7 + i], 6 + i, a, False)] for i in range(3)]
    steps += [[([30], 9, a, False), ([31], 3, b, False)]]
    steps += [[([32, 33, 34], 10, a, True)]]
    return (
        "import numpy as np\n"
        "from tinyinfer.runners.runner import make_batch\n"
        + make_runners +
        "caches = [r.new_kv_cache(32, 4) for r in runners]\n"
        f"for entries in {steps!r}:\n"
        "    ref, got = (r.forward(make_batch(entries, 4), kv) for r, kv in zip(runners, caches))\n"
        "    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()\n"
        "print('ok')\n"
    )


@needs_triton
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias"])
def test_runner_decodes_through_the_fused_products_as_through_torch(name, oracle_model):
    """Prefill, then batch-1 decode steps: with decode_products="triton" (which the CPU takes
    under Triton's interpreter), the same float32 logits as the torch path; a batch of two rows
    runs the few-row program, a verification of three the row kernel."""
    folder, _ = oracle_model(name)
    run_interpreted(same_logits_on_every_step(
        "import tinyinfer\n"
        f"runners = [tinyinfer.load({str(folder)!r}, runner='torch', device='cpu', decode_products=products).runner\n"
        "           for products in ('torch', 'triton')]\n"
        "assert [r.describe()['decode_products'] for r in runners] == ['torch', 'triton']\n"))


@needs_triton
def test_a_broken_kernel_module_is_an_error_not_the_slow_path(oracle_model):
    """Where the kernels run (here Triton's CPU interpreter), an ImportError from tinyinfer's own
    kernel modules reaches the caller; only a Triton too old for them means "no fused products"
    (a moved helper once sent a GPU benchmark down the slower path without a word)."""
    folder, _ = oracle_model("llama-gqa-untied")
    run_interpreted(
        "import sys\nimport tinyinfer\n"
        "sys.modules['tinyinfer.runners.torch_triton_gemv'] = None  # its import now fails\n"
        "try:\n"
        f"    tinyinfer.load({str(folder)!r}, runner='torch', device='cpu', decode_products='triton')\n"
        "except ImportError as error:\n"
        "    assert error.name == 'tinyinfer.runners.torch_triton_gemv', error\n"
        "    print('ok')\n")


def test_decode_products_option_is_checked_and_described(oracle_model, without_triton_interpreter):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, runner="torch", device="cpu")
    assert model.runner.describe()["decode_products"] == "torch"  # "auto" on CPU
    with pytest.raises(TinyInferError, match="decode_products='torch'"):
        tinyinfer.load(folder, runner="torch", device="cpu", decode_products="triton")
    with pytest.raises(TinyInferError, match="decode_products must be one of"):
        tinyinfer.load(folder, runner="torch", device="cpu", decode_products="cublas")


@needs_triton
def test_tiles_by_kind_and_split_k_counters():
    """The runner's tiles depend on the product's kind alone (a shard's product takes the tiles
    of the whole model's) and never split K (slower at every measured shape); a forced split
    still needs a counter per output tile."""
    from tinyinfer.runners import torch_triton_gemv as G
    from tinyinfer.runners.triton_common import MAX_TILES, split_counters

    assert G.pick_config(False, norm=True) == G.Config(4, 1024, num_warps=8)  # q|k|v, LM heads
    assert G.pick_config(False) == G.Config(4, 1024, ahead=2)  # o, down
    assert G.pick_config(True, norm=True) == G.Config(4, 256)  # gate|up
    assert all(G.pick_config(*kind).split_k == 1 for kind in ((False, False), (False, True), (True, True)))
    with pytest.raises(ValueError, match=f"at most {MAX_TILES} output tiles"):
        split_counters(MAX_TILES + 1, __import__("torch").device("cpu"))


@needs_triton
def test_shard_fused_layer_sums_to_the_whole_layer_in_interpreter():
    """A tensor-parallel layer through the fused products, two ranks in one process (the test
    adds their partial sums where the ranks would all-reduce): each rank's q|k|v are its columns
    of the whole layer's, the residual stream is the same on every rank, and the ranks' down
    products add up to the whole MLP's output; each rank's MLP also matches the shard's torch
    function (float32, sizes that fill no tile evenly), at the runner's tiles and with K split
    across programs and two tiles in flight."""
    code = """
import functools
import torch
from tinyinfer.config import ModelConfig
from tinyinfer.runners import torch_layers as L
from tinyinfer.runners import torch_triton_gemv as G
from tinyinfer.runners.tp import shard as S
torch.manual_seed(0)
def close(a, b):
    return float((a - b).norm() / b.norm()) < 1e-5
c = ModelConfig(family='llama', model_type='llama', vocab_size=50, hidden_size=96, num_layers=1,
                num_heads=6, num_kv_heads=2, head_dim=16, intermediate_size=160,
                max_position_embeddings=64, norm_eps=1e-5, tie_word_embeddings=False,
                qkv_bias=False, o_bias=False, mlp_bias=False)
hd, world, eps = c.head_dim, 2, c.norm_eps
ref = {f'layers.0.{n}.weight': 0.1 * torch.randn(shape) for n, shape in dict(
    q=(c.num_heads * hd, c.hidden_size), k=(c.num_kv_heads * hd, c.hidden_size),
    v=(c.num_kv_heads * hd, c.hidden_size), o=(c.hidden_size, c.num_heads * hd),
    gate=(c.intermediate_size, c.hidden_size), up=(c.intermediate_size, c.hidden_size),
    down=(c.hidden_size, c.intermediate_size)).items()}
def fused(w):
    get = lambda n: w[f'layers.0.{n}.weight']
    return (torch.cat([get('q'), get('k'), get('v')]), get('o').contiguous(),
            torch.cat([get('gate'), get('up')]), get('down').contiguous())  # as the runner holds them
norm1, norm2 = 1 + 0.1 * torch.randn(c.hidden_size), 1 + 0.1 * torch.randn(c.hidden_size)
x, residual = torch.randn(1, c.hidden_size), torch.randn(1, c.hidden_size)
attn = torch.randn(1, c.num_heads * hd)  # stands in for attention's output
qkv_w, o_w, in_w, out_w = fused(ref)
want_x, want_qkv = L.attention_input(x, residual, norm1, None, qkv_w, None, eps)
want_x2, want_mlp = L.mlp_block(want_x, attn, o_w, None, norm2, None, in_w, None, out_w, None, eps, True)
q_size, kv_size = c.num_heads * hd // world, c.num_kv_heads * hd // world
qkv_parts = want_qkv.split([c.num_heads * hd, c.num_kv_heads * hd, c.num_kv_heads * hd], dim=-1)
ranks = [fused(S.shard_weights(c, ref, r, world)) for r in range(world)]
# the runner's tiles, and K split across programs with two tiles in flight
for product in (G.gemv, functools.partial(G.gemv, config=G.Config(8, 16, 2, ahead=2))):
    outs = []
    for r, (qkv_r, o_r, in_r, out_r) in enumerate(ranks):
        got_x, got_qkv = G.attention_input(x, residual, norm1, None, qkv_r, None, eps, product=product)
        mine = torch.cat([qkv_parts[0][:, r * q_size:(r + 1) * q_size], qkv_parts[1][:, r * kv_size:(r + 1) * kv_size],
                          qkv_parts[2][:, r * kv_size:(r + 1) * kv_size]], dim=-1)
        assert torch.equal(got_x, want_x) and close(got_qkv, mine), r
        outs.append(product(attn[:, r * q_size:(r + 1) * q_size], o_r))
    attn_out = sum(outs)  # the all-reduce
    partials = []
    for r, (qkv_r, o_r, in_r, out_r) in enumerate(ranks):
        got_x2, partial = G.mlp_after_attention(want_x, attn_out, norm2, None, in_r, None, out_r, None, eps, True,
                                                product=product)
        torch_x2, torch_partial = S.mlp_after_attention(want_x, attn_out, norm2, None, in_r, None, out_r, None, eps, True)
        assert close(got_x2, want_x2) and torch.equal(got_x2, torch_x2) and close(partial, torch_partial), r
        partials.append(partial)
    assert close(sum(partials), want_mlp)
assert not close(partials[0], want_mlp)  # one rank's share is not the whole
print('ok')
"""
    run_interpreted(code)


@needs_triton
def test_shard_decodes_through_the_fused_products_as_through_torch():
    """A shard's own layer loop (one rank, so no collectives to stand in for): prefill, then
    batch-1 decode steps through the fused products give the torch path's float32 logits; a
    batch of two rows through the few-row program and a three-row verification through the row
    kernel, the same."""
    run_interpreted(same_logits_on_every_step(
        "from tinyinfer.config import load_config\n"
        "from tinyinfer.model import BUNDLED\n"
        "from tinyinfer.runners.tp.shard import ShardRunner\n"
        "from tinyinfer.weights import load_weights\n"
        "config = load_config(BUNDLED['bundled'])\n"
        "runners = [ShardRunner(config, load_weights(BUNDLED['bundled'], config), 0, 1, device='cpu',\n"
        "                       decode_products=products) for products in ('auto', 'triton')]\n"
        "assert [r.describe()['decode_products'] for r in runners] == ['torch', 'triton']  # 'auto': CUDA only\n"))


@needs_triton
def test_auto_takes_the_triton_kernels_on_cuda_only():
    """What "auto" picks, by device, checked on a machine without a GPU: the runner's choice
    methods over a stand-in holding only a device and a head size (a real CUDA runner cannot be
    built here; scripts/gpu_check.py builds one). The explicit choices the CPU takes under
    Triton's interpreter must not leak into "auto"."""
    from types import SimpleNamespace

    import torch

    from tinyinfer.runners.torch_fast import TorchRunner

    from tinyinfer.runners.torch_layers import KernelWeight

    def on(device: str, bits: int = 4, hidden: int = 4096):
        layer = KernelWeight(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), None, bits, 32 // bits, 0)
        return SimpleNamespace(device=torch.device(device), config=SimpleNamespace(head_dim=64, hidden_size=hidden),
                               _products=lambda: [layer])

    cuda, cpu = on("cuda"), on("cpu")
    assert TorchRunner._pick_prefill_attention(cuda, "auto") == "triton"
    assert TorchRunner._pick_decode_attention(cuda, "auto") == "triton"
    assert TorchRunner._pick_decode_products(cuda, "auto", "plain") == "triton"
    # quantized layers fused where that measured faster: int8, or int4 up to a hidden size of 2048
    assert TorchRunner._pick_decode_products(cuda, "auto", "quantized") == "torch"
    assert TorchRunner._pick_decode_products(on("cuda", hidden=2048), "auto", "quantized") == "triton"
    assert TorchRunner._pick_decode_products(on("cuda", bits=8), "auto", "quantized") == "triton"
    assert TorchRunner._pick_decode_products(cuda, "auto", None) == "torch"
    assert TorchRunner._pick_prefill_attention(cpu, "auto") == "torch"
    assert TorchRunner._pick_decode_attention(cpu, "auto") == "torch"
    assert TorchRunner._pick_decode_products(cpu, "auto", "plain") == "torch"
    assert TorchRunner._pick_decode_products(on("cpu", bits=8), "auto", "quantized") == "torch"
