"""A Triton kernel for a step's prefill chunks: one launch per layer for every chunk (GPU only;
imported only when Triton is there).

It computes what ``torch_layers.packed_prefill_attention`` computes — each sequence's new
queries attending causally over its whole context — for all the step's sequences at once. The
rows are packed one sequence after another (each with its own length, start position and page
table, as flash-attention's variable-length kernels take them); a host-made work list cuts
each sequence into tiles of QUERY_TILE query tokens. ``torch_triton.store_kv`` first rotates
and stores every new k and v in its page slot (int8 K/V: quantized), then one program per
(tile, KV head) rotates its queries and streams the keys 0..(the tile's last position) page by
page through the sequence's page table, with an online softmax and the causal rule (a query at
position p sees keys 0..p) as a mask. Earlier tokens — a cached prefix, earlier chunks of a
chunked prefill — and the chunk's own tokens are read the same way, from the cache: so a chunk
attends to K/V as stored, which with int8 K/V is what the reference does too.

The matrix units see rows = (query token, query head of the KV head's group): QUERY_TILE tokens
times the group (padded to a power of two) share every key tile they load, so grouped-query
attention reads each K/V tile once per group. Each head is handled as its two RoPE halves, as
in the decode kernel, with the same int8 conventions: a key's scale multiplies its column of
scores, a value's scale the softmax weights that meet it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners.torch_layers import PrefillChunks
from tinyinfer.runners.torch_triton import attend_block, kernel_shape, store_kv

QUERY_TILE = 16  # query tokens per program
BLOCK_KEYS = 64  # keys per step of the loop


@triton.jit
def _paged_prefill_kernel(
    qkv_ptr, out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, positions_ptr, tiles_ptr,
    block_tables_ptr, k_scale_ptr, v_scale_ptr, qkv_row_stride, block_table_row_stride, scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TILE: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, KV_INT8: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile * 3)
    first_row = tl.load(tiles_ptr + tile * 3 + 1)
    end_row = tl.load(tiles_ptr + tile * 3 + 2)  # the row after the sequence's last
    head_dim = 2 * HALF
    dtype = qkv_ptr.dtype.element_ty

    # Row i of the tile: query token i // GROUP_P of the tile, query head i % GROUP_P of the group.
    i = tl.arange(0, TILE * GROUP_P)
    row = first_row + i // GROUP_P
    g = i % GROUP_P
    row_ok = (row < end_row) & (g < GROUP)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    rd_ok = row_ok[:, None] & d_ok[None, :]
    pos = tl.load(positions_ptr + row, mask=row_ok, other=0)  # padding rows see key 0 alone
    heads = kv_head * GROUP + g
    q_at = qkv_ptr + row[:, None] * qkv_row_stride + heads[:, None] * head_dim + d[None, :]
    q1 = tl.load(q_at, mask=rd_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=rd_ok, other=0.0).to(tl.float32)
    if ROPE:
        cos = tl.load(cos_ptr + pos[:, None] * HALF + d[None, :], mask=rd_ok, other=0.0)
        sin = tl.load(sin_ptr + pos[:, None] * HALF + d[None, :], mask=rd_ok, other=0.0)
        q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
    q1, q2 = q1.to(dtype), q2.to(dtype)  # as the matrix units see them

    m = tl.full([TILE * GROUP_P], float("-inf"), tl.float32)  # running max score per row
    l = tl.zeros([TILE * GROUP_P], tl.float32)  # sum of exp(score - m)
    acc1 = tl.zeros([TILE * GROUP_P, HALF_P], tl.float32)
    acc2 = tl.zeros([TILE * GROUP_P, HALF_P], tl.float32)

    # Keys 0..last, the tile's last position, through the page table. Every row sees key 0,
    # so no row's maximum stays -inf. A while loop: the interpreter takes no loaded range bound.
    last = tl.max(pos, 0)
    tables = block_tables_ptr + seq * block_table_row_stride
    start = last * 0
    while start <= last:
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n <= last
        page = tl.load(tables + n // PAGE_SIZE, mask=n_ok, other=0)
        m, l, acc1, acc2 = attend_block(
            q1, q2, m, l, acc1, acc2, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            page * PAGE_SIZE + n % PAGE_SIZE, n_ok, n[None, :] <= pos[:, None], kv_head, d, d_ok,
            scale, dtype, NUM_KV_HEADS, HALF, KV_INT8)  # causal
        start += BLOCK_N

    out_at = out_ptr + row[:, None] * (NUM_HEADS * head_dim) + heads[:, None] * head_dim + d[None, :]
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_at, (acc1 / l[:, None]).to(out_dtype), mask=rd_ok)
    tl.store(out_at + HALF, (acc2 / l[:, None]).to(out_dtype), mask=rd_ok)


def query_tiles(starts: tuple[int, ...] | np.ndarray) -> np.ndarray:
    """The kernel's work list: every sequence's rows cut into tiles of QUERY_TILE.
    starts: [B + 1] row offsets -> int32 [tiles, 3] of (sequence, first row, end row)."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = -(-np.diff(starts) // QUERY_TILE)  # [B] tiles per sequence
    seq = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([seq, starts[seq] + within * QUERY_TILE, starts[seq + 1]], axis=1).astype(np.int32)


def paged_prefill_attention(qkv: Tensor, chunks: PrefillChunks, k_cache: Tensor, v_cache: Tensor,
                            cos_table: Tensor | None, sin_table: Tensor | None, num_heads: int,
                            k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Same contract as ``torch_layers.packed_prefill_attention``, in Triton; ``chunks.tiles``
    must hold ``query_tiles(chunks.starts)`` on the device.

    qkv: [Tp, (H + 2 Hkv) hd] (rows contiguous), caches: [P, S, Hkv, hd] contiguous (int8 K/V:
    int8 caches and their float16 scales [P, S, Hkv], contiguous).  -> [Tp, H hd].
    """
    if chunks.tiles is None:
        raise ValueError("the Triton prefill kernel needs the chunks' query tiles")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    store_kv(qkv, chunks.positions, chunks.slots, k_cache, v_cache, cos_table, sin_table,
             num_heads, k_scale, v_scale)
    shape = kernel_shape(num_heads, k_cache, cos_table, k_scale, v_scale)
    # Rows are (token, head) pairs here: the group needs padding only to a power of two, as
    # long as the tile has 16 rows for tl.dot.
    shape["GROUP_P"] = max(triton.next_power_of_2(shape["GROUP"]), 16 // QUERY_TILE)
    cos, sin = (cos_table, sin_table) if shape["ROPE"] else (qkv, qkv)
    scales = (k_scale, v_scale) if shape["KV_INT8"] else (k_cache, v_cache)  # unread without int8
    out = torch.empty((qkv.shape[0], num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    _paged_prefill_kernel[(chunks.tiles.shape[0], num_kv_heads)](
        qkv, out, k_cache, v_cache, cos, sin, chunks.positions, chunks.tiles, chunks.page_tables,
        *scales, qkv.stride(0), chunks.page_tables.stride(0), head_dim ** -0.5,
        **shape, PAGE_SIZE=page_size, TILE=QUERY_TILE, BLOCK_N=BLOCK_KEYS, num_warps=4,
    )
    return out
