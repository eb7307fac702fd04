"""Programmatic dependent launch (the torch runner's ``pdl`` option; runners/triton_common.py):
where it is refused, how the choice reaches the kernels' launches, and that the kernels run
without it under Triton's CPU interpreter, which has no ``gdc_wait``. On a GPU,
scripts/gpu_pdl_check.py checks that it changes no logit and measures what it gains."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tinyinfer
from tests.interpreted import run_interpreted
from tinyinfer.errors import TinyInferError
from tinyinfer.runners import triton_env


def test_pdl_is_off_on_the_cpu_and_refused_when_asked_for(oracle_model, without_triton_interpreter):
    folder, _ = oracle_model("llama-gqa-untied")
    assert tinyinfer.load(folder, runner="torch", device="cpu").runner.describe()["pdl"] is False
    assert tinyinfer.load(folder, runner="torch", device="cpu", pdl=False).runner.pdl is False
    with pytest.raises(TinyInferError, match="compute capability 9.0 or later") as refused:
        tinyinfer.load(folder, runner="torch", device="cpu", pdl=True)
    assert "\n" not in str(refused.value) and "pdl=False" in str(refused.value)


def test_the_choice_holds_inside_its_block_and_on_capable_devices_only(monkeypatch):
    """``launches_dependent`` says yes only inside ``dependent_launch(True)``, innermost block
    first, and only for a device that supports it (a Hopper card, marked so here: this machine
    has none); the CPU never does."""
    cpu, card = torch.device("cpu"), torch.device("cuda", 7)
    assert not triton_env.supports_dependent_launch(cpu)
    monkeypatch.setitem(triton_env._capable, card, True)
    assert not triton_env.launches_dependent(card)
    with triton_env.dependent_launch(True):
        assert triton_env.launches_dependent(card) and not triton_env.launches_dependent(cpu)
        with triton_env.dependent_launch(False):
            assert not triton_env.launches_dependent(card)
        assert triton_env.launches_dependent(card)
    assert not triton_env.launches_dependent(card)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_pdl_check.py runs the kernels on a GPU")
def test_the_kernels_run_without_it_under_the_interpreter():
    """Under TRITON_INTERPRET=1 the runner refuses pdl=True (the interpreter has no gdc_wait,
    which fails there), and the kernels launched inside ``dependent_launch(True)`` run as plain
    launches: the same results, bit for bit, as outside it."""
    run_interpreted("""
import numpy as np, torch
from tinyinfer.config import config_from_dict
from tinyinfer.errors import TinyInferError
from tinyinfer.quant import QuantConfig, quantize
from tinyinfer.runners import torch_layers as layers, torch_triton, triton_env
from tinyinfer.runners import torch_triton_gemv as G
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.torch_weights import random_weights
import triton, triton.language as tl
from triton.language.extra.cuda import gdc_wait

@triton.jit
def waits(x_ptr):
    gdc_wait()
    tl.store(x_ptr, 1.0)

try:  # why the helpers skip it there
    waits[(1,)](torch.zeros(1))
    raise SystemExit("gdc_wait ran under the interpreter")
except Exception as error:
    assert "gdc_wait ran" not in str(error)

config = config_from_dict(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=64))
try:
    TorchRunner(config, random_weights(config, device="cpu", dtype="float32"), device="cpu",
                decode_products="triton", pdl=True)
    raise SystemExit("pdl=True was taken under the interpreter")
except TinyInferError as error:
    assert "pdl=False" in str(error)

torch.manual_seed(0)
x, r, w, norm = torch.randn(1, 96), torch.randn(1, 96), 0.1 * torch.randn(80, 96), 1 + 0.1 * torch.randn(96)
qw = quantize(np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32), QuantConfig.parse("int4-g32"))
kw = layers.kernel_weight(qw, torch.device("cpu"))
xq = torch.randn(1, 128)
qkv = torch.randn(1, 4 * 16)
cache = torch.randn(2, 8, 4, 1, 16)
def launches():
    k_cache, v_cache = cache.clone().unbind(0)
    attention = torch_triton.paged_decode_attention(
        qkv, torch.tensor([9]), torch.tensor([9]), torch.tensor([[0, 1, 2]]), k_cache, v_cache, None, None, 2,
        num_splits=2, pdl=True)
    total = torch.empty_like(x)
    return [G.gemv(x, w, norm=norm, residual=r, sum_out=total, eps=1e-5), total, G.gemv(x, w[:48], gated=True),
            G.gemv(xq, kw, norm=1 + 0.1 * xq[0], eps=1e-5), attention, k_cache]
with triton_env.dependent_launch(True):  # the interpreter has no gdc_wait: the kernels must not ask
    assert not triton_env.launches_dependent(torch.device("cpu"))
    launches()
print("ok")
""")
