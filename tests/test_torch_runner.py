"""The torch fast runner, pinned to the NumPy reference: same logits, same greedy tokens."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tinyinfer
from tests.conftest import ORACLE_CONFIGS
from tests.interpreted import run_interpreted
from tinyinfer.config import config_from_dict
from tinyinfer.engine_config import EngineConfig
from tinyinfer.errors import TinyInferError
from tinyinfer.runners.numpy_ref import NumpyRunner
from tinyinfer.runners.runner import make_batch
from tinyinfer.runners.torch_fast import TorchRunner
from tinyinfer.runners.torch_weights import random_weights

NAMES = sorted(ORACLE_CONFIGS)
REPO = Path(__file__).resolve().parents[1]


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def load_pair(folder, **options) -> tuple[tinyinfer.Model, tinyinfer.Model]:
    return tinyinfer.load(folder), tinyinfer.load(folder, runner="torch", device="cpu", **options)


def mixed_schedule(vocab: int, page_size: int, seed: int):
    """Four sequences over four steps: whole prefills, a chunk after a cached prefix, decodes,
    a one-token prompt, and a chunk scored at every position; pages shuffled across sequences.
    Yields the make_batch entries of each step."""
    rng = np.random.default_rng(seed)
    lengths = {"a": 11, "b": 6, "c": 4, "d": 10}
    ids = {s: rng.integers(0, vocab, n).tolist() for s, n in lengths.items()}
    pages = rng.permutation(32).tolist()
    tables = {s: [pages.pop() for _ in range(-(-n // page_size))] for s, n in lengths.items()}

    def entry(s: str, start: int, end: int, all_logits: bool = False):
        return (ids[s][start:end], start, tables[s], all_logits)

    yield [entry("a", 0, 6), entry("b", 0, 3), entry("c", 0, 1)]
    yield [entry("a", 6, 10), entry("b", 3, 4), entry("c", 1, 2), entry("d", 0, 5)]
    yield [entry("b", 4, 5), entry("a", 10, 11), entry("c", 2, 3), entry("d", 5, 9, True)]
    yield [entry("c", 3, 4), entry("d", 9, 10), entry("b", 5, 6)]


def assert_runners_agree(ref_runner, fast_runner, steps, page_size: int, tol: float) -> None:
    ref_kv = ref_runner.new_kv_cache(32, page_size)
    fast_kv = fast_runner.new_kv_cache(32, page_size)
    for entries in steps:
        batch = make_batch(entries, page_size)
        ref = ref_runner.forward(batch, ref_kv)
        ours = fast_runner.forward(batch, fast_kv)
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        assert relative_error(ours, ref) <= tol


@pytest.mark.parametrize("name", NAMES)
def test_float32_logits_match_reference(name, oracle_model):
    folder, _ = oracle_model(name)
    ref, fast = load_pair(folder)
    ids = np.random.default_rng(7).integers(0, ref.config.vocab_size, 45).tolist()
    assert relative_error(fast.logits(ids), ref.logits(ids)) <= 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_mixed_batches_match_reference(name, oracle_model):
    """Prefill chunks and decodes in one forward, through pages out of order."""
    folder, _ = oracle_model(name)
    ref, fast = load_pair(folder)
    steps = mixed_schedule(ref.config.vocab_size, page_size=4, seed=len(name))
    assert_runners_agree(ref.runner, fast.runner, steps, page_size=4, tol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_verification_batches_match_reference(name, oracle_model):
    """Uniform batches of q tokens per sequence with every row's logits — a verification step,
    which takes the decode attention path — match the reference, after and between decodes."""
    folder, _ = oracle_model(name)
    ref, fast = load_pair(folder)
    rng = np.random.default_rng(9)
    ids = rng.integers(0, ref.config.vocab_size, (3, 24)).tolist()
    tables = [[7, 2, 11, 4, 0, 9], [1, 8, 3, 10, 5, 6], [12, 13, 14, 15, 16, 17]]
    bounds = [(0, 7), (7, 12), (12, 13), (13, 16), (16, 21)]  # prefill, q = 5, decode, 3, 5
    steps = ([(ids[s][a:b], a, tables[s], b - a > 1 and a > 0) for s in range(3)] for a, b in bounds)
    assert_runners_agree(ref.runner, fast.runner, steps, page_size=4, tol=1e-4)


def test_bundled_model_matches_reference():
    ref, fast = load_pair("bundled")
    ids = np.random.default_rng(3).integers(0, ref.config.vocab_size, 64).tolist()
    assert relative_error(fast.logits(ids), ref.logits(ids)) <= 1e-4
    steps = mixed_schedule(ref.config.vocab_size, page_size=16, seed=5)
    assert_runners_agree(ref.runner, fast.runner, steps, page_size=16, tol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied", "qwen2-bias"])
def test_greedy_generations_identical_through_engine(name, oracle_model):
    """Several prompts, chunked prefill mixed with decodes, both runners, same tokens."""
    folder, _ = oracle_model(name)
    ref, fast = load_pair(folder)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, ref.config.vocab_size, n).tolist() for n in (1, 9, 30, 17)]
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = []
    for model in (ref, fast):
        engine = tinyinfer.Engine(model, page_size=4, max_num_batched_tokens=16)
        outputs.append([c.token_ids for c in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 20 for tokens in outputs[0])


def test_copy_page_copies_every_layer(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    runner = tinyinfer.load(folder, runner="torch", device="cpu").runner
    kv = runner.new_kv_cache(4, 4)
    ids = np.arange(1, 7).tolist()
    runner.forward(make_batch([(ids, 0, [2, 0], False)], 4), kv)
    runner.copy_page(kv, 2, 3)
    assert torch.equal(kv.k[:, 3], kv.k[:, 2]) and torch.equal(kv.v[:, 3], kv.v[:, 2])
    assert kv.k[:, 2].abs().sum() > 0


def test_compiled_decode_matches_reference(oracle_model):
    """torch.compile of the layer functions (one decode shape, so it compiles once)."""
    folder, _ = oracle_model("llama-gqa-untied")
    ref, fast = load_pair(folder, compile=True)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, ref.config.vocab_size, (3, 6))
    tables = [[5, 1], [0, 6], [3, 2]]
    steps = ([(ids[s, t:t + 1].tolist(), t, tables[s], False) for s in range(3)] for t in range(6))
    assert_runners_agree(ref.runner, fast.runner, steps, page_size=4, tol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_random_weights_cover_every_weight_the_reference_reads(family):
    raw = {"gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                        n_positions=64),
           "llama": dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)}[family]
    config = config_from_dict(raw)
    weights = random_weights(config, device="cpu", dtype="float32", seed=1, std=0.2)
    ref = NumpyRunner(config, {name: w.numpy() for name, w in weights.items()})
    fast = TorchRunner(config, weights, device="cpu")
    steps = mixed_schedule(config.vocab_size, page_size=4, seed=2)
    assert_runners_agree(ref, fast, steps, page_size=4, tol=1e-4)


def test_bad_options_raise_errors_that_say_what_to_do(oracle_model, without_triton_interpreter):
    folder, _ = oracle_model("gpt2")
    with pytest.raises(TinyInferError, match="float32"):
        tinyinfer.load(folder, runner="torch", device="cpu", dtype="int8")
    with pytest.raises(TinyInferError, match="cuda_graphs=False"):
        tinyinfer.load(folder, runner="torch", device="cpu", cuda_graphs=True)
    with pytest.raises(TinyInferError, match="decode_attention='torch'"):
        tinyinfer.load(folder, runner="torch", device="cpu", decode_attention="triton")
    if not torch.cuda.is_available():
        with pytest.raises(TinyInferError, match="use device cpu"):
            tinyinfer.load(folder, runner="torch", device="cuda")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_check.py runs the kernel on a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_decode_kernel_matches_torch_version_in_interpreter(kv_cache_dtype):
    """The Triton kernel, run by Triton's CPU interpreter, equals the gather + mask version:
    same outputs, and the same new K/V (int8: the same codes and scales) written to the cache."""
    code = (
        "import torch\n"
        "from tinyinfer.runners import torch_layers, torch_triton\n"
        "torch.manual_seed(0)\n"
        f"int8 = {kv_cache_dtype == 'int8'}\n"
        "for heads, kv_heads, hd, page, rope in [(4, 2, 16, 4, True), (6, 2, 24, 4, True),\n"
        "                                        (4, 4, 16, 8, False), (4, 1, 32, 16, True)]:\n"
        "    if int8:  # random codes, and scales of about a bf16 cache's spread\n"
        "        k_cache, v_cache = torch.randint(-127, 128, (2, 60, page, kv_heads, hd), dtype=torch.int8).unbind(0)\n"
        "        scales = (torch.rand(2, 60, page, kv_heads) * 0.03).half().unbind(0)\n"
        "    else:\n"
        "        k_cache, v_cache = torch.randn(2, 60, page, kv_heads, hd).unbind(0)\n"
        "        scales = ()\n"
        "    qkv = torch.randn(3, (heads + 2 * kv_heads) * hd)\n"
        "    positions = torch.tensor([0, 5, 18 * page - 1])  # 18 pages: several 64-key splits\n"
        "    tables = torch.randperm(60)[:54].view(3, 18)  # each sequence owns its pages\n"
        "    slots = tables[torch.arange(3), positions // page] * page + positions % page\n"
        "    angles = torch.arange(512.0, dtype=torch.float64)[:, None] * torch.rand(hd // 2)\n"
        "    cos, sin = (angles.cos().float(), angles.sin().float()) if rope else (None, None)\n"
        "    def run(attention, cache, **options):\n"
        "        named = dict(zip(('k_scale', 'v_scale'), cache[2:]))\n"
        "        return attention(qkv, positions, slots, tables, cache[0], cache[1], cos, sin, heads,\n"
        "                         **named, **options)\n"
        "    ref_cache = [t.clone() for t in (k_cache, v_cache, *scales)]\n"
        "    ref = run(torch_layers.paged_decode_attention, ref_cache)\n"
        "    assert not any(torch.equal(a, b) for a, b in zip(ref_cache, (k_cache, v_cache, *scales)))\n"
        "    for splits in (1, 4):\n"
        "        cache = [t.clone() for t in (k_cache, v_cache, *scales)]\n"
        "        out = run(torch_triton.paged_decode_attention, cache, num_splits=splits)\n"
        "        assert torch.allclose(out, ref, atol=1e-5), (heads, kv_heads, hd, splits)\n"
        "        assert all(torch.equal(a, b) for a, b in zip(cache, ref_cache))\n"
        "print('ok')\n"
    )
    run_interpreted(code)


# q new tokens for each of three sequences, as a verification step feeds the attention: the
# builder below is run here and, as text, in the Triton interpreter's subprocess.
VERIFY_CASE = """
def verify_case(heads, kv_heads, hd, page, rope, q_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, 60, page, kv_heads, hd, generator=g).unbind(0)
    qkv = torch.randn(3 * q_len, (heads + 2 * kv_heads) * hd, generator=g)
    first = torch.tensor([0, 5, 18 * page - q_len])  # the last ends on its 18th page
    positions = (first[:, None] + torch.arange(q_len)).flatten()  # [3 q]
    tables = torch.randperm(60, generator=g)[:54].view(3, 18)  # each sequence owns its pages
    seqs = torch.arange(3).repeat_interleave(q_len)
    slots = tables[seqs, positions // page] * page + positions % page
    angles = torch.arange(512.0, dtype=torch.float64)[:, None] * torch.rand(hd // 2, generator=g)
    cos, sin = (angles.cos().float(), angles.sin().float()) if rope else (None, None)
    return qkv, positions, slots, tables, (k_cache, v_cache), cos, sin
"""
exec(VERIFY_CASE)
VERIFY_SHAPES = [(4, 2, 16, 4, True), (6, 2, 24, 4, True), (4, 4, 16, 8, False), (4, 1, 32, 16, True)]


@pytest.mark.parametrize("shape", VERIFY_SHAPES)
def test_decode_attention_takes_several_query_tokens_per_sequence(shape):
    """Verification's q = 5 rows per sequence through the decode path equal the prefill path's
    causal attention (another implementation), and five one-row decode steps."""
    from tinyinfer.runners import torch_layers

    heads, kv_heads, hd, page, rope = shape
    qkv, positions, slots, tables, cache, cos, sin = verify_case(*shape, q_len=5)  # noqa: F821
    got_cache = tuple(c.clone() for c in cache)
    got = torch_layers.paged_decode_attention(qkv, positions, slots, tables, *got_cache, cos, sin, heads)
    assert got.shape == (15, heads * hd)
    ref_cache = tuple(c.clone() for c in cache)
    for b in range(3):
        rows = slice(5 * b, 5 * b + 5)
        q, k, v = torch_layers.split_qkv(qkv[rows], heads, kv_heads, hd)
        if rope:
            c, s = cos[positions[rows]], sin[positions[rows]]
            q, k = torch_layers.apply_rope(q, c, s), torch_layers.apply_rope(k, c, s)
        torch_layers.write_kv(*ref_cache, slots[rows], k, v)
        context = int(positions[rows][-1]) + 1
        ref = torch_layers.prefill_attention(q, k, v, positions[rows], *ref_cache,
                                             tables[b, :-(-context // page)], context)
        torch.testing.assert_close(got[rows], ref.flatten(1), atol=1e-5, rtol=1e-5)
    assert torch.equal(got_cache[0], ref_cache[0]) and torch.equal(got_cache[1], ref_cache[1])
    step_cache = tuple(c.clone() for c in cache)
    for j in range(5):  # the same tokens decoded one step at a time
        rows = torch.arange(3) * 5 + j
        one = torch_layers.paged_decode_attention(qkv[rows], positions[rows], slots[rows], tables,
                                                  *step_cache, cos, sin, heads)
        torch.testing.assert_close(one, got[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_spec_bench.py runs the kernel on a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_kernel_verifies_drafts_row_for_row_as_it_decodes(kv_cache_dtype):
    """In Triton's CPU interpreter: the kernel with 5 query rows per sequence matches the torch
    version, and each row equals, bit for bit, the same token decoded alone (q = 1) over the
    same cache — one attention path for decode and verification (int8 K/V: codes and scales
    written and read the same way on both paths)."""
    code = "import torch\nfrom tinyinfer.runners import torch_layers, torch_triton\n" + VERIFY_CASE + (
        "for heads, kv_heads, hd, page, rope in %r:\n"
        "    qkv, positions, slots, tables, cache, cos, sin = verify_case(heads, kv_heads, hd, page, rope, 5)\n"
        "    if %r:  # random int8 codes, and scales of about a bf16 cache's spread\n"
        "        g = torch.Generator().manual_seed(1)\n"
        "        codes = torch.randint(-127, 128, (2, *cache[0].shape), dtype=torch.int8, generator=g)\n"
        "        scales = (torch.rand(2, *cache[0].shape[:3], generator=g) * 0.03).half()\n"
        "        cache = (*codes.unbind(0), *scales.unbind(0))\n"
        "    def attend(attention, qkv, positions, slots, cache, **options):\n"
        "        named = dict(zip(('k_scale', 'v_scale'), cache[2:]))\n"
        "        return attention(qkv, positions, slots, tables, cache[0], cache[1], cos, sin, heads,\n"
        "                         **named, **options)\n"
        "    ref_cache = tuple(c.clone() for c in cache)\n"
        "    ref = attend(torch_layers.paged_decode_attention, qkv, positions, slots, ref_cache)\n"
        "    for splits in (1, 4):\n"
        "        got_cache = tuple(c.clone() for c in cache)\n"
        "        got = attend(torch_triton.paged_decode_attention, qkv, positions, slots, got_cache,\n"
        "                     num_splits=splits)\n"
        "        assert torch.allclose(got, ref, atol=1e-5), (heads, kv_heads, hd, splits)\n"
        "        assert all(torch.equal(a, b) for a, b in zip(got_cache, ref_cache))\n"
        "        step_cache = tuple(c.clone() for c in cache)\n"
        "        for j in range(5):\n"
        "            rows = torch.arange(3) * 5 + j\n"
        "            one = attend(torch_triton.paged_decode_attention, qkv[rows], positions[rows],\n"
        "                         slots[rows], step_cache, num_splits=splits)\n"
        "            assert torch.equal(one, got[rows]), (heads, kv_heads, hd, splits, j)\n"
        "        assert all(torch.equal(a, b) for a, b in zip(step_cache, got_cache))\n"
        "print('ok')\n"
    ) % (VERIFY_SHAPES, kv_cache_dtype == "int8")
    run_interpreted(code)


def test_forward_top_agrees_with_full_logits(oracle_model):
    """The on-device top-k reduction the engine uses for greedy rows matches the full logits."""
    from tinyinfer.runners.runner import make_batch

    folder, _ = oracle_model("llama-gqa-untied")
    runner = tinyinfer.load(folder, runner="torch").runner
    ids = list(range(3, 40))
    batch = make_batch([(ids, 0, [0, 1, 2], True)], 16)
    full = runner.forward(batch, runner.new_kv_cache(3, 16))
    top = runner.forward_top(batch, runner.new_kv_cache(3, 16), 5)
    assert (top.ids[:, 0] == full.argmax(axis=1)).all()
    np.testing.assert_allclose(top.values[:, 0], full.max(axis=1), rtol=1e-6)
    lse = np.log(np.exp(full - full.max(1, keepdims=True)).sum(1)) + full.max(1)
    np.testing.assert_allclose(top.logsumexp, lse, rtol=1e-5)


def test_a_bf16_pool_holds_twice_the_pages_of_a_float32_one_for_the_same_budget(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    fp32 = tinyinfer.load(folder, runner="torch", device="cpu", dtype="float32")
    bf16 = tinyinfer.load(folder, runner="torch", device="cpu", dtype="bfloat16")
    block = 4
    full_context = -(-fp32.config.max_model_len // block)
    fp32_page = fp32.config.kv_bytes_per_token(4) * block
    # A budget of 2 full contexts at float32: above the one-context floor, below 16 sequences' cap.
    budget = EngineConfig(page_size=block, kv_cache_memory=2 * full_context * fp32_page, max_num_seqs=16)
    pools = {m.runner.info.dtype: tinyinfer.Engine(m, budget) for m in (fp32, bf16)}
    assert pools["float32"].pool.num_pages == 2 * full_context
    assert pools["bfloat16"].pool.num_pages == 4 * full_context
    for engine in pools.values():
        assert engine.pool.num_pages * engine.page_bytes == budget.kv_cache_memory  # what it pays for
        assert engine.kv_cache.num_pages == engine.pool.num_pages


# ---------------------------------------------------------------- int8 K/V


def int8_pair(source, **options) -> tuple[tinyinfer.Model, tinyinfer.Model]:
    """The reference and the torch runner (fp32, CPU), both with int8 K/V."""
    return (tinyinfer.load(source, kv_cache_dtype="int8"),
            tinyinfer.load(source, runner="torch", device="cpu", kv_cache_dtype="int8", **options))


def test_torch_quantizes_kv_exactly_as_the_reference():
    """Same codes, same float16 scales (rounded up), on values at every scale, zeros included."""
    from tinyinfer.quant import quantize_kv
    from tinyinfer.runners import torch_layers

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((200, 4, 24)) * 10.0 ** rng.uniform(-7, 3, (200, 4, 1))).astype(np.float32)
    x[0, 1] = 0
    codes, scales = torch_layers.quantize_kv(torch.from_numpy(x))
    want_codes, want_scales = quantize_kv(x)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)


@pytest.mark.parametrize("name", ["bundled", "llama-gqa-untied", "gpt2"])
def test_int8_kv_logits_match_the_int8_reference(name, oracle_model):
    """Mixed prefill chunks and decodes through shuffled pages: the torch runner with int8 K/V
    computes the reference's int8 K/V function. The two differ only where an fp32 rounding
    difference moves a value across a code boundary (a code off by one), so they sit far
    closer to each other than either sits to float K/V."""
    source = name if name == "bundled" else oracle_model(name)[0]
    ref, fast = int8_pair(source)
    page = 16 if name == "bundled" else 4
    float_ref = tinyinfer.load(source).runner
    ref_kv, fast_kv, float_kv = (r.new_kv_cache(32, page) for r in (ref.runner, fast.runner, float_ref))
    for entries in mixed_schedule(ref.config.vocab_size, page_size=page, seed=9):
        batch = make_batch(entries, page)
        want, got = ref.runner.forward(batch, ref_kv), fast.runner.forward(batch, fast_kv)
        unquantized = float_ref.forward(batch, float_kv)
        assert relative_error(got, want) <= 2e-3
        assert relative_error(got, want) < 0.3 * relative_error(want, unquantized)
    assert fast_kv.k.dtype == torch.int8 and fast_kv.k_scale.dtype == torch.float16
    codes_differ = (fast_kv.k[:, :32].numpy() != np.stack(ref_kv.k)).mean()
    assert codes_differ < 1e-2


def test_int8_kv_greedy_tokens_identical_to_the_reference_over_a_long_generation():
    """Four prompts sharing a 40-token prefix (prefix caching on), prefilled in 24-token chunks
    beside running decodes, 160 greedy tokens each: every token the same on both runners."""
    ref, fast = int8_pair("bundled")
    rng = np.random.default_rng(21)
    prefix = rng.integers(0, ref.config.vocab_size, 40).tolist()
    prompts = [prefix + rng.integers(0, ref.config.vocab_size, n).tolist() for n in (3, 30, 11, 57)]
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    outputs, hits = [], []
    for model in (ref, fast):
        engine = tinyinfer.Engine(model, page_size=8, max_num_batched_tokens=24,
                                  enable_prefix_caching=True)
        ids = [engine.add_request(p, params) for p in prompts]
        traces = []
        while engine.has_unfinished():
            traces.append(engine.step())
        outputs.append([engine.release(i).token_ids for i in ids])
        hits.append(sum(len(t.prefix_hit_pages) for t in traces))
        assert any(t.prefill_tokens and t.decode_tokens for t in traces)  # chunks beside decodes
    assert hits[0] == hits[1] > 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 160 for tokens in outputs[0])


def test_int8_kv_cache_takes_about_half_the_bytes_of_bf16_and_the_pool_counts_it():
    """Measured from the cache tensors (codes and scales), and the engine's pool sized by it:
    the same budget holds 2 hd / (hd + 2) times the pages of a bf16 pool (head dim 64 here)."""
    bf16 = tinyinfer.load("bundled", runner="torch", device="cpu", dtype="bfloat16")
    int8 = tinyinfer.load("bundled", runner="torch", device="cpu", dtype="bfloat16", kv_cache_dtype="int8")
    c, pages, block = bf16.config, 10, 4

    def cache_bytes(model: tinyinfer.Model) -> int:
        kv = model.runner.new_kv_cache(pages, block)
        return sum(t.nbytes for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None)

    tokens = (pages + 1) * block  # the scratch page too
    assert cache_bytes(bf16) == tokens * bf16.runner.info.kv_bytes_per_token(c)
    assert cache_bytes(int8) == tokens * int8.runner.info.kv_bytes_per_token(c)
    assert cache_bytes(int8) / cache_bytes(bf16) == (c.head_dim + 2) / (2 * c.head_dim) < 0.55
    full_context = -(-c.max_model_len // block)
    budget = EngineConfig(page_size=block, max_num_seqs=16,
                          kv_cache_memory=2 * full_context * bf16.runner.info.kv_bytes_per_token(c) * block)
    pools = [tinyinfer.Engine(m, budget).pool.num_pages for m in (bf16, int8)]
    assert pools[0] == 2 * full_context
    assert pools[1] == budget.kv_cache_memory // (int8.runner.info.kv_bytes_per_token(c) * block) > 1.8 * pools[0]


def test_int8_kv_copy_page_copies_codes_and_scales(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    runner = tinyinfer.load(folder, runner="torch", device="cpu", kv_cache_dtype="int8").runner
    kv = runner.new_kv_cache(4, 4)
    runner.forward(make_batch([(np.arange(1, 7).tolist(), 0, [2, 0], False)], 4), kv)
    runner.copy_page(kv, 2, 3)
    for pages in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        assert torch.equal(pages[:, 3], pages[:, 2]) and pages[:, 2].abs().sum() > 0


def test_a_kv_cache_dtype_that_is_not_offered_is_refused_in_one_line(oracle_model):
    folder, _ = oracle_model("gpt2")
    for runner in ("numpy", "torch"):
        with pytest.raises(TinyInferError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
            tinyinfer.load(folder, runner=runner, device="cpu", kv_cache_dtype="fp8")
    done = subprocess.run([sys.executable, "-m", "tinyinfer", "generate", "hi", "--kv-cache-dtype", "fp8"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "tinyinfer: error: --kv-cache-dtype: invalid choice fp8 (choose from auto, int8); "
        "see tinyinfer generate --help"]


def test_gather_decode_attention_takes_a_bf16_cache():
    """The gather + mask path (the CPU's, and the GPU check's reference) on a bf16 cache, as the
    GPU runs it: it attends in float32 over the gathered pages and returns bf16 rows equal to the
    same attention over a float32 copy of the cache."""
    from tinyinfer.runners import torch_layers

    qkv, positions, slots, tables, cache, cos, sin = verify_case(4, 2, 16, 4, True, q_len=3)  # noqa: F821
    low = tuple(c.bfloat16() for c in cache)
    got = torch_layers.paged_decode_attention(qkv.bfloat16(), positions, slots, tables, *low, cos, sin, 4)
    exact = tuple(c.float() for c in low)  # the same stored values, in float32
    want = torch_layers.paged_decode_attention(qkv.bfloat16().float(), positions, slots, tables, *exact,
                                               cos, sin, 4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_no_garbage_collection_while_a_graph_captures():
    """A CUDA graph's capture runs with the collector paused (a collection could destroy an old
    graph mid-capture, which CUDA refuses): paused inside, as it was after, an error included.
    (The capture itself needs CUDA: scripts/gpu_spec_bench.py's checks capture graphs.)"""
    import gc

    from tinyinfer.runners.torch_graphs import collection_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError), collection_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_a_rounds_graph_reads_the_step_and_rounds_it_staged(oracle_model):
    """A CUDA graph of greedy rounds reads its inputs from one staged buffer (capturing it needs
    CUDA): here the staging runs on the CPU and the function the graph captures runs eagerly on
    the staged views, padded to 4 sequences and to one more round than asked, one sequence
    sitting the last round out: the argmaxes launch_rounds gives without a graph."""
    from tinyinfer.runners.runner import Rounds
    from tinyinfer.runners.torch_fast import _sat_out_after

    folder, _ = oracle_model("llama-gqa-untied")
    runner = tinyinfer.load(folder, runner="torch", device="cpu").runner
    prompts, pages = ([3, 9, 27, 17], [5, 25, 61], [8, 1, 30, 2, 44]), ([0, 3, 6], [1, 4, 7], [2, 5, 8])
    first = make_batch([(tokens, len(p), table, True) for tokens, p, table in
                        zip(([7, 40], [11, 2], [6, 19]), prompts, pages)], 4)
    positions = np.array([[len(p) + 2 for p in prompts], [len(prompts[0]) + 3, -1, len(prompts[2]) + 3]])
    slots = np.array([[-1 if pos < 0 else table[pos // 4] * 4 + pos % 4 for pos, table in zip(row, pages)]
                      for row in positions])
    rounds = Rounds(positions, slots)
    out = []
    for staged in (False, True):
        kv = runner.new_kv_cache(10, 4)
        runner.forward(make_batch([(list(p), 0, table, False) for p, table in zip(prompts, pages)], 4), kv)
        if not staged:
            out.append(runner.launch_rounds(first, kv, rounds).result())
            continue
        graphs = runner._round_graphs(2, 3, kv)  # a graph of 3 rounds serves 2
        size = graphs.padded_size(first.num_seqs)
        used = graphs._stage(first, size, _sat_out_after(rounds, graphs.rounds), 0)
        graphs.inputs[:used].copy_(graphs.hosts[0][:used])
        with torch.no_grad():
            ids = graphs.step(*graphs._views(graphs.inputs, size))  # [4, 4]
        assert size == 4 and ids.shape == (4, 4)
        ids = ids[:3, :3].numpy().copy()
        ids[1, 2] = -1  # the round the second sequence sat out
        out.append(ids)
    assert (out[0] == out[1]).all(), out
    assert out[0][1, 2] == -1 and (out[0][[0, 2]] >= 0).all()


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_the_layers_pieces_compute_each_step_as_the_reference(name, oracle_model, monkeypatch):
    """Steps no decode graph replays take the layers' pieces on CUDA (``torch_pieces``: each
    layer's parts before and after its attention, captured per padded token count). Capturing
    needs CUDA; here the pieces run uncaptured on their buffers: a 20-token prompt padded to
    32 rows, then the mixed schedule's steps padded to 16 (rows a longer step left behind in
    the buffers included) give the reference's logits; the first step made every size."""
    from tinyinfer.runners.torch_pieces import PIECE_TOKEN_SIZES

    folder, _ = oracle_model(name)
    ref, fast = load_pair(folder)
    pieces = fast.runner._layer_pieces()
    monkeypatch.setattr(fast.runner, "_piece_graphs", lambda rows: pieces)
    vocab = ref.config.vocab_size
    long = [(np.random.default_rng(2).integers(0, vocab, 20).tolist(), 0, [20, 21, 22, 23, 24], False)]
    assert_runners_agree(ref.runner, fast.runner, [long, *mixed_schedule(vocab, page_size=4, seed=3)],
                         page_size=4, tol=1e-4)
    assert sorted(pieces.pieces) == list(PIECE_TOKEN_SIZES)  # every size at the first step


def test_piece_sizes_pad_a_step_to_the_next_size_up_to_512_tokens():
    """A step of T tokens replays the pieces of the smallest size that holds it; past the
    largest size there are none (the runner then runs the step as it is)."""
    from tinyinfer.runners.torch_pieces import PIECE_TOKEN_SIZES, PieceGraphs

    assert [PieceGraphs.padded_size(t) for t in (1, 16, 17, 129, 200, 512, 513)] == [16, 16, 32, 192, 256, 512, None]
    assert PIECE_TOKEN_SIZES[-1] == 512
