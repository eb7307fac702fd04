"""The reference forward pass: plain NumPy, one small function per operation.

Read it next to the lesson text. Shapes use: T new tokens in the batch, D hidden size,
H query heads, Hkv key/value heads, hd head dim, F MLP width, V vocabulary,
N context tokens of one sequence, P pages, S tokens per page (page size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyinfer.config import ModelConfig, rope_inverse_frequencies
from tinyinfer.errors import TinyInferError
from tinyinfer.quant import (
    QuantizedWeight,
    dequantize,
    dequantize_kv,
    dequantize_rows,
    group_offsets,
    quantize_kv,
    unpack_int4,
)
from tinyinfer.runners.runner import (
    AfterVerification,
    Batch,
    Feed,
    RankTiming,
    Rounds,
    RunnerInfo,
    TokensFuture,
    TopFuture,
    TopLogits,
    check_kv_cache_dtype,
    fed_batch,
    launch_rounds_after_stepwise,
    launch_rounds_stepwise,
    top_logits,
)

# ---------------------------------------------------------------- operations


# Plug points: functions this module calls by their global name, so that the course can put a
# student's version in their place (lessons/support.py: plugged). tests/test_lessons.py checks
# that the engine still reaches every one.
PLUG_POINTS = ("rms_norm", "apply_rope", "attention")


def embedding(table: np.ndarray | QuantizedWeight, token_ids: np.ndarray) -> np.ndarray:
    """Look up one row per token.  table: [V, D], token_ids: [T] -> [T, D].

    A quantized table (``--quantize-head``) dequantizes only the rows it gathers.
    """
    if isinstance(table, QuantizedWeight):
        return dequantize_rows(table, token_ids)
    return table[token_ids]


# Up to this many rows, `linear` multiplies by a quantized weight's codes; beyond it, dequantizing
# once costs less than scaling every row's per-group sums (measured on a 2-core CPU).
CODE_PRODUCT_ROWS = 8


def linear(x: np.ndarray, weight: np.ndarray | QuantizedWeight,
           bias: np.ndarray | None = None) -> np.ndarray:
    """y = x W^T + b.  x: [T, in], weight: [out, in] -> [T, out].

    A quantized weight stays int8/int4 in memory. A few rows (decode) multiply by its codes
    (`quantized_matmul`); more rows (prefill) share one dequantized copy, made for this product.
    """
    if isinstance(weight, QuantizedWeight) and len(x) <= CODE_PRODUCT_ROWS:
        y = quantized_matmul(x, weight)
    else:
        if isinstance(weight, QuantizedWeight):
            weight = dequantize(weight).astype(x.dtype, copy=False)
        y = x @ weight.T
    return y if bias is None else y + bias


def quantized_matmul(x: np.ndarray, qw: QuantizedWeight) -> np.ndarray:
    """x @ dequantize(qw).T without building the float weight.  x: [T, in] -> [T, out].

    Every weight is code * scale + offset, one scale and offset per group of inputs, so a group's
    share of an output is its scale times a dot product with the raw codes, plus its offset times
    the sum of the group's inputs:

        y[t, o] = sum over groups g of  scale[o, g] * (sum_{i in g} x[t, i] * code[o, i])
                                      + offset[o, g] * (sum_{i in g} x[t, i])

    So a product converts the codes to floats (one pass over the weight) and lets BLAS take the
    dot products, group by group; scales and offsets touch one number per group. Symmetric
    formats use signed codes (int4: nibble - 8), whose offset is zero. Dequantizing first costs
    more passes over a float weight 4 or 8 times the stored size. The sums run in another order
    than x @ dequantize(qw).T, so the two agree to rounding, not bit for bit
    (tests/test_quant_numpy.py states the tolerance).
    """
    g, groups = qw.group_size, qw.num_groups
    codes = qw.data if qw.config.bits == 8 else unpack_int4(qw.data, qw.in_features)  # [out, in]
    if qw.config.bits == 4 and qw.config.symmetric:
        codes = (codes - 8).view(np.int8)  # nibble - 8, wrapped into a signed byte
    width = groups * g  # a ragged last group is padded with zeros
    codes = _padded(codes, width).astype(x.dtype, order="C")  # the one pass over the weight
    xs = _padded(x, width).reshape(len(x), groups, g)
    partial = xs.transpose(1, 0, 2) @ codes.reshape(-1, groups, g).transpose(1, 2, 0)  # [G, T, out]
    y = (partial * qw.scales.astype(x.dtype).T[:, None, :]).sum(axis=0)
    if not qw.config.symmetric:  # each group's offset times the sum of its inputs
        y += xs.sum(axis=-1) @ group_offsets(qw).T.astype(x.dtype)
    return y


def _padded(a: np.ndarray, width: int) -> np.ndarray:
    """a with its columns padded with zeros to width."""
    if a.shape[1] == width:
        return a
    padded = np.zeros((len(a), width), a.dtype)
    padded[:, :a.shape[1]] = a
    return padded


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """GPT-2's LayerNorm: centre and scale each row.  x: [T, D]."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Llama's RMSNorm: scale each row by its root mean square (no centring).  x: [T, D]."""
    rms = np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return x / rms * weight


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU, the tanh approximation."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), the gate activation of SwiGLU."""
    return x / (1.0 + np.exp(-x))


def rope_tables(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) angle.  -> two [T, hd/2] arrays."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs (x[i], x[i + hd/2]) by each position's angle.  x: [T, heads, hd].

    Rotating queries and keys by their positions makes q·k depend only on the distance
    between them. This is the "rotate half" layout that Hugging Face Llama checkpoints use.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically safe softmax: subtract the max before exponentiating."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
              q_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of one sequence's new queries over its whole context.

    q: [Tq, H, hd] (positions q_positions), k, v: [N, Hkv, hd] for positions 0..N-1.
    With grouped-query attention, each group of H/Hkv query heads shares one K/V head.
    Returns the output [Tq, H, hd] and the attention weights [H, Tq, N].
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    k = np.repeat(k, group, axis=1)  # [N, H, hd]
    v = np.repeat(v, group, axis=1)
    # Batched over heads: [H, Tq, hd] @ [H, hd, N] -> [H, Tq, N] (matmul uses BLAS).
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) / np.sqrt(q.shape[-1])
    future = np.arange(k.shape[0])[None, :] > q_positions[:, None]  # [Tq, N]
    scores = np.where(future[None], -np.inf, scores)
    weights = softmax(scores, axis=-1)
    out = weights @ v.transpose(1, 0, 2)  # [H, Tq, N] @ [H, N, hd] -> [H, Tq, hd]
    return out.transpose(1, 0, 2), weights


# ---------------------------------------------------------------- paged KV storage


@dataclass
class NumpyKVCache:
    """K and V pages per layer: k[layer] is [P, S, Hkv, hd].

    With int8 K/V, k and v hold int8 codes and k_scale / v_scale[layer] one float16 scale
    per token and head, [P, S, Hkv]: a quarter of float32's bytes, plus the scales.
    """

    k: list[np.ndarray]
    v: list[np.ndarray]
    page_size: int
    k_scale: list[np.ndarray] | None = None
    v_scale: list[np.ndarray] | None = None

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store new tokens' K/V [T, Hkv, hd] at their slots (page * S + offset)."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        if self.k_scale is not None and self.v_scale is not None:
            k, self.k_scale[layer][pages, offsets] = quantize_kv(k)
            v, self.v_scale[layer][pages, offsets] = quantize_kv(v)
        self.k[layer][pages, offsets] = k
        self.v[layer][pages, offsets] = v

    def gather(self, layer: int, page_table: tuple[int, ...],
               length: int) -> tuple[np.ndarray, np.ndarray]:
        """One sequence's K/V in position order: pages by page table, cut to length. -> [N, Hkv, hd]."""
        pages = list(page_table)
        k = self.k[layer][pages].reshape(-1, *self.k[layer].shape[2:])[:length]
        v = self.v[layer][pages].reshape(-1, *self.v[layer].shape[2:])[:length]
        if self.k_scale is not None and self.v_scale is not None:
            k = dequantize_kv(k, self.k_scale[layer][pages].reshape(-1, k.shape[1])[:length])
            v = dequantize_kv(v, self.v_scale[layer][pages].reshape(-1, v.shape[1])[:length])
        return k, v


# ---------------------------------------------------------------- the model


class NumpyRunner:
    """Reference runner: float32 by default, float64 on request; K/V in that dtype, or int8
    codes with float16 scales (``kv_cache_dtype="int8"``)."""

    name = "numpy"
    PLUG_POINTS = ("mlp_block",)  # a method the forward pass calls through self (lesson 02)

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray | QuantizedWeight],
                 dtype: str = "float32", kv_cache_dtype: str = "auto"):
        if dtype not in ("float32", "float64"):
            raise TinyInferError(f"the NumPy runner computes in float32 or float64, not {dtype}: "
                                 "pass --dtype float32 or float64 (or use --runner torch)")
        self.config = config
        self.dtype = np.dtype(dtype)
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        # Opt-in detail for UIs: per sequence of the last batch, per layer, the attention
        # weights [H, N] of its last query row.
        self.capture_attention = False
        self.last_attention: list[list[np.ndarray]] = []
        self.last_timings: tuple[RankTiming, ...] = ()  # one process
        self.w = {name: value if isinstance(value, QuantizedWeight) else np.asarray(value, dtype=self.dtype)
                  for name, value in weights.items()}
        if config.uses_rope:
            self.inv_freq = np.asarray(rope_inverse_frequencies(config), dtype=np.float64)

    @property
    def info(self) -> RunnerInfo:
        int8 = self.kv_cache_dtype == "int8"
        return RunnerInfo(name=self.name, dtype=self.dtype.name, device="cpu",
                          itemsize=1 if int8 else self.dtype.itemsize,
                          weight_bytes=sum(w.nbytes for w in self.w.values()),
                          kv_cache_dtype=self.kv_cache_dtype, kv_scale_bytes=2 if int8 else 0)

    def new_kv_cache(self, num_pages: int, page_size: int) -> NumpyKVCache:
        c = self.config
        shape = (num_pages, page_size, c.num_kv_heads, c.head_dim)
        if self.kv_cache_dtype == "int8":
            return NumpyKVCache(
                k=[np.zeros(shape, np.int8) for _ in range(c.num_layers)],
                v=[np.zeros(shape, np.int8) for _ in range(c.num_layers)],
                page_size=page_size,
                k_scale=[np.zeros(shape[:3], np.float16) for _ in range(c.num_layers)],
                v_scale=[np.zeros(shape[:3], np.float16) for _ in range(c.num_layers)],
            )
        return NumpyKVCache(
            k=[np.zeros(shape, self.dtype) for _ in range(c.num_layers)],
            v=[np.zeros(shape, self.dtype) for _ in range(c.num_layers)],
            page_size=page_size,
        )

    def close(self) -> None:
        """Nothing outlives this runner: it runs in this process alone."""

    def copy_page(self, kv_cache: NumpyKVCache, src: int, dst: int) -> None:
        for layer in range(self.config.num_layers):
            kv_cache.k[layer][dst] = kv_cache.k[layer][src]
            kv_cache.v[layer][dst] = kv_cache.v[layer][src]
            if kv_cache.k_scale is not None and kv_cache.v_scale is not None:
                kv_cache.k_scale[layer][dst] = kv_cache.k_scale[layer][src]
                kv_cache.v_scale[layer][dst] = kv_cache.v_scale[layer][src]

    def forward(self, batch: Batch, kv_cache: NumpyKVCache) -> np.ndarray:
        """Embed, run every layer, and return logits for the batch's logits_rows. -> [R, V]."""
        c, w = self.config, self.w
        self.last_attention = [[] for _ in range(batch.num_seqs)]
        x = embedding(w["embed"], batch.token_ids).astype(self.dtype, copy=False)  # [T, D]
        if c.family == "gpt2":
            x = x + embedding(w["pos_embed"], batch.positions)
            rope = None
        else:
            rope = rope_tables(self.inv_freq, batch.positions)
        for layer in range(c.num_layers):
            x = x + self.attention_block(layer, x, batch, kv_cache, rope)
            x = x + self.mlp_block(layer, x)
        x = self.norm("final_norm", x[batch.logits_rows])
        head = w.get("lm_head", w["embed"])  # tied embeddings reuse the input table
        return linear(x, head).astype(np.float32)  # [R, V]

    def forward_top(self, batch: Batch, kv_cache: NumpyKVCache, k: int) -> TopLogits:
        """The full forward pass, then each row's top k on the host (nothing to save here)."""
        return top_logits(self.forward(batch, kv_cache), k)

    def launch_top(self, batch: Batch, kv_cache: NumpyKVCache, k: int,
                   feed: Feed | None = None) -> TopFuture:
        """forward_top, computed now (nothing here runs behind the host's back)."""
        return TopFuture.done(self.forward_top(fed_batch(batch, feed), kv_cache, k))

    def launch_rounds(self, batch: Batch, kv_cache: NumpyKVCache, rounds: Rounds) -> TokensFuture:
        """Greedy rounds as the rule has them: one step after another (each computed at once)."""
        return launch_rounds_stepwise(self, batch, kv_cache, rounds)

    def launch_rounds_after(self, kv_cache: NumpyKVCache, after: AfterVerification) -> TokensFuture:
        """Computed at once: the rule (``launch_rounds_after_stepwise``)."""
        return launch_rounds_after_stepwise(self, kv_cache, after)

    def norm(self, name: str, x: np.ndarray) -> np.ndarray:
        if self.config.family == "gpt2":
            return layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.config.norm_eps)
        return rms_norm(x, self.w[f"{name}.weight"], self.config.norm_eps)

    def attention_block(self, layer: int, x: np.ndarray, batch: Batch, kv: NumpyKVCache,
                        rope: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """Norm, project to q/k/v, rotate, store K/V in pages, attend per sequence, project out."""
        c, w, p = self.config, self.w, f"layers.{layer}."
        h = self.norm(p + "attn_norm", x)
        q = linear(h, w[p + "q.weight"], w.get(p + "q.bias")).reshape(-1, c.num_heads, c.head_dim)
        k = linear(h, w[p + "k.weight"], w.get(p + "k.bias")).reshape(-1, c.num_kv_heads, c.head_dim)
        v = linear(h, w[p + "v.weight"], w.get(p + "v.bias")).reshape(-1, c.num_kv_heads, c.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv.write(layer, batch.slot_mapping, k, v)
        out = np.empty_like(q)  # [T, H, hd]
        for b in range(batch.num_seqs):
            rows = slice(batch.query_starts[b], batch.query_starts[b + 1])
            k_ctx, v_ctx = kv.gather(layer, batch.page_tables[b], int(batch.context_lens[b]))
            out[rows], weights = attention(q[rows], k_ctx, v_ctx, batch.positions[rows])
            if self.capture_attention:
                self.last_attention[b].append(weights[:, -1, :])
        return linear(out.reshape(len(x), -1), w[p + "o.weight"], w.get(p + "o.bias"))

    def mlp_block(self, layer: int, x: np.ndarray) -> np.ndarray:
        """GPT-2: fc → GELU → proj.  Llama: down(silu(gate(x)) * up(x)) (SwiGLU)."""
        w, p = self.w, f"layers.{layer}."
        h = self.norm(p + "mlp_norm", x)
        if self.config.family == "gpt2":
            return linear(gelu_tanh(linear(h, w[p + "fc.weight"], w[p + "fc.bias"])),
                          w[p + "proj.weight"], w[p + "proj.bias"])
        gate = linear(h, w[p + "gate.weight"], w.get(p + "gate.bias"))
        up = linear(h, w[p + "up.weight"], w.get(p + "up.bias"))
        return linear(silu(gate) * up, w[p + "down.weight"], w.get(p + "down.bias"))
