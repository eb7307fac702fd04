"""Lesson 02 checker: your operations against the reference runner, tinyinfer.runners.numpy_ref."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import CaseFailed, Checklist, expect, expect_close
from tinyinfer.runners import numpy_ref as ref

checks = Checklist()


def rope(positions: list[int], head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """The engine's cos/sin tables [T, hd/2] for these positions."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    return ref.rope_tables(inv_freq, np.asarray(positions))


def pair(result: object, what: str) -> tuple[np.ndarray, np.ndarray]:
    """attention's (out, weights), or a failure explaining the expected return value."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CaseFailed(f"{what} should return a pair (out, weights)",
                         "(out [Tq, H, hd], weights [H, Tq, N])", type(result).__name__)
    return result


def check_attention(ex: ModuleType, rng: np.random.Generator, n: int, tq: int, heads: int,
                    kv_heads: int, hd: int = 8) -> None:
    """Compare out and weights for the last tq queries of an n-token context."""
    q = rng.standard_normal((tq, heads, hd))
    k, v = rng.standard_normal((n, kv_heads, hd)), rng.standard_normal((n, kv_heads, hd))
    positions = np.arange(n - tq, n)
    what = f"attention with Tq={tq}, N={n}, H={heads}, Hkv={kv_heads}"
    out, weights = pair(ex.attention(q, k, v, positions), what)
    ref_out, ref_weights = ref.attention(q, k, v, positions)
    expect_close(weights, ref_weights, f"{what}: weights", rtol=1e-6, atol=1e-9)
    expect_close(out, ref_out, f"{what}: out", rtol=1e-6, atol=1e-9)


@checks.case("a fixed 2x4 input", "rms_norm",
             "rms = sqrt(mean(x * x, axis=-1, keepdims=True) + eps); return x / rms * weight")
def norm_fixed(ex: ModuleType) -> None:
    x = np.array([[1.0, -2.0, 3.0, -4.0], [0.5, 0.5, 0.5, 0.5]])
    w = np.array([1.0, 0.5, 2.0, 1.0])
    expect_close(ex.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), "rms_norm(x, weight, 1e-5)", rtol=1e-7)


@checks.case("random shapes and scales (seed 1)", "rms_norm",
             "take the mean over the last axis only, one value per row; keepdims=True lets it broadcast")
def norm_random(ex: ModuleType) -> None:
    rng = np.random.default_rng(1)
    for t, d in ((1, 8), (7, 64), (3, 5)):
        x, w = 10 * rng.standard_normal((t, d)), rng.standard_normal(d)
        expect_close(ex.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), f"rms_norm on [{t}, {d}]", rtol=1e-7)


@checks.case("a row of zeros stays finite", "rms_norm",
             "eps goes inside the square root, so a zero row divides by sqrt(eps), not by 0")
def norm_zero(ex: ModuleType) -> None:
    x, w = np.zeros((2, 4)), np.ones(4)
    expect_close(ex.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), "rms_norm of zeros")


@checks.case("3 tokens, 2 heads, head dim 4, positions 0, 1, 5", "apply_rope",
             "x1 = x[..., :half], x2 = x[..., half:]; cos[:, None, :] broadcasts over heads")
def rope_fixed(ex: ModuleType) -> None:
    x = np.arange(24, dtype=np.float64).reshape(3, 2, 4) / 10
    cos, sin = rope([0, 1, 5], 4)
    expect_close(ex.apply_rope(x, cos, sin), ref.apply_rope(x, cos, sin), "apply_rope", rtol=1e-7)


@checks.case("random heads and far positions (seed 2)", "apply_rope",
             "the pairs are (i, i + hd/2), not neighbours (2i, 2i + 1): that is the Llama layout")
def rope_random(ex: ModuleType) -> None:
    rng = np.random.default_rng(2)
    for t, heads, hd in ((5, 4, 8), (1, 2, 16), (9, 1, 32)):
        x = rng.standard_normal((t, heads, hd))
        cos, sin = rope(rng.integers(0, 4000, t).tolist(), hd)
        expect_close(ex.apply_rope(x, cos, sin), ref.apply_rope(x, cos, sin),
                     f"apply_rope on [{t}, {heads}, {hd}]", rtol=1e-7, atol=1e-9)


@checks.case("q·k depends only on the distance between positions", "apply_rope",
             "rotating q by angle a and k by angle b leaves q·k depending on a - b only")
def rope_relative(ex: ModuleType) -> None:
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((1, 1, 8)), rng.standard_normal((1, 1, 8))
    dots = []
    for start in (0, 17, 300):
        qc, qs = rope([start + 5], 8)
        kc, ks = rope([start], 8)
        dots.append(float(np.sum(np.asarray(ex.apply_rope(q, qc, qs)) * np.asarray(ex.apply_rope(k, kc, ks)))))
    expect(np.allclose(dots, dots[0], rtol=1e-6),
           "rotated q·k changed when both positions moved by the same amount",
           f"q at 5, 22, 305 with k 5 positions earlier gave {[round(d, 6) for d in dots]}")


@checks.case("prefill: 5 queries over 5 keys, 2 heads", "attention",
             "scores [H, Tq, N] = einsum('thd,nhd->htn', q, k) / sqrt(hd); mask keys after each query")
def attention_prefill(ex: ModuleType) -> None:
    check_attention(ex, np.random.default_rng(4), n=5, tq=5, heads=2, kv_heads=2)


@checks.case("decode: 1 query at the last position, grouped heads (H=4, Hkv=2)", "attention",
             "np.repeat(k, H // Hkv, axis=1) gives each query head its K/V head: heads 0,1 share K/V head 0")
def attention_decode(ex: ModuleType) -> None:
    check_attention(ex, np.random.default_rng(5), n=7, tq=1, heads=4, kv_heads=2)


@checks.case("a chunk: 3 queries at positions 4-6 over 7 keys, H=6 Hkv=2, and H=4 Hkv=1", "attention",
             "mask with the query's position, not its row: key n is visible when n <= q_positions[t]")
def attention_chunk(ex: ModuleType) -> None:
    rng = np.random.default_rng(6)
    check_attention(ex, rng, n=7, tq=3, heads=6, kv_heads=2)
    check_attention(ex, rng, n=7, tq=3, heads=4, kv_heads=1)


@checks.case("large scores do not overflow", "attention",
             "subtract each row's max score before np.exp: softmax is unchanged and exp stays finite")
def attention_large(ex: ModuleType) -> None:
    rng = np.random.default_rng(7)
    q = 40 * rng.standard_normal((2, 2, 8))
    k, v = 40 * rng.standard_normal((4, 2, 8)), rng.standard_normal((4, 2, 8))
    positions = np.array([2, 3])
    out, weights = pair(ex.attention(q, k, v, positions), "attention")
    ref_out, ref_weights = ref.attention(q, k, v, positions)
    expect_close(weights, ref_weights, "attention weights with scores in the hundreds", rtol=1e-6, atol=1e-9)
    expect_close(out, ref_out, "attention out with scores in the hundreds", rtol=1e-6, atol=1e-9)


@checks.case("fixed and random shapes (seed 8)", "swiglu",
             "gate = x @ w_gate.T, up = x @ w_up.T; return (silu(gate) * up) @ w_down.T")
def swiglu_random(ex: ModuleType) -> None:
    rng = np.random.default_rng(8)
    for t, d, f in ((1, 4, 6), (5, 16, 40), (3, 8, 8)):
        x = rng.standard_normal((t, d))
        g, u, dn = rng.standard_normal((f, d)), rng.standard_normal((f, d)), rng.standard_normal((d, f))
        expected = ref.linear(ref.silu(ref.linear(x, g)) * ref.linear(x, u), dn)
        expect_close(ex.swiglu(x, g, u, dn), expected, f"swiglu with T={t}, D={d}, F={f}", rtol=1e-7, atol=1e-9)
