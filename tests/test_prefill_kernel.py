"""The batched prefill attention: every prefill chunk of a step in one call. The torch version
(per sequence, CPU CI's path) against the NumPy reference's rule computed densely; the Triton
kernel, run by Triton's CPU interpreter, against the torch version."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import tinyinfer
from tests.interpreted import run_interpreted
from tinyinfer.errors import TinyInferError
from tinyinfer.runners import torch_layers

# Packed sequences as a step feeds them: (tokens already in the cache, new tokens) each — a whole
# prompt over several key blocks and query tiles, one token after a cached prefix, a chunk that
# starts inside a page, a chunk that starts on a page boundary after a long prefix. The builder
# runs here and, as text, in the Triton interpreter's subprocess.
PREFILL_CASE = """
def prefill_case(heads, kv_heads, hd, page, rope, plan=((0, 37), (7, 1), (11, 13), (40, 50)), seed=0):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, 100, page, kv_heads, hd, generator=g).unbind(0)
    width = max(-(-(cached + new) // page) for cached, new in plan)
    tables = torch.randperm(100, generator=g)[:len(plan) * width].view(len(plan), width)
    positions = torch.cat([torch.arange(cached, cached + new) for cached, new in plan])
    seqs = torch.cat([torch.full((new,), b) for b, (_, new) in enumerate(plan)])
    slots = tables[seqs, positions // page] * page + positions % page
    starts = [0]
    for _, new in plan:
        starts.append(starts[-1] + new)
    qkv = torch.randn(starts[-1], (heads + 2 * kv_heads) * hd, generator=g)
    angles = torch.arange(512.0, dtype=torch.float64)[:, None] * torch.rand(hd // 2, generator=g)
    cos, sin = (angles.cos().float(), angles.sin().float()) if rope else (None, None)
    chunks = torch_layers.PrefillChunks(
        starts=tuple(starts), context_lens=tuple(cached + new for cached, new in plan),
        positions=positions, slots=slots, page_tables=tables)
    return qkv, chunks, (k_cache, v_cache), cos, sin
"""
exec(PREFILL_CASE)
# (heads, KV heads, head dim, page size, RoPE): grouped-query, odd group, one KV head per query
# head, no RoPE, a head dim whose half is not a power of two, a long page.
SHAPES = [(4, 2, 16, 4, True), (6, 2, 24, 4, True), (4, 4, 16, 8, False), (8, 1, 32, 16, True)]


@pytest.mark.parametrize("shape", SHAPES)
def test_packed_prefill_attention_follows_the_causal_rule_over_the_whole_context(shape):
    """Each packed row attends over its own sequence's keys 0..p: the earlier ones read from the
    pages, its chunk's own just stored there — checked against dense float64 attention."""
    heads, kv_heads, hd, page, rope = shape
    qkv, chunks, cache, cos, sin = prefill_case(*shape)  # noqa: F821
    before = tuple(c.clone() for c in cache)
    got = torch_layers.packed_prefill_attention(qkv, chunks, *cache, cos, sin, heads)
    q, k, v = torch_layers.split_qkv(qkv, heads, kv_heads, hd)
    if rope:
        c, s = cos[chunks.positions], sin[chunks.positions]
        q, k = torch_layers.apply_rope(q, c, s), torch_layers.apply_rope(k, c, s)
    for b, context in enumerate(chunks.context_lens):
        rows = slice(chunks.starts[b], chunks.starts[b + 1])
        pages = chunks.page_tables[b, :-(-context // page)]
        keys = before[0][pages].flatten(0, 1)[:context].double()  # [N, Hkv, hd]
        values = before[1][pages].flatten(0, 1)[:context].double()
        new = chunks.positions[rows]
        keys[new], values[new] = k[rows].double(), v[rows].double()
        group = heads // kv_heads
        scores = torch.einsum("thd,nhd->htn", q[rows].double(), keys.repeat_interleave(group, 1))
        scores = scores / hd ** 0.5
        scores[:, torch.arange(context)[None, :] > new[:, None]] = float("-inf")
        want = torch.einsum("htn,nhd->thd", scores.softmax(-1), values.repeat_interleave(group, 1))
        torch.testing.assert_close(got[rows].double(), want.flatten(1), atol=1e-5, rtol=1e-5)
    table_slots = chunks.slots.view(-1)
    assert torch.equal(cache[0].flatten(0, 1)[table_slots], k)
    assert torch.equal(cache[1].flatten(0, 1)[table_slots], v)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_prefill_check.py runs the kernel on a GPU")
def test_query_tiles_cut_every_sequence_into_tiles_of_its_own():
    from tinyinfer.runners.torch_triton_prefill import QUERY_TILE, query_tiles

    starts = (0, 37, 38, 38 + QUERY_TILE, 38 + QUERY_TILE + 2)
    tiles = query_tiles(starts)
    assert tiles.dtype == np.int32
    want = [(0, 0, 37), (0, QUERY_TILE, 37), (0, 2 * QUERY_TILE, 37), (1, 37, 38),
            (2, 38, 38 + QUERY_TILE), (3, 38 + QUERY_TILE, 40 + QUERY_TILE)]
    assert [tuple(t) for t in tiles.tolist()] == want


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_prefill_check.py runs the kernel on a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_triton_prefill_kernel_matches_torch_version_in_interpreter(kv_cache_dtype):
    """The Triton kernel, run by Triton's CPU interpreter, equals the per-sequence torch version:
    same outputs, and the same K/V (int8: the same codes and scales) written to the cache."""
    code = ("import torch\nfrom tinyinfer.runners import torch_layers, torch_triton_prefill\n"
            + PREFILL_CASE + (
                "import dataclasses\n"
                "for heads, kv_heads, hd, page, rope in %r:\n"
                "    qkv, chunks, cache, cos, sin = prefill_case(heads, kv_heads, hd, page, rope)\n"
                "    if %r:  # random int8 codes, and scales of about a bf16 cache's spread\n"
                "        g = torch.Generator().manual_seed(1)\n"
                "        codes = torch.randint(-127, 128, (2, *cache[0].shape), dtype=torch.int8, generator=g)\n"
                "        scales = (torch.rand(2, *cache[0].shape[:3], generator=g) * 0.03).half()\n"
                "        cache = (*codes.unbind(0), *scales.unbind(0))\n"
                "    def attend(attention, chunks, cache):\n"
                "        named = dict(zip(('k_scale', 'v_scale'), cache[2:]))\n"
                "        return attention(qkv, chunks, cache[0], cache[1], cos, sin, heads, **named)\n"
                "    ref_cache = tuple(c.clone() for c in cache)\n"
                "    ref = attend(torch_layers.packed_prefill_attention, chunks, ref_cache)\n"
                "    tiles = torch.from_numpy(torch_triton_prefill.query_tiles(chunks.starts))\n"
                "    got_cache = tuple(c.clone() for c in cache)\n"
                "    got = attend(torch_triton_prefill.paged_prefill_attention,\n"
                "                 dataclasses.replace(chunks, tiles=tiles), got_cache)\n"
                "    assert torch.allclose(got, ref, atol=1e-5), (heads, kv_heads, hd, (got - ref).abs().max())\n"
                "    assert all(torch.equal(a, b) for a, b in zip(got_cache, ref_cache))\n"
                "print('ok')\n"
            ) % (SHAPES, kv_cache_dtype == "int8"))
    run_interpreted(code)


def test_prefill_attention_option_is_checked_and_described(oracle_model):
    folder, _ = oracle_model("llama-gqa-untied")
    model = tinyinfer.load(folder, runner="torch", device="cpu")
    assert model.runner.describe()["prefill_attention"] == "torch"  # "auto" on CPU
    with pytest.raises(TinyInferError, match="prefill_attention='torch'"):
        tinyinfer.load(folder, runner="torch", device="cpu", prefill_attention="triton")
    with pytest.raises(TinyInferError, match="prefill_attention must be one of"):
        tinyinfer.load(folder, runner="torch", device="cpu", prefill_attention="flash")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; scripts/gpu_prefill_check.py runs the kernel on a GPU")
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-untied"])
def test_runner_steps_through_the_triton_prefill_kernel_as_through_the_torch_version(name, oracle_model):
    """Mixed steps (prefill chunks after cached prefixes beside decodes, one-token prompts, a
    chunk scored at every position) through the runner with the Triton prefill kernel, in the
    interpreter, give the logits of the torch version. The runner takes prefill_attention="triton"
    only on CUDA, so the subprocess swaps the kernel in after loading on the CPU."""
    from tests.test_torch_runner import mixed_schedule

    folder, _ = oracle_model(name)
    steps = list(mixed_schedule(320, page_size=4, seed=3))
    code = (
        "import numpy as np\nimport tinyinfer\n"
        "from tinyinfer.runners.runner import make_batch\n"
        "from tinyinfer.runners import torch_triton_prefill\n"
        f"runners = [tinyinfer.load({str(folder)!r}, runner='torch', device='cpu').runner for _ in range(2)]\n"
        "runners[1].prefill_attention_kind = 'triton'\n"
        "runners[1].prefill_attention = torch_triton_prefill.paged_prefill_attention\n"
        "caches = [r.new_kv_cache(32, 4) for r in runners]\n"
        f"for entries in {steps!r}:\n"
        "    ref, got = (r.forward(make_batch(entries, 4), kv) for r, kv in zip(runners, caches))\n"
        "    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), np.abs(got - ref).max()\n"
        "print('ok')\n"
    )
    run_interpreted(code)
