"""Lesson 10 checker: your codes and scales against tinyinfer.quant, your byte count against the simulator."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from lessons.checking import Checklist, expect, expect_close
from tinyinfer.quant import QuantConfig, codes_and_zeros
from tinyinfer.quant import dequantize as engine_dequantize
from tinyinfer.quant import quantize as engine_quantize
from tinyinfer.simulate.memory import weight_bytes as simulated_bytes
from tinyinfer.simulate.memory import weight_group_size
from tinyinfer.simulate.model import model_preset, parameter_counts

checks = Checklist()


def engine(w: np.ndarray, group_size: int, bits: int):
    """The engine's quantized weight, its signed codes [out, in] and its scales [out, groups]."""
    qw = engine_quantize(w, QuantConfig(bits=8) if bits == 8 else QuantConfig(bits=4, group_size=group_size))
    codes, zeros = codes_and_zeros(qw)
    signed = codes - np.repeat(zeros, qw.group_size, axis=1)[:, :qw.in_features]
    return qw, signed, qw.scales


def weights(seed: int) -> list[tuple[np.ndarray, int, int]]:
    """(weight, group_size, bits): int8 rows, int4 groups, a ragged last group, an outlier, a zero row."""
    rng = np.random.default_rng(seed)
    heavy = rng.standard_t(3, (6, 64)).astype(np.float32) * 0.02
    heavy[2, 5] = 1.5  # one outlier stretches its group's grid
    ragged = rng.standard_normal((5, 100)).astype(np.float32)
    ragged[3] = 0.0
    return [(rng.standard_normal((4, 48)).astype(np.float32), 48, 8), (heavy, 32, 4),
            (ragged, 32, 4), (ragged, 100, 8), (heavy, 64, 4)]


FIXED = np.array([[0.5, -1.0, 0.25, 0.0, 2.0, -0.5, 0.125, 1.0],
                  [0.0, 0.0, 0.0, 0.0, -3.0, 0.5, 0.5, 0.5]], dtype=np.float32)


@checks.case("a fixed 2x8 weight, one int8 group per row", "group_scales",
             "lo = min(group min, 0), hi = max(group max, 0); scale = float16_up(max(lo / qmin, hi / qmax))")
def scales_fixed(ex: ModuleType) -> None:
    expect_close(np.asarray(ex.group_scales(FIXED, 8, 8), dtype=np.float64), engine(FIXED, 8, 8)[2],
                 "group_scales(fixed, group_size=8, bits=8)", rtol=0, atol=0)


@checks.case("int8 rows, int4 groups of 32 and 64, a ragged last group, an outlier, a zero row (seed 1)",
             "group_scales", "np.minimum.reduceat(w, starts, axis=1) takes each group's minimum, "
             "including a shorter last group")
def scales_random(ex: ModuleType) -> None:
    for w, group, bits in weights(1):
        expect_close(np.asarray(ex.group_scales(w, group, bits), dtype=np.float64), engine(w, group, bits)[2],
                     f"group_scales of a {w.shape} weight, group_size={group}, bits={bits}", rtol=0, atol=0)


@checks.case("codes and scales of the same weights (seed 2)", "quantize",
             "divide by each element's group scale, round to nearest, clip to code_range(bits)")
def codes(ex: ModuleType) -> None:
    for w, group, bits in weights(2):
        got_codes, got_scales = ex.quantize(w, group, bits)
        _, want_codes, want_scales = engine(w, group, bits)
        what = f"quantize of a {w.shape} weight, group_size={group}, bits={bits}"
        expect_close(np.asarray(got_scales, dtype=np.float64), want_scales, f"{what}: scales", rtol=0, atol=0)
        expect_close(got_codes, want_codes, f"{what}: codes", rtol=0, atol=0)


@checks.case("codes back to weights (seed 3)", "dequantize",
             "repeat each group's scale over its inputs (cut the last group), multiply with the codes")
def back(ex: ModuleType) -> None:
    for w, group, bits in weights(3):
        qw, signed, scales = engine(w, group, bits)
        expect_close(ex.dequantize(signed, scales, group), engine_dequantize(qw),
                     f"dequantize of a {w.shape} weight, group_size={group}, bits={bits}", rtol=1e-7, atol=0)


@checks.case("every weight is within half a step of its original (seed 4)", "dequantize",
             "round to the nearest code: the error is at most scale / 2 when nothing is clipped")
def half_step(ex: ModuleType) -> None:
    for w, group, bits in weights(4):
        codes, scales = ex.quantize(w, group, bits)
        error = np.abs(np.asarray(ex.dequantize(codes, scales, group)) - w)
        step = np.repeat(np.asarray(scales, dtype=np.float32), group, axis=1)[:, :w.shape[1]]
        expect(bool(np.all(error <= step / 2 + 1e-7)), f"an error exceeds half a step ({w.shape}, group {group})",
               f"worst error / step = {float((error / np.where(step > 0, step, 1)).max()):.3f}")


@checks.case("Llama-2-7B and Mixtral 8x7B at 16, 8 and 4 bits", "weight_bytes",
             "quantized params x (bits / 8 + 2 / group_size) + kept params x 2; 16 bits: 2 bytes each, no scales")
def sizes(ex: ModuleType) -> None:
    for name in ("llama-2-7b", "mixtral-8x7b"):
        spec = model_preset(name)
        p = parameter_counts(spec)
        for precision, bits in (("bf16", 16), ("int8", 8), ("int4", 4)):
            group = weight_group_size(spec, precision, 128)
            expect_close(ex.weight_bytes(p.quantizable, p.kept, bits, group),
                         simulated_bytes(spec, precision, 128).value,
                         f"weight_bytes of {spec.title} at {bits} bits (group {group})", rtol=1e-9)
