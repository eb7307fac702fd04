"""Lesson 02 experiment: the bundled model runs on your four operations. Same logits? Where does time go?"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType

import numpy as np

import tinyinfer
from lessons.support import (
    LessonError,
    heading,
    heldout_text,
    load_model,
    plugged,
    table,
)
from tinyinfer.model import Model
from tinyinfer.runners import numpy_ref
from tinyinfer.runners.numpy_ref import NumpyRunner


def timed(fn: Callable, name: str, clock: dict[str, float]) -> Callable:
    """fn, adding its wall time to clock[name] on every call."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] += time.perf_counter() - start
    return wrapper


@contextmanager
def forward_ops(impl: ModuleType, clock: dict[str, float]) -> Iterator[None]:
    """Run the reference runner on impl's four operations, adding each one's time to clock."""
    swiglu = timed(impl.swiglu, "swiglu", clock)

    def mlp_block(self: NumpyRunner, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        h = self.norm(p + "mlp_norm", x)
        return swiglu(h, self.w[p + "gate.weight"], self.w[p + "up.weight"], self.w[p + "down.weight"])

    with ExitStack() as stack:
        for name in ("rms_norm", "apply_rope", "attention"):
            stack.enter_context(plugged(numpy_ref, name, timed(getattr(impl, name), name, clock)))
        stack.enter_context(plugged(NumpyRunner, "mlp_block", mlp_block))
        yield


def generate(model: Model, prompt: list[int], tokens: int,
             clock: dict[str, float]) -> tuple[str, dict[str, dict[str, float]]]:
    """Greedy text after prompt, and per phase (prefill, decode): forward time, tokens, clock's share."""
    phases: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    engine = tinyinfer.Engine(model)
    rid = engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while engine.has_unfinished():
        before = dict(clock)
        trace = engine.step()
        phase = phases["prefill" if trace.prefill_tokens else "decode"]
        phase["forward"] += trace.timings["forward"]
        phase["tokens"] += trace.num_batched_tokens
        for name, seconds in clock.items():
            phase[name] += seconds - before.get(name, 0.0)
    return engine.release(rid).text, phases


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Compare logits and greedy text with the reference; break a forward pass's time down by operation."""
    m = load_model(model)
    if m.config.family != "llama":
        raise LessonError(f"{m.name} is a {m.config.family} model; this lesson builds a Llama block")
    ids = m.tokenizer.encode(heldout_text(2000))[: 48 if quick else 256]
    new_tokens = 16 if quick else 48
    clock: dict[str, float] = defaultdict(float)

    heading(f"logits of {len(ids)} held-out tokens: your operations vs the reference")
    reference = m.logits(ids)
    with forward_ops(impl, clock):
        yours = m.logits(ids)
    diff = float(np.abs(yours - reference).max())
    agree = float(np.mean(yours.argmax(-1) == reference.argmax(-1)))
    print(f"largest logit difference {diff:.2e} (logits span {float(reference.min()):.1f}..{float(reference.max()):.1f})")
    print(f"most likely next token agrees at {100 * agree:.1f}% of positions")

    heading(f"greedy generation, {new_tokens} tokens after the same passage")
    ref_text, _ = generate(m, ids, new_tokens, defaultdict(float))
    clock.clear()
    with forward_ops(impl, clock):
        your_text, phases = generate(m, ids, new_tokens, clock)
    print(f"reference: {ref_text!r}")
    print(f"yours:     {your_text!r}")
    print("identical text" if your_text == ref_text else "the texts DIFFER: see the logit difference above")

    heading("where a forward pass spends its time (your operations, inside the engine)")
    print("'other' is the linear projections q/k/v/o, the embedding lookup and the output layer.")
    names = ("rms_norm", "apply_rope", "attention", "swiglu")
    rows = []
    for phase, c in phases.items():
        shares = [100 * c[n] / c["forward"] for n in names]
        rows.append((f"{phase} ({int(c['tokens'])} tokens)", f"{1e3 * c['forward']:.0f} ms",
                     *(f"{s:.0f}%" for s in shares), f"{max(0.0, 100 - sum(shares)):.0f}%"))
    print(table(("phase", "forward time", *names, "other"), rows))
    flops = 2 * m.config.num_parameters
    for phase, c in phases.items():
        rate = flops * c["tokens"] / c["forward"] / 1e9
        print(f"{phase}: about {rate:.2f} GFLOP/s (2 x {m.config.num_parameters:,} parameters per token)")
    print("No claim is tested here: lesson 03 uses these numbers to test C1, C2 and C16.")


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
