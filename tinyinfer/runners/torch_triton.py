"""A Triton kernel for paged decode attention (GPU only; imported only when Triton is there).

It computes what ``torch_layers.paged_decode_attention`` computes, in one or two launches per
layer. A program takes one (query row, KV head, context split): it rotates the row's q and k,
and (with one row per sequence) the first split stores the new k and v in the token's page
slot; then it streams its share of the earlier keys and values page by page through the page
table with an online softmax. Nothing is gathered into a padded copy, so the cost follows each
sequence's real context, not the page table's width — which lets one CUDA graph serve every
length.

Verifying a speculative draft gives each sequence q = k + 1 new tokens; token j sees the keys
up to its own position. A first small kernel stores all q rows' K/V, then every row attends
exactly as a decode row does: the same tiles in the same order, split the same way (the split
count follows the number of sequences, not rows). So decode and verification compute the same
attention, bit for bit, for a token at the same position over the same cache.

At batch 1 there are only (KV heads) programs, each walking the whole context one block
after another; splitting the context across programs (flash-decoding) keeps the GPU busy,
and a second small kernel merges the splits' partial softmaxes.

With programmatic dependent launch (``triton_common``; compute capability 9.0+) the kernels are
launched so that their programs may start while the previous kernel's finish; they wait for its
results (``gdc_wait``) before reading anything (``torch_triton_gemv`` explains the gain).

Scores and weighted sums run on the matrix units (``tl.dot``): the query heads that share a
KV head form the rows, padded to 16. Each head is handled as its two RoPE halves, so only the
halves need padding to a power of two. A row's own token is scored from registers rather than
read back from the cache.

With int8 K/V (``KV_INT8``), whichever kernel stores a new k and v quantizes them as
``quant.quantize_kv`` does (one float16 scale per token and KV head, rounded up; codes rounded
half to even), and a row's own token is scored as stored; earlier keys and values are read as
int8 codes, converted to the compute dtype in registers, and multiplied by their scales. A
key's scale is one number per (token, KV head), so it multiplies the key's column of scores
after the dot product, and a value's scale multiplies the softmax weight that meets it:
codes × scale, without a dequantized tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tinyinfer.runners.triton_common import release_next, wait_for_previous
from tinyinfer.runners.triton_env import launches_dependent

KEY_TILE_ELEMENTS = 4096  # keys x half head dim loaded per step, per K/V half (twice that in int8)
MAX_SPLITS = 16
# Blocks of keys in flight in the decode loop's pipeline, as measured best at 8B / 32 x 4096 on an
# H100: int8 tiles take half the shared memory, so more of them fit in flight.
PIPELINE_STAGES = 3
INT8_PIPELINE_STAGES = 5
# 1.5 * 2**23: (x + ROUNDING) - ROUNDING rounds a float32 |x| < 2**22 to an integer, half to even
# (as NumPy and torch round), in the interpreter too, which has no libdevice rint.
ROUNDING = tl.constexpr(12582912.0)


@triton.jit
def _quantize_int8(x1, x2, d_ok):
    """One token-head's int8 codes and float16 scale, as quant.quantize_kv: the scale is amax / 127
    rounded up to float16.  x1, x2: [HALF_P] float32 halves -> (codes1, codes2 int8, scale fp16)."""
    amax = tl.maximum(tl.max(tl.where(d_ok, tl.abs(x1), 0.0), 0),
                      tl.max(tl.where(d_ok, tl.abs(x2), 0.0), 0))
    scale = tl.div_rn(amax, 127.0)
    half = scale.to(tl.float16)
    up = (half.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)  # the next float16
    half = tl.where(half.to(tl.float32) < scale, up, half)
    s = half.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    steps1 = tl.where(s > 0, tl.div_rn(x1, safe), 0.0)
    steps2 = tl.where(s > 0, tl.div_rn(x2, safe), 0.0)
    codes1 = tl.minimum(tl.maximum((steps1 + ROUNDING) - ROUNDING, -127.0), 127.0)
    codes2 = tl.minimum(tl.maximum((steps2 + ROUNDING) - ROUNDING, -127.0), 127.0)
    return codes1.to(tl.int8), codes2.to(tl.int8), half


@triton.jit
def _new_token(qkv_ptr, cos_ptr, sin_ptr, row, pos, kv_head, qkv_row_stride, dtype,
               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
               GROUP_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, ROPE: tl.constexpr):
    """One query row's q (its KV head's group of query heads) and k, rotated, and v, all rounded
    to the compute dtype: q1, q2 [G, half] and k1, k2, v1, v2 [half], as halves."""
    head_dim = 2 * HALF
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    heads = kv_head * GROUP + g
    at = qkv_ptr + row * qkv_row_stride
    q_at = at + heads[:, None] * head_dim + d[None, :]  # [G, half]
    gd_ok = (g < GROUP)[:, None] & d_ok[None, :]
    q1 = tl.load(q_at, mask=gd_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=gd_ok, other=0.0).to(tl.float32)
    k_at = at + (NUM_HEADS + kv_head) * head_dim + d
    k1 = tl.load(k_at, mask=d_ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_at + HALF, mask=d_ok, other=0.0).to(tl.float32)
    v_at = at + (NUM_HEADS + NUM_KV_HEADS + kv_head) * head_dim + d
    v1 = tl.load(v_at, mask=d_ok, other=0.0)
    v2 = tl.load(v_at + HALF, mask=d_ok, other=0.0)
    if ROPE:
        cos = tl.load(cos_ptr + pos * HALF + d, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + pos * HALF + d, mask=d_ok, other=0.0)
        q1, q2 = q1 * cos[None, :] - q2 * sin[None, :], q2 * cos[None, :] + q1 * sin[None, :]
        k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    return q1.to(dtype), q2.to(dtype), k1.to(dtype), k2.to(dtype), v1.to(dtype), v2.to(dtype)


@triton.jit
def _store_new_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, kv_head, k1, k2, v1, v2,
                  store, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                  KV_INT8: tl.constexpr):
    """Store one token's k and v (halves [half]) where ``store``, quantized first with int8 K/V;
    return them as stored, in float32 (codes x scale with int8 K/V), to be scored from registers."""
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    slot_at = slot * (NUM_KV_HEADS * 2 * HALF) + kv_head * 2 * HALF + d
    if KV_INT8:
        kc1, kc2, k_half = _quantize_int8(k1.to(tl.float32), k2.to(tl.float32), d_ok)
        vc1, vc2, v_half = _quantize_int8(v1.to(tl.float32), v2.to(tl.float32), d_ok)
        tl.store(k_cache_ptr + slot_at, kc1, mask=d_ok & store)
        tl.store(k_cache_ptr + slot_at + HALF, kc2, mask=d_ok & store)
        tl.store(v_cache_ptr + slot_at, vc1, mask=d_ok & store)
        tl.store(v_cache_ptr + slot_at + HALF, vc2, mask=d_ok & store)
        tl.store(k_scale_ptr + slot * NUM_KV_HEADS + kv_head, k_half, mask=store)
        tl.store(v_scale_ptr + slot * NUM_KV_HEADS + kv_head, v_half, mask=store)
        k_s, v_s = k_half.to(tl.float32), v_half.to(tl.float32)
        return (kc1.to(tl.float32) * k_s, kc2.to(tl.float32) * k_s,
                vc1.to(tl.float32) * v_s, vc2.to(tl.float32) * v_s)
    tl.store(k_cache_ptr + slot_at, k1, mask=d_ok & store)
    tl.store(k_cache_ptr + slot_at + HALF, k2, mask=d_ok & store)
    tl.store(v_cache_ptr + slot_at, v1, mask=d_ok & store)
    tl.store(v_cache_ptr + slot_at + HALF, v2, mask=d_ok & store)
    return k1.to(tl.float32), k2.to(tl.float32), v1.to(tl.float32), v2.to(tl.float32)


@triton.jit
def _store_kv_kernel(
    qkv_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, cos_ptr, sin_ptr, positions_ptr,
    slots_ptr, qkv_row_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, ROPE: tl.constexpr,
    KV_INT8: tl.constexpr, PDL: tl.constexpr,
):
    """Rotate and store every query row's new K/V (before several rows of a sequence attend)."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    _, _, k1, k2, v1, v2 = _new_token(
        qkv_ptr, cos_ptr, sin_ptr, row, tl.load(positions_ptr + row), kv_head, qkv_row_stride,
        qkv_ptr.dtype.element_ty, NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_P, HALF, HALF_P, ROPE)
    _store_new_kv(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tl.load(slots_ptr + row),
                  kv_head, k1, k2, v1, v2, row >= 0, NUM_KV_HEADS, HALF, HALF_P, KV_INT8)


@triton.jit
def attend_block(q1, q2, m, l, acc1, acc2, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                 slot, n_ok, visible, kv_head, d, d_ok, scale, dtype,
                 NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, KV_INT8: tl.constexpr):
    """One block of keys through flash attention's online softmax, for the decode and the
    prefill kernel alike: the keys' cache slots ``slot`` [BLOCK_N] (``n_ok``: real keys),
    ``visible`` which scores count ([rows, BLOCK_N], or [1, BLOCK_N] for every row); the running
    max ``m``, sum ``l`` and weighted values ``acc1``/``acc2`` (head halves) come back updated."""
    head_dim = 2 * HALF
    nd_at = (slot * (NUM_KV_HEADS * head_dim) + kv_head * head_dim)[:, None] + d[None, :]  # [BLOCK_N, half]
    nd_ok = n_ok[:, None] & d_ok[None, :]
    # Each tile is converted to the compute dtype where it is used (int8 K/V: codes to bf16), so
    # the converted V tiles are not held through the scores and the softmax: compiled for sm_90,
    # an int8 program keeps 226 registers a thread instead of 255 and two spilled, and runs 2 %
    # faster (docs/quantization.md).
    kb1 = tl.load(k_cache_ptr + nd_at, mask=nd_ok, other=0)
    kb2 = tl.load(k_cache_ptr + nd_at + HALF, mask=nd_ok, other=0)
    vb1 = tl.load(v_cache_ptr + nd_at, mask=nd_ok, other=0)
    vb2 = tl.load(v_cache_ptr + nd_at + HALF, mask=nd_ok, other=0)
    s = tl.dot(q1, tl.trans(kb1.to(dtype)), input_precision="ieee")
    s = tl.dot(q2, tl.trans(kb2.to(dtype)), s, input_precision="ieee") * scale  # [rows, BLOCK_N]
    scale_at = slot * NUM_KV_HEADS + kv_head  # int8 K/V's scales
    if KV_INT8:  # each key's scale multiplies its column of scores
        s = s * tl.load(k_scale_ptr + scale_at, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if KV_INT8:  # each value's scale multiplies the weights that meet it
        p = p * tl.load(v_scale_ptr + scale_at, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    p = p.to(dtype)
    acc1 = tl.dot(p, vb1.to(dtype), acc1 * alpha[:, None], input_precision="ieee")
    acc2 = tl.dot(p, vb2.to(dtype), acc2 * alpha[:, None], input_precision="ieee")
    return m_new, l, acc1, acc2


@triton.jit
def _paged_decode_kernel(
    qkv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr,
    positions_ptr, slots_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    qkv_row_stride, block_table_row_stride, scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ROPE: tl.constexpr,
    Q_LEN: tl.constexpr, STORE_KV: tl.constexpr, KV_INT8: tl.constexpr, NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # everything below reads the previous kernel's q|k|v
    row = tl.program_id(0)  # one query row: token row % Q_LEN of sequence row // Q_LEN
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = row // Q_LEN
    head_dim = 2 * HALF
    g = tl.arange(0, GROUP_P)  # the query heads that share this KV head (padded to >= 16)
    d = tl.arange(0, HALF_P)
    g_ok, d_ok = g < GROUP, d < HALF
    gd_ok = g_ok[:, None] & d_ok[None, :]
    heads = kv_head * GROUP + g
    pos = tl.load(positions_ptr + row)
    first = split == 0

    # q, k and v rounded to the compute dtype, as the matrix units and the cache will see them.
    # With one row per sequence split 0 stores the new K/V here; with several, _store_kv_kernel
    # stored every row's first, since a row reads the K/V of the rows before it from the cache.
    # Either way the row's own token is scored and weighted as stored (int8 K/V: codes x scale).
    dtype = qkv_ptr.dtype.element_ty
    q1, q2, k1, k2, v1, v2 = _new_token(
        qkv_ptr, cos_ptr, sin_ptr, row, pos, kv_head, qkv_row_stride, dtype,
        NUM_HEADS, NUM_KV_HEADS, GROUP, GROUP_P, HALF, HALF_P, ROPE)
    if STORE_KV:
        store = first
    else:
        store = split < 0  # never: _store_kv_kernel has stored them
    new_k1, new_k2, new_v1, new_v2 = _store_new_kv(
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tl.load(slots_ptr + row), kv_head,
        k1, k2, v1, v2, store, NUM_KV_HEADS, HALF, HALF_P, KV_INT8)

    # Online softmax state per query head: split 0 starts from the new token, others from nothing.
    s_new = (tl.sum(q1.to(tl.float32) * new_k1[None, :], 1)
             + tl.sum(q2.to(tl.float32) * new_k2[None, :], 1)) * scale
    m = tl.where(first, s_new, float("-inf"))  # [G] running max score
    l = tl.where(first, 1.0, 0.0) + tl.zeros([GROUP_P], tl.float32)  # sum of exp(score - m)
    acc1 = tl.zeros([GROUP_P, HALF_P], tl.float32) + tl.where(first, new_v1, 0.0)[None, :]
    acc2 = tl.zeros([GROUP_P, HALF_P], tl.float32) + tl.where(first, new_v2, 0.0)[None, :]

    # This split's share of the earlier tokens 0..pos-1 (whole blocks of BLOCK_N, so short
    # contexts use fewer splits), read through the page table. tl.range software-pipelines the
    # loop: the page ids and the K/V tiles of the next NUM_STAGES - 1 blocks are copied in
    # (asynchronously, into shared memory) while this one computes.
    share = tl.cdiv(tl.cdiv(pos, NUM_SPLITS), BLOCK_N) * BLOCK_N
    first_key = split * share
    end = tl.minimum(first_key + share, pos)
    tables = block_tables_ptr + seq * block_table_row_stride
    for start in tl.range(first_key, end, BLOCK_N, num_stages=NUM_STAGES):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(tables + n // PAGE_SIZE, mask=n_ok, other=0)
        m, l, acc1, acc2 = attend_block(
            q1, q2, m, l, acc1, acc2, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
            page * PAGE_SIZE + n % PAGE_SIZE, n_ok, n_ok[None, :], kv_head, d, d_ok, scale, dtype,
            NUM_KV_HEADS, HALF, KV_INT8)

    release_next(PDL)  # the next kernel may launch: it waits for this one's results before reading them
    if NUM_SPLITS == 1:
        out_at = out_ptr + row * NUM_HEADS * head_dim + heads[:, None] * head_dim + d[None, :]
        out_dtype = out_ptr.dtype.element_ty
        tl.store(out_at, (acc1 / l[:, None]).to(out_dtype), mask=gd_ok)
        tl.store(out_at + HALF, (acc2 / l[:, None]).to(out_dtype), mask=gd_ok)
    else:
        # Partials, unnormalised: acc [B, H, splits, hd], (m, l) [B, H, splits, 2].
        part = (row * NUM_HEADS + heads) * NUM_SPLITS + split  # [G]
        acc_at = part_acc_ptr + part[:, None] * head_dim + d[None, :]
        tl.store(acc_at, acc1, mask=gd_ok)
        tl.store(acc_at + HALF, acc2, mask=gd_ok)
        tl.store(part_ml_ptr + part * 2, m, mask=g_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, NUM_SPLITS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, PDL: tl.constexpr):
    """out[b, h] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, over the splits s."""
    wait_for_previous(PDL)
    row = tl.program_id(0)  # b * H + h
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    m = tl.load(part_ml_ptr + (row * NUM_SPLITS + s) * 2)
    l = tl.load(part_ml_ptr + (row * NUM_SPLITS + s) * 2 + 1)
    weight = tl.exp(m - tl.max(m, 0))  # empty splits have m = -inf: weight 0
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=d_ok[None, :], other=0.0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * l, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def default_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough context splits for about two programs per multiprocessor, at most MAX_SPLITS."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * processors, batch * num_kv_heads)
    return min(MAX_SPLITS, triton.next_power_of_2(wanted))


def pipeline_stages(wanted: int, stage_bytes: int, device: torch.device) -> int:
    """Pipeline stages for K and V tiles of stage_bytes per block of keys: as many as wanted,
    fewer where the GPU's shared memory per program would not hold them with one block to spare
    for the kernel's other buffers (at least 2)."""
    if device.type != "cuda":  # Triton's CPU interpreter: no pipeline
        return wanted
    shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return max(2, min(wanted, shared // stage_bytes - 1))


def kernel_shape(num_heads: int, k_cache: Tensor, cos_table: Tensor | None,
                 k_scale: Tensor | None, v_scale: Tensor | None) -> dict[str, int | bool]:
    """The compile-time sizes the kernels share: heads, the KV head group padded for tl.dot
    (>= 16 rows), half head dims padded to a power of two (>= 16), RoPE, int8 K/V."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group, half = num_heads // num_kv_heads, head_dim // 2
    return dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
                GROUP_P=max(16, triton.next_power_of_2(group)), HALF=half,
                HALF_P=max(16, triton.next_power_of_2(half)), ROPE=cos_table is not None,
                KV_INT8=k_scale is not None and v_scale is not None)


def store_kv(qkv: Tensor, positions: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
             cos_table: Tensor | None, sin_table: Tensor | None, num_heads: int,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None, pdl: bool = False) -> None:
    """Rotate every row's new k and store it and v in its slot (int8 K/V: quantized), before
    rows that read each other's K/V from the cache attend.  qkv: [T, (H + 2 Hkv) hd]."""
    shape = kernel_shape(num_heads, k_cache, cos_table, k_scale, v_scale)
    cos, sin = (cos_table, sin_table) if shape["ROPE"] else (qkv, qkv)
    scales = (k_scale, v_scale) if shape["KV_INT8"] else (k_cache, v_cache)  # unread without int8
    pdl = pdl and launches_dependent(qkv.device)
    _store_kv_kernel[(qkv.shape[0], k_cache.shape[2])](
        qkv, k_cache, v_cache, *scales, cos, sin, positions, slots, qkv.stride(0), **shape,
        PDL=pdl, num_warps=1, launch_pdl=pdl)


def paged_decode_attention(qkv: Tensor, positions: Tensor, slots: Tensor, page_tables: Tensor,
                           k_cache: Tensor, v_cache: Tensor, cos_table: Tensor | None,
                           sin_table: Tensor | None, num_heads: int,
                           num_splits: int | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, pdl: bool = False) -> Tensor:
    """Same contract as ``torch_layers.paged_decode_attention``, in Triton.

    qkv: [B q, (H + 2 Hkv) hd] (rows contiguous; q new tokens per sequence, in order),
    positions/slots: [B q] int64, page_tables: [B, W] int, caches: [P, S, Hkv, hd] contiguous
    (int8 K/V: int8 caches and their float16 scales [P, S, Hkv], contiguous). -> [B q, H hd].
    num_splits (a power of two) splits each context across programs; None picks by GPU size
    and B alone, so a row's arithmetic is the same whatever q is. pdl: launch with programmatic
    dependent launch inside ``triton_env.dependent_launch(True)`` where the card has it (the
    runner asks for it after its own products only: after cuBLAS's, whose kernels let the next
    one launch early, the attention's waiting programs slowed the step).
    """
    rows, batch = qkv.shape[0], page_tables.shape[0]
    q_len = rows // batch
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    if num_splits is None:
        num_splits = default_splits(batch, num_kv_heads, qkv.device)
    # tl.dot needs every dimension >= 16: the head group and the half head dim are padded.
    shape = kernel_shape(num_heads, k_cache, cos_table, k_scale, v_scale)
    # int8 tiles carry twice the keys: as many bytes per step as a 16-bit tile.
    block_n = max(16, min(64, KEY_TILE_ELEMENTS // shape["HALF_P"])) * (2 if shape["KV_INT8"] else 1)
    stages = pipeline_stages(INT8_PIPELINE_STAGES if shape["KV_INT8"] else PIPELINE_STAGES,
                             2 * block_n * 2 * shape["HALF_P"] * k_cache.element_size(), qkv.device)
    out = torch.empty((rows, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    parts = rows * num_heads * num_splits
    part_acc = torch.empty((parts, head_dim) if num_splits > 1 else (1,), dtype=torch.float32,
                           device=qkv.device)
    part_ml = torch.empty((parts, 2) if num_splits > 1 else (1,), dtype=torch.float32,
                          device=qkv.device)
    cos, sin = (cos_table, sin_table) if shape["ROPE"] else (qkv, qkv)
    scales = (k_scale, v_scale) if shape["KV_INT8"] else (k_cache, v_cache)  # unread without int8 K/V
    pdl = pdl and launches_dependent(qkv.device)
    if q_len > 1:
        store_kv(qkv, positions, slots, k_cache, v_cache, cos_table, sin_table, num_heads,
                 k_scale, v_scale, pdl)
    _paged_decode_kernel[(rows, num_kv_heads, num_splits)](
        qkv, out, part_acc, part_ml, k_cache, v_cache, cos, sin,
        positions, slots, page_tables, *scales,
        qkv.stride(0), page_tables.stride(0), head_dim ** -0.5,
        **shape, PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        Q_LEN=q_len, STORE_KV=q_len == 1, NUM_STAGES=stages, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    if num_splits > 1:
        _merge_splits_kernel[(rows * num_heads,)](
            out, part_acc, part_ml, NUM_SPLITS=num_splits, HEAD_DIM=head_dim,
            HEAD_DIM_P=triton.next_power_of_2(head_dim), PDL=pdl, num_warps=1, launch_pdl=pdl,
        )
    return out
