"""The batch-invariant row products (runners/torch_triton_rows.py), run by Triton's CPU
interpreter: each layer function against torch_layers' version of it; rows computed 5 and 17 at
a time against the same rows computed one at a time, bit for bit; and a runner's verification
step against plain one-token steps of the same tokens, bit for bit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import tinyinfer
from tests.interpreted import REPO, run_interpreted
from tinyinfer.errors import TinyInferError

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed; scripts/gpu_rows_check.py runs "
                                         "the kernel on a GPU")


@needs_triton
def test_row_products_match_torch_layers_in_interpreter():
    """float32, sizes that fill no tile evenly, 1, 5 and 17 rows (two row tiles), with and
    without biases, weights through registers or Triton's pipeline, one split and several (under
    a norm too: each split's sum of squares added by the last): the same outputs as torch_layers
    (the residual sums bit for bit, each split writing its share)."""
    code = """
import torch
from tinyinfer.runners import torch_layers as L
from tinyinfer.runners import torch_triton_rows as R
torch.manual_seed(0)
def close(a, b):
    return float((a - b).norm() / b.norm()) < 1e-6
for rows, bias in ((1, False), (5, True), (17, False)):
    # 4 splits of 3 blocks of inputs: one split has none; (32, 16, 3): gate|up splits evenly (EVEN)
    for config in (None, R.Config(16, 32, 4), R.Config(32, 16, 3, stages=3)):
        d, f, qkv_out, vocab = 96, 160, 144, 200
        x, r, attn = torch.randn(rows, d), torch.randn(rows, d), torch.randn(rows, d)
        norm = 1 + 0.1 * torch.randn(d)
        w = {name: 0.1 * torch.randn(shape) for name, shape in
             dict(qkv=(qkv_out, d), o=(d, d), up=(2 * f, d), down=(d, f), head=(vocab, d)).items()}
        b = {name: torch.randn(w[name].shape[0]) if bias else None for name in w}
        total = torch.empty_like(x)
        got = R.rows_product(x, w['qkv'], b['qkv'], norm=norm, residual=r, sum_out=total, eps=1e-5,
                             config=config)
        ref_x, ref = L.attention_input(x, r, norm, None, w['qkv'], b['qkv'], 1e-5)
        assert torch.equal(total, ref_x) and close(got, ref), (rows, config)
        got_x = R.rows_product(attn, w['o'], b['o'], add=x, config=config)
        h = R.rows_product(got_x, w['up'], b['up'], norm=norm, eps=1e-5, gated=True, config=config)
        got = R.rows_product(h, w['down'], b['down'], config=config)
        ref_x, ref = L.mlp_block(x, attn, w['o'], b['o'], norm, None, w['up'], b['up'], w['down'],
                                 b['down'], 1e-5, True)
        assert close(got_x, ref_x) and close(got, ref), (rows, config)
        got = R.rows_product(x, w['head'], norm=norm, residual=r, sum_out=torch.empty_like(x),
                             eps=1e-5, out_dtype=torch.float32, config=config)
        assert close(got, L.final_logits(x, r, norm, None, w['head'], 1e-5)), (rows, config)
got_x, got = R.mlp_block(x, attn, w['o'], None, norm, None, w['up'], None, w['down'], None, 1e-5, True)
ref_x, ref = L.mlp_block(x, attn, w['o'], None, norm, None, w['up'], None, w['down'], None, 1e-5, True)
assert close(got_x, ref_x) and close(got, ref)
print('ok')
"""
    run_interpreted(code)


@needs_triton
def test_split_products_count_their_tiles_at_any_step_the_runner_takes():
    """The row kernel splits q|k|v and down products whatever the number of rows (its tiles
    depend on the shape alone), so a long prefill chunk with ``batch_invariant`` multiplies the
    tiles of outputs by its row tiles: every such launch must find a counter per tile."""
    from tinyinfer.runners import torch_triton_rows as R
    from tinyinfer.runners.triton_common import split_fits

    # (outputs, inputs, norm): 1B, 8B and 70B q|k|v, 8B and 70B down
    shapes = ((3072, 2048, True), (6144, 4096, True), (10240, 8192, True), (4096, 14336, False),
              (8192, 28672, False))
    assert R.pick_config(6144, 4096, False, True).split_k > 1
    for n, k, norm in shapes:
        config = R.pick_config(n, k, False, norm)
        for rows in (1, 17, 512, 8192, 16384):
            tiles = -(-n // config.block_n) * -(-rows // R.ROWS)
            assert split_fits(tiles), (n, k, rows, tiles)


@needs_triton
def test_rows_together_equal_rows_alone_bit_for_bit():
    """Each product kind with its prologue and epilogue, weights through registers and through
    Triton's pipeline, one split or two: 5 and 17 rows in one launch give every row exactly what
    a launch of that row alone gives. The comparison is bit for bit and can fail: the same rows through a
    different order of the sum (the inputs split in two instead of one) differ in their last
    bits."""
    code = """
import torch
from tinyinfer.runners import torch_triton_rows as R
torch.manual_seed(1)
d, f = 96, 160
norm = 1 + 0.1 * torch.randn(d)
w = {name: 0.1 * torch.randn(shape) for name, shape in
     dict(qkv=(144, d), o=(d, d), up=(2 * f, d), down=(d, f), head=(200, d)).items()}
bias = torch.randn(144)
def normed(x, config):
    short = x[:, :d].contiguous()
    r = torch.ones_like(short) * 0.5
    return [R.rows_product(short, w['qkv'], bias, norm=norm, residual=r, sum_out=torch.empty_like(r),
                           eps=1e-5, config=config),
            R.rows_product(short, w['up'], norm=norm, eps=1e-5, gated=True, config=config),
            R.rows_product(short, w['head'], norm=norm, residual=r, sum_out=torch.empty_like(r),
                           eps=1e-5, out_dtype=torch.float32, config=config)]
def plain(x, config):
    short = x[:, :d].contiguous()
    return [R.rows_product(short, w['o'], add=torch.ones_like(short) * 0.5, config=config),
            R.rows_product(x, w['down'], config=config)]
x = torch.randn(17, f)
for config in (R.Config(16, 32), R.Config(32, 16, stages=3), R.Config(16, 32, 2)):
    for products in (normed, plain):
        alone = [products(x[i:i + 1], config) for i in range(17)]
        for m in (5, 17):
            together = products(x[:m], config)
            for kind, out in enumerate(together):
                for i in range(m):
                    assert torch.equal(out[i], alone[i][kind][0]), (config, m, kind, i)
for products in (normed, plain):  # 6 steps of 16 inputs or more: two splits add them in another order
    one_split = products(x[:5], R.Config(16, 16))
    assert not all(torch.equal(a, b) for a, b in zip(products(x[:5], R.Config(16, 16, 2)), one_split))
print('ok')
"""
    run_interpreted(code)


@needs_triton
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias"])
def test_verification_step_equals_plain_steps_bit_for_bit(name, oracle_model):
    """A runner with batch_invariant=True (the row products and the Triton decode attention,
    here under Triton's CPU interpreter): the logits of one verification step of 5 tokens are
    those of 5 plain one-token steps over the same tokens, bit for bit, and match the torch
    path's."""
    folder, _ = oracle_model(name)
    code = (
        "import numpy as np\nimport tinyinfer\n"
        "from tinyinfer.runners.runner import make_batch\n"
        f"ref = tinyinfer.load({str(folder)!r}, runner='torch', device='cpu').runner\n"
        f"runner = tinyinfer.load({str(folder)!r}, runner='torch', device='cpu', decode_products='triton',\n"
        "                        decode_attention='triton', batch_invariant=True).runner\n"
        "prompt, follow, table = [5, 9, 2, 11, 3, 8, 1], [7, 12, 4, 30, 2], [0, 1, 2, 3]\n"
        "caches = [runner.new_kv_cache(8, 4) for _ in range(2)] + [ref.new_kv_cache(8, 4)]\n"
        "for r, kv in zip((runner, runner, ref), caches):\n"
        "    r.forward(make_batch([(prompt, 0, table, False)], 4), kv)\n"
        "plain = np.concatenate([runner.forward(make_batch([([t], 7 + i, table, False)], 4), caches[0])\n"
        "                        for i, t in enumerate(follow)])\n"
        "verify = runner.forward(make_batch([(follow, 7, table, True)], 4), caches[1])\n"
        "assert np.array_equal(plain, verify), np.abs(plain - verify).max()\n"
        "torch_path = ref.forward(make_batch([(follow, 7, table, True)], 4), caches[2])\n"
        "assert np.abs(verify - torch_path).max() <= 1e-5 * np.abs(torch_path).max()\n"
        "print('ok')\n"
    )
    run_interpreted(code)


@needs_triton
def test_batch_invariant_rows_are_computed_alike_whatever_shares_their_step(oracle_model):
    """With batch_invariant (under Triton's CPU interpreter), a sequence's logits do not depend
    on the other sequences of its step, bit for bit: a short prompt alone (one q, so it takes
    the decode attention) and beside a prompt of another length, beside a long prompt (a
    prefill chunk, itself as alone) and beside decoding rows; a verification of 5 tokens alone
    and beside a prefill chunk."""
    folder, _ = oracle_model("llama-gqa-untied")
    code = (
        "import numpy as np\nimport tinyinfer\n"
        "from tinyinfer.runners.runner import make_batch\n"
        f"runner = tinyinfer.load({str(folder)!r}, runner='torch', device='cpu', decode_products='triton',\n"
        "                        decode_attention='triton', batch_invariant=True).runner\n"
        "A, B, C = [5, 9, 2, 11, 3, 8, 1, 17, 40, 22], [3, 3, 8, 21, 9, 10, 2], list(range(1, 31))\n"
        "ta, tb, tc = [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]\n"
        "def last_rows(*seqs):\n"
        "    return runner.forward(make_batch(list(seqs), 4), runner.new_kv_cache(16, 4))\n"
        "alone, long_alone = last_rows((A, 0, ta, False))[0], last_rows((C, 0, tc, False))[0]\n"
        "for other in [(B, 0, tb, False), (C, 0, tc, False), ([7], 0, tb, False)]:\n"
        "    beside = last_rows((A, 0, ta, False), other)\n"
        "    assert np.array_equal(alone, beside[0]), (len(other[0]), np.abs(alone - beside[0]).max())\n"
        "    if other[0] is C:  # the prefill chunk beside the decode group computes as alone too\n"
        "        assert np.array_equal(long_alone, beside[1]), np.abs(long_alone - beside[1]).max()\n"
        "def verify(*others):\n"
        "    kv = runner.new_kv_cache(16, 4)\n"
        "    runner.forward(make_batch([(A, 0, ta, False)], 4), kv)\n"
        "    return runner.forward(make_batch([([4, 6, 1, 2, 9], 10, ta, True), *others], 4), kv)[:5]\n"
        "alone, together = verify(), verify((C, 0, tc, False))\n"
        "assert np.array_equal(alone, together), np.abs(alone - together).max()\n"
        "print('ok')\n"
    )
    run_interpreted(code)


def test_batch_invariant_needs_the_fused_products(oracle_model, without_triton_interpreter):
    folder, _ = oracle_model("llama-gqa-untied")
    assert tinyinfer.load(folder, runner="torch", device="cpu").runner.describe()["batch_invariant"] is False
    with pytest.raises(TinyInferError, match="batch_invariant needs the fused products"):
        tinyinfer.load(folder, runner="torch", device="cpu", batch_invariant=True)


@pytest.mark.parametrize("extra, message", [
    ([], "tinyinfer: error: --batch-invariant applies to the torch runner: add --runner torch"),
    (["--runner", "torch", "--device", "cpu"], "tinyinfer: error: batch_invariant needs the fused products"),
])
def test_batch_invariant_flag_errors_in_one_line(extra, message):
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "hi", "--batch-invariant", *extra],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr


@needs_triton
def test_each_step_takes_the_layer_functions_its_rows_call_for(oracle_model):
    """TorchRunner._layer_fns with decode_products="triton" (under Triton's CPU interpreter):
    one decode row the matrix-vector kernels, two their few-row program, 3..16 rows the row
    kernel, more the compiled functions, prefill chunks (with any decode rows beside them) eager;
    with batch_invariant every step the row kernel, whatever its rows, prefill chunks too.
    Quantized weights run two rows (one sequence's two tokens too) through the fused products'
    row axis, a quantized head unfused at one row and two, and have no row kernel: their steps
    of 3..16 rows run the compiled functions, and batch_invariant is refused for them."""
    folder, _ = oracle_model("llama-gqa-untied")
    code = f"""
import tinyinfer
from tinyinfer.errors import TinyInferError
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import FUSED_MAX_ROWS

def load(**options):
    return tinyinfer.load({str(folder)!r}, runner="torch", device="cpu", decode_products="triton", **options).runner

def decoding(sequences, tokens=1):
    return [(list(range(1, tokens + 1)), 2, [4 * i + j for j in range(4)], tokens > 1) for i in range(sequences)]

def fns(runner, entries):
    return runner._layer_fns(runner._step_inputs(make_batch(entries, 4), 4))[0]

mixed = [([5, 9, 2, 11, 3, 8], 0, [0, 1], False), ([4], 6, [2, 3], False)]
runner = load()
assert fns(runner, decoding(1)) is runner._fused["gemv"]
assert runner._fused["few"] is not runner._fused["gemv"]  # one tuple each, so `is` tells them apart
assert fns(runner, decoding(2)) is runner._fused["few"] and runner.few_rows == 2
assert fns(runner, decoding(1, tokens=2)) is runner._fused["few"]  # a verification of 1 draft
assert fns(runner, decoding(3)) is runner._fused["rows"]
assert fns(runner, decoding(1, tokens=5)) is runner._fused["rows"]  # a verification of 4 drafts
assert fns(runner, decoding(FUSED_MAX_ROWS)) is runner._fused["rows"]
assert fns(runner, decoding(FUSED_MAX_ROWS + 1)) is runner._decode_fns
assert fns(runner, decoding(2, tokens=9)) is runner._decode_fns  # 18 rows
assert fns(runner, mixed) is runner._eager
invariant = load(decode_attention="triton", batch_invariant=True)
for entries in (decoding(1), decoding(2), decoding(FUSED_MAX_ROWS + 1), decoding(2, tokens=9), mixed):
    assert fns(invariant, entries) is invariant._fused["rows"]
quantized = load(quantize="int8", quant_kernel="triton")
assert fns(quantized, decoding(1)) is quantized._fused["gemv"]
assert fns(quantized, decoding(2)) is quantized._fused["few"] and quantized.few_rows == 2
assert fns(quantized, decoding(1, tokens=2)) is quantized._fused["few"]  # a draft's two-token catch-up
assert fns(quantized, decoding(3)) is quantized._decode_fns
headed = load(quantize="int8", quantize_head=True, quant_kernel="triton")
# a quantized head's product runs unfused (after the compiled norm) at one row and at two
assert headed._fused["gemv"][2] is headed._decode_fns[2] and headed._fused["few"][2] is headed._decode_fns[2]
assert quantized._fused["few"][2] is not quantized._decode_fns[2]  # a 16-bit head: fused
try:
    load(quantize="int8", quant_kernel="triton", decode_attention="triton", batch_invariant=True)
except TinyInferError as error:
    assert "batch_invariant needs the fused products" in str(error)
else:
    raise AssertionError("batch_invariant with quantized weights was taken")
print("ok")
"""
    run_interpreted(code)
