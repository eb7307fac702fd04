"""The fast path's tensor functions: the reference's math, regrouped so each call fuses well.

Every function here is pure PyTorch and runs on any device. The runner calls them per layer:
``attention_input`` (residual add + norm + fused QKV projection), an attention function,
then ``mlp_block`` (output projection + residual + norm + fused gate/up MLP). A block's final
residual add is left for the next block's ``attention_input`` (or ``final_logits``), so under
``torch.compile`` one kernel does "add, then normalise" instead of two.

Shapes use: T new tokens, D hidden size, H query heads, Hkv key/value heads, hd head dim,
B sequences, P pages, S tokens per page, W page slots in a block-table row, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tinyinfer.quant import QuantizedWeight, group_offsets
from tinyinfer.runners import quant_words, triton_env


@dataclass(frozen=True)
class Int8Weight:
    """Weight-only int8 on the device: codes [out, in] and one scale per output row [out]."""

    codes: Tensor  # int8 [out, in]
    scales: Tensor  # [out], compute dtype


@dataclass(frozen=True)
class Int4Weight:
    """Weight-only int4 in the tiled layout of torch's int4 matmul (tinygemm on CUDA, its CPU twin)."""

    packed: Tensor  # kernel layout, made by torch._convert_weight_to_int4pack(_for_cpu)
    scales_and_zeros: Tensor  # [groups, out, 2]: weight = (nibble - 8) * scale + zero
    group_size: int
    tile_map: Tensor | None = None  # CUDA, Triton at hand: where a tile's weights sit, for prefill


@dataclass(frozen=True)
class GroupWeight:
    """Weight-only int8/int4 in groups no torch kernel takes (int8 in groups; int4 shapes the
    kernel refuses): dequantized inside every product."""

    codes: Tensor  # int8 [out, in], or uint8 [out, ceil(in / 2)] int4 nibbles, even column low
    scales: Tensor  # [out, groups], compute dtype
    offsets: Tensor  # [out, groups]: weight = code * scale + offset
    group_size: int
    in_features: int


@dataclass(frozen=True)
class KernelWeight:
    """Weight-only int8/int4 for the Triton kernels (``torch_quant_kernel``), any format:
    weight = (code - zero) * scale + offset, each (row, group) with its scale and offset."""

    words: Tensor  # int32 [out, in * bits / 32]: the stored codes read as little-endian words
    scales: Tensor  # float16 [out, groups], as stored
    offsets: Tensor | None  # float16 or float32 [out, groups] (asymmetric, minimum); None: zero
    bits: int
    group_size: int  # the row's width for per-row int8
    zero: int  # 8 for symmetric int4 (nibbles hold code + 8), else 0


QuantWeight = Int8Weight | Int4Weight | GroupWeight | KernelWeight

# From this many rows of x (prefill chunks, large batches), a quantized weight is dequantized into
# a bf16 buffer and multiplied by cuBLAS (``torch_quant_prefill``). Measured on an H100
# (docs/quantization.md): the Triton kernels' words break even with it between 128 and 256 rows (a
# layer of the 8B shape at 128 rows: 406 us by the kernels, 433 us dequantized; at 256: 705
# against 462); torch's tiled int4 (CUDA) at about 64 (978 us by torch's kernel against 968 for a
# first dequantize kernel, which the one kept beats by a fifth: 768 against 991 us at 128 rows).
DEQUANT_ROWS = 256  # KernelWeight
INT4PACK_DEQUANT_ROWS = 64  # Int4Weight with a tile map


def linear(x: Tensor, weight: Tensor | QuantWeight, bias: Tensor | None) -> Tensor:
    """y = x W^T + b.  x: [T, in], weight: [out, in] (or a quantized one) -> [T, out]."""
    if isinstance(weight, Tensor):
        return F.linear(x, weight, bias)
    y = quantized_matmul(x, weight)
    return y if bias is None else y + bias


def quantized_matmul(x: Tensor, w: QuantWeight) -> Tensor:
    """x W^T with W stored in int8 / int4: the Triton kernels for a KernelWeight, else torch's
    weight-only kernels where they apply.  x: [T, in]."""
    rows = x.shape[0]
    if isinstance(w, KernelWeight) and rows >= DEQUANT_ROWS:
        return torch.ops.tinyinfer.dequant_matmul(x, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero)
    if isinstance(w, Int4Weight) and w.tile_map is not None and rows >= INT4PACK_DEQUANT_ROWS:
        return torch.ops.tinyinfer.dequant_matmul_int4pack(x, w.packed, w.scales_and_zeros, w.group_size,
                                                           w.tile_map)
    if isinstance(w, KernelWeight):
        xg, xsum = kernel_inputs(x, w.bits, w.group_size)
        if torch.compiler.is_compiling():  # the operator: torch.compile calls it without tracing in
            return torch.ops.tinyinfer.quant_matmul(xg, xsum, w.words, w.scales, w.offsets, w.bits,
                                                    w.group_size, w.zero, x.dtype)
        # Eager (a prefill chunk): the function itself, without the dispatcher's ~50 us a call on
        # an H100's host (146 against 95 us a product), 65 of them in a 1B model's forward pass.
        from tinyinfer.runners.torch_quant_kernel import quant_matmul

        return quant_matmul(xg, xsum, w.words, w.scales, w.offsets, w.bits, w.group_size, w.zero, x.dtype)
    on_cpu = x.device.type == "cpu"
    if isinstance(w, Int8Weight):
        if on_cpu:
            return torch._weight_int8pack_mm(x, w.codes, w.scales)
        # Per-row scales factor out of the product; torch.compile fuses the int8 -> float
        # conversion into the matmul's loads, so the weights cross memory as one byte each.
        return F.linear(x, w.codes.to(x.dtype)) * w.scales
    if isinstance(w, Int4Weight):
        mm = torch._weight_int4pack_mm_for_cpu if on_cpu else torch._weight_int4pack_mm
        return mm(x, w.packed, w.group_size, w.scales_and_zeros)
    n = w.in_features
    codes = w.codes if w.codes.dtype == torch.int8 else unpack_int4(w.codes, n)  # [out, in]
    scales = w.scales.repeat_interleave(w.group_size, dim=1)[:, :n]
    offsets = w.offsets.repeat_interleave(w.group_size, dim=1)[:, :n]
    return F.linear(x, codes.to(scales.dtype) * scales + offsets)


def kernel_inputs(x: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """x as the Triton kernels' unfused products read it, in float32: regrouped by code (out[t,
    j, w] is the input code j of word w meets; ``quant_words``' layout: code 2q + r of a group's
    word i meets its column 2 W q + 2 i + r), and per word the sum of the inputs its codes meet
    (the kernel folds the word's offset in through it).  [T, in] -> [T, 32 / bits, in * bits /
    32], [T, in * bits / 32].

    Inside a compiled function both come out of the kernel that made x, as one more output,
    because each word's inputs are gathered first (in x's dtype, before the float32 cast) and
    the regrouping and the sum of 4 or 8 terms then read that one view: gathered after the
    cast, or summed over the group's axes directly, Inductor wrote them in a kernel of their own
    (an H100, llama-3-8b int4: one more kernel a product, 129 a step, 360 against 378 tok/s)."""
    t, n = x.shape
    span = group_size * bits // 32  # W: words in a group
    pairs = x.reshape(t, n // group_size, -1, span, 2)  # [T, groups, PER / 2, W, 2]
    words = pairs.permute(0, 1, 3, 2, 4).reshape(t, -1, 32 // bits).float()  # [T, words, PER]
    return words.transpose(1, 2).contiguous(), words.sum(-1)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """Two codes per byte, even column low.  uint8 [out, ceil(n / 2)] -> uint8 [out, n]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)[:, :n]


def int4_kernel_fits(out: int, n: int, group_size: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's int4 kernel takes this shape: whole groups, and its tile multiples."""
    if n % group_size:
        return False
    if device.type == "cpu":
        return out % 16 == 0
    return dtype == torch.bfloat16 and out % 8 == 0 and n % 32 == 0


def kernel_weight(qw: QuantizedWeight, device: torch.device) -> KernelWeight:
    """A quantized weight in the Triton kernels' layout (registers their operator on first use)."""
    from tinyinfer.runners import torch_quant_kernel, torch_quant_prefill  # noqa: F401  (their operators)

    def to_device(array: np.ndarray | None) -> Tensor | None:
        return None if array is None else torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)

    packed = quant_words.pack_words(qw)
    return KernelWeight(to_device(packed.words), to_device(packed.scales), to_device(packed.offsets),
                        packed.bits, packed.group_size, packed.zero)


def device_weight(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype,
                  kernel: str = "torch") -> QuantWeight:
    """Move a quantized weight to the device in the layout its matmul reads.

    ``kernel``: "torch" (torch's kernels), or "triton" / "auto" (the Triton kernels wherever the
    shape fits them: on an H100 they beat torch's int4 kernel from one row of the 8B shape on,
    docs/quantization.md; the runner turns "auto" into "torch" where they cannot run).
    """
    def to_device(array: np.ndarray) -> Tensor:
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)

    out, n = qw.shape
    if kernel != "torch" and quant_words.fits(qw):
        return kernel_weight(qw, device)
    scales = to_device(qw.scales).float()  # [out, groups]
    if qw.config.bits == 8 and qw.config.group_size is None:
        return Int8Weight(to_device(qw.data), scales[:, 0].to(dtype))
    codes = to_device(qw.data)
    offsets = to_device(group_offsets(qw))  # weight = code * scale + offset
    if qw.config.bits == 8 or not int4_kernel_fits(out, n, qw.group_size, device, dtype):
        return GroupWeight(codes, scales.to(dtype), offsets.to(dtype), qw.group_size, n)
    # The kernel computes (nibble - 8) * scale + zero: its zero is the weight nibble 8 stands for.
    packed = codes
    scales_and_zeros = torch.stack([scales.T, (8.0 * scales + offsets).T], dim=-1).to(dtype).contiguous()
    if device.type == "cpu":
        tiled = torch._convert_weight_to_int4pack_for_cpu(unpack_int4(packed, n).to(torch.int32), 2)
    else:
        inner_k_tiles = 8 if n % 128 == 0 else 4 if n % 64 == 0 else 2
        swapped = ((packed & 0x0F) << 4) | (packed >> 4)  # the CUDA kernel wants the even column high
        tiled = torch._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
        # prefill rows dequantize through the Triton kernel's map of the tiles, where Triton is at hand
        if triton_env.installed():
            from tinyinfer.runners import torch_quant_prefill

            tile_map = torch_quant_prefill.int4pack_tile_map(device, inner_k_tiles)
            return Int4Weight(tiled, scales_and_zeros, qw.group_size, tile_map)
    return Int4Weight(tiled, scales_and_zeros, qw.group_size)


def lookup_weight(qw: QuantizedWeight, device: torch.device) -> GroupWeight:
    """A quantized embedding as its stored codes with float32 scales and offsets, for row
    lookups (``embedding``) where the head's matmul layout cannot be gathered from (torch's
    tiled int4)."""
    def to_device(array: np.ndarray) -> Tensor:
        return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)

    return GroupWeight(to_device(qw.data), to_device(qw.scales).float(), to_device(group_offsets(qw)),
                       qw.group_size, qw.in_features)


def embedding(table: Tensor | QuantWeight, token_ids: Tensor, dtype: torch.dtype) -> Tensor:
    """One row per token.  table: [V, D], token_ids: [T] -> [T, D] in ``dtype``.

    A quantized table dequantizes only the rows it gathers, in float32:
    (code - zero) * scale + offset per group, as ``tinyinfer.quant.dequantize`` does.
    """
    if isinstance(table, Tensor):
        return table[token_ids]
    if isinstance(table, Int8Weight):
        return (table.codes[token_ids].float() * table.scales[token_ids, None].float()).to(dtype)
    if isinstance(table, KernelWeight):
        # a group's code pair q of word i is its stored pair W q + i (quant_words' layout; an int4
        # pair is one byte, an int8 pair two): a transposed view puts the pairs back in column
        # order, and the nibbles' unpacking (int4) or one copy (int8) writes them out
        t, n = len(token_ids), table.words.shape[1] * 32 // table.bits
        span, pair = table.group_size * table.bits // 32, table.bits // 4  # W words to a group
        raw = table.words[token_ids].view(torch.uint8 if table.bits == 4 else torch.int8)
        pairs = raw.view(t, -1, span, 4 // pair, pair).transpose(2, 3)  # [T, groups, PER / 2, W, pair]
        codes = (torch.stack([pairs & 0x0F, pairs >> 4], dim=-1) if table.bits == 4 else pairs).reshape(t, n)
        scales, offsets, zero, group = table.scales, table.offsets, table.zero, table.group_size
    elif isinstance(table, GroupWeight):
        n, zero, group = table.in_features, 0, table.group_size
        codes = table.codes[token_ids] if table.codes.dtype == torch.int8 else \
            unpack_int4(table.codes[token_ids], n)
        scales, offsets = table.scales, table.offsets
    else:
        raise TypeError(f"an embedding cannot be looked up in {type(table).__name__}'s layout")
    weight = (codes.float() - zero) * scales[token_ids].float().repeat_interleave(group, dim=1)[:, :n]
    if offsets is not None:
        weight = weight + offsets[token_ids].float().repeat_interleave(group, dim=1)[:, :n]
    return weight.to(dtype)


def norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """RMSNorm (bias None, Llama) or LayerNorm (GPT-2), computed in float32.  x: [T, D]."""
    xf = x.float()
    if bias is None:
        y = F.rms_norm(xf, (x.shape[-1],), weight.float(), eps)
    else:
        y = F.layer_norm(xf, (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


def attention_input(x: Tensor, residual: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                    qkv_w: Tensor, qkv_b: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """Add the previous block's output, normalise, project to fused q|k|v.

    x, residual: [T, D] -> (x + residual [T, D], qkv [T, (H + 2 Hkv) hd]).
    """
    x = x + residual
    return x, linear(norm(x, norm_w, norm_b, eps), qkv_w, qkv_b)


def mlp_block(x: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, norm_w: Tensor,
              norm_b: Tensor | None, in_w: Tensor, in_b: Tensor | None, out_w: Tensor,
              out_b: Tensor | None, eps: float, gated: bool) -> tuple[Tensor, Tensor]:
    """Project attention out and add it, then the MLP; its output is returned, not yet added.

    attn: [T, H hd]. Llama (gated): in_w is gate|up fused [2F, D], out = down(silu(gate) * up).
    GPT-2: in_w is fc [F, D], out = proj(gelu_tanh(fc)).  -> (x [T, D], mlp output [T, D]).
    """
    x = x + linear(attn, o_w, o_b)
    h = linear(norm(x, norm_w, norm_b, eps), in_w, in_b)
    if gated:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h, approximate="tanh")
    return x, linear(h, out_w, out_b)


def final_logits(x: Tensor, residual: Tensor, norm_w: Tensor, norm_b: Tensor | None,
                 head: Tensor, eps: float) -> Tensor:
    """Last residual add, final norm, LM head.  x: [R, D], head: [V, D] -> float32 [R, V]."""
    return linear(norm(x + residual, norm_w, norm_b, eps), head, None).float()


def split_qkv(qkv: Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Cut fused projections into heads.  qkv: [T, (H + 2 Hkv) hd] -> [T, H, hd], 2 x [T, Hkv, hd]."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim),
            v.reshape(-1, num_kv_heads, head_dim))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[i], x[i + hd/2]) by each token's angles.  x: [T, heads, hd], cos/sin: [T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """``quant.quantize_kv`` in torch, with the same rounding: int8 codes and one float16 scale per
    token and head (amax / 127, rounded up to float16).  x: [T, Hkv, hd] -> int8 [T, Hkv, hd], [T, Hkv]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127  # [T, Hkv]
    half = scale.to(torch.float16)
    # Round up: a float16 that fell below the float32 scale moves one step up (its bits + 1).
    up = (half.view(torch.int16) + 1).view(torch.float16)
    half = torch.where(half.float() < scale, up, half)
    s = half.float()[..., None]
    steps = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    return steps.round().clamp(-127, 127).to(torch.int8), half


def dequantize_kv(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Undo quantize_kv.  codes: [..., hd] int8, scales: [...] float16 -> [..., hd] in dtype."""
    return (codes.float() * scales.float()[..., None]).to(dtype)


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Store new tokens' K/V at their slots.  caches: [P, S, Hkv, hd], k, v: [T, Hkv, hd].

    int8 K/V (scales [P, S, Hkv] given): k and v are quantized as they are written."""
    if k_scale is not None and v_scale is not None:
        (k, k_s), (v, v_s) = quantize_kv(k), quantize_kv(v)
        k_scale.view(-1, k_scale.shape[2]).index_copy_(0, slots, k_s)
        v_scale.view(-1, v_scale.shape[2]).index_copy_(0, slots, v_s)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def read_pages(cache: Tensor, scale: Tensor | None, index: Tensor, dtype: torch.dtype) -> Tensor:
    """cache[index] as values in dtype: int8 codes (scale given) dequantized.
    cache: [P, S, Hkv, hd], scale: [P, S, Hkv], index: page ids of any shape -> [*index, S, Hkv, hd]."""
    if scale is None:
        return cache[index].to(dtype)
    return dequantize_kv(cache[index], scale[index], dtype)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, k_cache: Tensor,
                      v_cache: Tensor, pages: Tensor, context_len: int,
                      k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Causal attention of one sequence's new queries over its whole context.

    q: [Tq, H, hd] at `positions`; k, v: [Tq, Hkv, hd], already written to the cache.
    A chunk that is the whole context attends to its own k, v; a later chunk gathers
    the earlier keys from its pages, and so does every chunk with int8 K/V (scales
    [P, S, Hkv] given), which attends to K/V as stored.  A query at position p sees keys 0..p.
    -> [Tq, H, hd].
    """
    num_new = q.shape[0]
    if context_len == num_new and k_scale is None:
        keys, values, mask = k, v, None
    else:
        keys = read_pages(k_cache, k_scale, pages, q.dtype).flatten(0, 1)[:context_len]  # [N, Hkv, hd]
        values = read_pages(v_cache, v_scale, pages, q.dtype).flatten(0, 1)[:context_len]
        mask = torch.arange(context_len, device=q.device)[None, :] <= positions[:, None]  # [Tq, N]
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, N, hd]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    # 4-D (a batch of one): the fused flash / memory-efficient kernels take no 3-D inputs
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=mask, is_causal=mask is None)
    return out[0].transpose(0, 1)  # [Tq, H, hd]


@dataclass(frozen=True)
class PrefillChunks:
    """Several sequences' new tokens packed one after another (a step's prefill chunks): where
    each sequence's rows start, its context length and its pages.  Bp sequences, Tp rows."""

    starts: tuple[int, ...]  # [Bp + 1] each sequence's first row in the packed rows, then Tp
    context_lens: tuple[int, ...]  # [Bp] tokens in each context, these chunks' tokens included
    positions: Tensor  # [Tp] int64
    slots: Tensor  # [Tp] int64 cache slot of each new token
    page_tables: Tensor  # [Bp, W] int64 page ids, each row padded past its pages
    # [tiles, 3] int32 (sequence, first row, end row) of each query tile: the Triton kernel's
    # work list (None where the torch version runs)
    tiles: Tensor | None = None


def packed_prefill_attention(qkv: Tensor, chunks: PrefillChunks, k_cache: Tensor, v_cache: Tensor,
                             cos_table: Tensor | None, sin_table: Tensor | None, num_heads: int,
                             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Every prefill chunk of a step: rotate, store K/V, then causal attention one sequence at a
    time (``prefill_attention``: earlier tokens read from the pages).

    qkv: [Tp, (H + 2 Hkv) hd] packed as ``chunks`` says; caches: [P, S, Hkv, hd] (int8 K/V:
    int8 codes and their scales [P, S, Hkv]).  -> [Tp, H hd].
    The Triton kernel in torch_triton_prefill.py computes the same thing in one launch.
    """
    num_kv_heads, head_dim, page_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if cos_table is not None and sin_table is not None:
        cos, sin = cos_table[chunks.positions], sin_table[chunks.positions]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k_cache, v_cache, chunks.slots, k, v, k_scale, v_scale)
    out = qkv.new_empty((qkv.shape[0], num_heads * head_dim))
    for b, context_len in enumerate(chunks.context_lens):
        rows = slice(chunks.starts[b], chunks.starts[b + 1])
        pages = chunks.page_tables[b, :-(-context_len // page_size)]
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], chunks.positions[rows], k_cache,
                                      v_cache, pages, context_len, k_scale, v_scale).flatten(1)
    return out


def paged_decode_attention(qkv: Tensor, positions: Tensor, slots: Tensor, page_tables: Tensor,
                           k_cache: Tensor, v_cache: Tensor, cos_table: Tensor | None,
                           sin_table: Tensor | None, num_heads: int,
                           k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """q new tokens per sequence (q = 1: decode; k + 1: verifying a draft): rotate, store K/V,
    attend over the pages (gather + mask).

    qkv: [B q, (H + 2 Hkv) hd] (each sequence's q rows in order), positions/slots: [B q],
    page_tables: [B, W] page ids, caches: [P, S, Hkv, hd], cos/sin tables: [max_len, hd/2]
    (None without RoPE); int8 K/V: int8 caches and their scales [P, S, Hkv], read back
    dequantized. The token at position p sees keys 0..p.  -> [B q, H hd].
    The Triton kernel in torch_triton.py computes the same thing without the gather.
    """
    rows, batch = qkv.shape[0], page_tables.shape[0]
    q_len = rows // batch
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    if cos_table is not None and sin_table is not None:  # q and k turn together: one rotation
        qk = apply_rope(torch.cat([q, k], dim=1), cos_table[positions], sin_table[positions])
        q, k = qk[:, :num_heads], qk[:, num_heads:]
    write_kv(k_cache, v_cache, slots, k, v, k_scale, v_scale)
    keys = read_pages(k_cache, k_scale, page_tables, torch.float32).flatten(1, 2).transpose(1, 2)  # [B, Hkv, N = W S, hd]
    values = read_pages(v_cache, v_scale, page_tables, torch.float32).flatten(1, 2).transpose(1, 2)
    row_positions = positions.view(batch, q_len)
    seen = torch.arange(keys.shape[2], device=qkv.device) <= row_positions[:, :, None]  # [B, q, N]
    queries = q.view(batch, q_len, num_heads, head_dim).transpose(1, 2)  # [B, H, q, hd]
    out = F.scaled_dot_product_attention(  # [B, H, q, hd]; each query head reads its group's K/V
        queries.float(), keys, values, attn_mask=seen[:, None], enable_gqa=True)
    return out.transpose(1, 2).reshape(rows, num_heads * head_dim).to(qkv.dtype)
