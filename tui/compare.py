"""Side-by-side comparisons a teacher asks for: the run's requests again under other settings.

Each comparison runs the scenario's requests to the end on fresh engines, one per setting, and
returns a table of what the traces counted: speculative decoding on vs off, the weights at fp32
vs int8 vs int4, KV pages vs contiguous reservations. Nothing here imports Textual: the compare
screen calls these from a worker, and the counts (passes, tokens, pages) are the same on every
machine; times appear only when asked for, and are labelled as this machine's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np

import tinyinfer
from tinyinfer.quant import QuantConfig
from tinyinfer.trace import SeqStep
from tui.drawing import FULL_SCALE, error_bar, short_name, visible
from tui.frames import Frame, emitted
from tui.session import Session, precision_of, reload

PRECISIONS = ("fp32", "int8", "int4")
KINDS = {"speculative": "speculative decoding on vs off",
         "precision": "fp32 vs int8 vs int4 weights",
         "memory": "paged vs contiguous KV memory",
         "models": "this model vs a real instruct model"}
REAL_MODEL = "smollm2"  # the real instruct model a classroom installs offline (docs/models.md)


@dataclass(frozen=True)
class Comparison:
    """A table (one column per setting) and the sentences that explain it."""

    kind: str  # a key of KINDS
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, tuple[str, ...]], ...]  # (what, one value per column)
    notes: tuple[str, ...] = ()


def run_to_end(session: Session, limit: int = 2000) -> Frame:
    """Step a live session until its requests (and the scenario's later arrivals) are done."""
    for _ in range(limit):
        if not session.engine_has_work:
            return session.frame
        session.begin_step()
        session.finish_step(session.compute_step())
    raise tinyinfer.TinyInferError(f"the comparison run did not finish within {limit} steps")


def _texts(frame: Frame) -> list[tuple[int, ...]]:
    return [tuple(t.token_id for t in s.output) for s in frame.seqs]


def _ms(seconds: list[float]) -> str:
    return f"{1e3 * statistics.median(seconds):.1f} ms" if seconds else "—"


def _token(frame: Frame, token_id: int) -> str:
    return repr(visible(frame.text(token_id) or f"#{token_id}"))


# ---------------------------------------------------------------------- speculative on vs off


def _passes(frame: Frame) -> int:
    """Forward passes of the target model: steps that computed anything."""
    return sum(1 for t in frame.traces if t.seqs)


def compare_speculation(session: Session, timings: bool = False) -> Comparison:
    """The same requests with speculative decoding off and on (the session's drafter)."""
    assert session.engine is not None and session.scenario is not None
    speculation = session.speculation
    if speculation is None:
        raise tinyinfer.TinyInferError("this run has no drafter to compare with")
    runs = {}
    for on in (False, True):
        live = Session.live(session.engine.model, session.scenario, session.seed,
                            speculation=dataclasses.replace(speculation, on=on), detail="basic")
        runs[on] = run_to_end(live)
    off, spec = runs[False], runs[True]
    verified = [p for t in spec.traces for p in t.seqs if p.draft_tokens]
    guessed = sum(len(p.draft_tokens) for p in verified)
    kept = sum(p.accepted for p in verified)
    made = [sum(len(s.output) for s in f.seqs) for f in (off, spec)]
    passes = [_passes(f) for f in (off, spec)]
    rows = [
        ("engine steps", (str(len(off.traces)), str(len(spec.traces)))),
        ("target model passes", (str(passes[0]), str(passes[1]))),
        ("tokens generated", (str(made[0]), str(made[1]))),
        ("tokens per target pass", (f"{made[0] / passes[0]:.2f}", f"{made[1] / passes[1]:.2f}")),
        ("guesses drafted", ("—", str(guessed))),
        ("guesses kept / dropped", ("—", f"{kept} / {guessed - kept}"
                                 + (f" ({100 * kept / guessed:.0f}%)" if guessed else ""))),
        ("same text as off", ("—", "yes" if _texts(off) == _texts(spec) else "NO")),
    ]
    if timings:
        decode = [t.timings["forward"] for t in off.traces if t.seqs and not t.prefill_tokens]
        verify = [t.timings["forward"] for t in spec.traces if any(p.draft_tokens for p in t.seqs)]
        draft = [t.timings.get("draft", 0.0) for t in spec.traces if any(p.draft_tokens for p in t.seqs)]
        total = [sum(sum(t.timings.values()) for t in f.traces) for f in (off, spec)]
        rows += [
            ("one pass (median, this machine)", (_ms(decode) + " decode", _ms(verify) + " verify")),
            ("drafting per step (median)", ("—", _ms(draft))),
            ("engine time, whole run", (f"{total[0]:.2f} s", f"{total[1]:.2f} s")),
        ]
    saved = passes[0] - passes[1]
    notes = [f"Speculation saved {saved} of {passes[0]} target passes ({100 * saved / passes[0]:.0f}%): "
             "a count, the same on every machine. Whether that saves time depends on what a verify "
             "pass and the drafting cost on the machine (a memory-bound GPU: about one decode pass; "
             "a CPU: more)."]
    rejected = [(spec, p) for p in verified if p.accepted < len(p.draft_tokens)]
    if rejected:
        said = "; ".join(f"@{p.start + p.accepted}: guessed {_token(spec, p.draft_tokens[p.accepted])}, "
                         f"the model picks {_token(spec, emitted(p)[-1])}" for _, p in rejected[:3])
        notes.append(f"Rejected guesses: the drafter predicted a token the model would not pick at "
                     f"that position, so the model's own token replaced it and later guesses were "
                     f"dropped (the text stays the model's). First ones: {said}.")
    return Comparison("speculative", f"{session.scenario.name}: speculative decoding off vs on "
                      f"({speculation.name}, {speculation.num_draft} guesses per step)",
                      ("off", "on"), tuple(rows), tuple(notes))


# ---------------------------------------------------------------------- fp32 vs int8 vs int4


def _raw_probs(part: SeqStep) -> dict[int, float]:
    """The model's next-token probabilities at temperature 1, from a full-detail trace."""
    ids = [t for t, _ in part.top_logits]
    x = np.array([v for _, v in part.top_logits], dtype=np.float64)
    rest = dict(part.rest_logsumexp).get(1.0, -np.inf)
    total = np.logaddexp(x.max() + np.log(np.exp(x - x.max()).sum()), rest)
    return dict(zip(ids, np.exp(x - total).tolist()))


def _first_sample(frame: Frame) -> SeqStep:
    return next(p for t in frame.traces for p in t.seqs if p.token_id is not None)


def _bits(precision: str, hidden: int) -> str:
    if precision == "fp32":
        return "32"
    codes, extra = QuantConfig.parse(precision).stored_bytes(1, hidden)
    return f"{8 * (codes + extra) / hidden:.2f}"


def delta(d: float) -> str:
    """A probability change to three decimals; ±0 when it rounds away."""
    return "±0" if abs(d) < 0.0005 else f"{d:+.3f}"


def _same_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_precisions(session: Session, device: str | None = None) -> Comparison:
    """The same requests on fp32, int8 and int4 weights (reloading the checkpoint as needed)."""
    assert session.engine is not None and session.scenario is not None
    if session.tensor_parallel > 1:
        raise tinyinfer.TinyInferError("tensor parallelism splits float weights only: compare "
                                       "precisions without --tensor-parallel")
    model = session.engine.model
    names = [p if p == "fp32" else QuantConfig.parse(p).name for p in PRECISIONS]
    models = {name: model if precision_of(model) == name else reload(model, name, device)
              for name in names}
    speculation = dataclasses.replace(session.speculation, on=False) if session.speculation else None
    frames = {name: run_to_end(Session.live(m, dataclasses.replace(session.scenario, quantize=name),
                                            session.seed, speculation=speculation))
              for name, m in models.items()}
    first = {name: _raw_probs(_first_sample(f)) for name, f in frames.items()}
    base = frames["fp32"]
    top = sorted(first["fp32"], key=lambda t: -first["fp32"][t])[:5]
    rows = [("bits per linear weight", tuple(_bits(n, model.config.hidden_size) for n in names))]
    for t in top:
        p0 = first["fp32"][t]
        rows.append((f"p({_token(base, t)}) 1st token",
                     tuple(f"{first[n].get(t, 0.0):.3f}" + ("" if n == "fp32" else
                           f" ({delta(first[n].get(t, 0.0) - p0)})") for n in names)))
    errors = {n: models[n].quant_errors.layers if models[n].quant_errors else () for n in names}
    kinds = sorted({short_name(e.name).split(".")[-1] for e in errors[names[1]]},
                   key=lambda k: [short_name(e.name).split(".")[-1] for e in errors[names[1]]].index(k))
    for kind in kinds:
        cells = []
        for n in names:
            picked = [e.relative for e in errors[n] if short_name(e.name).split(".")[-1] == kind]
            mean = sum(picked) / len(picked) if picked else 0.0
            cells.append(f"{error_bar(mean, 8)} {100 * mean:5.2f}%" if picked else "as trained")
        rows.append((f"‖W−Ŵ‖/‖W‖ {kind}", tuple(cells)))
    texts = {n: _texts(f) for n, f in frames.items()}
    rows.append(("tokens as fp32's", tuple(
        " · ".join(f"{_same_prefix(a, b)}/{len(a)}" for a, b in zip(texts["fp32"], texts[n]))
        for n in names)))
    notes = (f"Every bar is on one scale, 0 to {100 * FULL_SCALE:.0f}% relative error, so int8's and "
             "int4's rounding compare at a glance. The probabilities are the model's own (temperature "
             "1) for the first generated token; in brackets the change from fp32.",
             "'tokens as fp32's': how many generated tokens match the fp32 run before the first "
             "difference (same prompt, seed and sampling: a changed probability can change a draw).")
    return Comparison("precision", f"{session.scenario.name}: the same requests on fp32, int8 and "
                      "int4 weights", tuple(names), tuple(rows), notes)


# ---------------------------------------------------------------------- paged vs contiguous


def _memory(frame: Frame, page_size: int) -> tuple[int, int, float, int]:
    """(peak pages held, peak sequences at once, time-averaged share of held slots holding a
    token, peak tokens held) over a run's steps."""
    held, at_once, used, tokens = 0, 0, [], 0
    computed: dict[int, int] = {}
    for trace in frame.traces:
        for part in trace.seqs:
            computed[part.seq_id] = part.end - (len(part.draft_tokens) - part.accepted)
        for seq_id in (*trace.preempted, *trace.finished):
            computed.pop(seq_id, None)
        if trace.pool is None or not trace.pool.used:
            continue
        slots = trace.pool.used * page_size
        stored = sum(computed.values())
        held, tokens = max(held, trace.pool.used), max(tokens, stored)
        at_once = max(at_once, trace.num_running)
        used.append(min(1.0, stored / slots))
    return held, at_once, (sum(used) / len(used) if used else 0.0), tokens


def compare_memory(session: Session) -> Comparison:
    """The same requests with KV pages allocated as needed vs a whole context reserved per
    sequence. Both get a pool big enough to run everything (prefix caching off in both, so every
    token has its own slot); then: how many sequences the scenario's own pool holds each way."""
    assert session.engine is not None and session.scenario is not None
    scenario = session.scenario
    model = session.engine.model
    ps = scenario.page_size
    context = math.ceil(model.config.max_model_len / ps)  # pages one contiguous sequence reserves
    big = min(scenario.max_num_seqs, len(scenario.arrivals)) * context
    speculation = dataclasses.replace(session.speculation, on=False) if session.speculation else None
    frames = {mode: run_to_end(Session.live(model, dataclasses.replace(scenario, num_pages=big),
                                            session.seed, speculation=speculation,
                                            kv_allocation=mode, enable_prefix_caching=False,
                                            detail="basic"))
              for mode in ("paged", "contiguous")}
    stats = {mode: _memory(f, ps) for mode, f in frames.items()}
    pool = session.engine.pool.num_pages
    page_bytes = session.engine.page_bytes
    rows = [
        ("peak KV pages held", tuple(f"{s[0]} ({s[0] * page_bytes / 2**20:.1f} MB)" for s in stats.values())),
        ("peak tokens in them", tuple(str(s[3]) for s in stats.values())),
        ("slots holding a token (avg)", tuple(f"{100 * s[2]:.0f}%" for s in stats.values())),
        ("sequences at once (peak)", tuple(str(s[1]) for s in stats.values())),
        ("engine steps", tuple(str(len(f.traces)) for f in frames.values())),
        ("same text", ("—", "yes" if _texts(frames["paged"]) == _texts(frames["contiguous"]) else "NO")),
        (f"in this run's {pool}-page pool", (
            f"all {stats['paged'][1]} at once" if stats["paged"][0] <= pool
            else f"by preempting (peak {stats['paged'][0]})",
            f"{pool // context} at once" + (" — none fits" if pool < context else ""))),
    ]
    notes = (f"Contiguous allocation reserves a whole context ({model.config.max_model_len} tokens = "
             f"{context} pages of {ps}) for every sequence at admission, however short its answer; "
             "paging hands out one page at a time as the text grows, so at most one page per sequence "
             "is partly empty.",
             "Both runs compute the same tokens, so the text is the same: the difference is memory, "
             "and with it how many sequences fit at once.")
    return Comparison("memory", f"{scenario.name}: paged vs contiguous KV memory on the same requests",
                      ("paged", "contiguous"), tuple(rows), notes)


# ---------------------------------------------------------------------- the bundled model vs a real one


def compare_models(session: Session, other: str = REAL_MODEL, device: str | None = None) -> Comparison:
    """The run's requests on its model and on another one (a real instruct model; the bundled
    model when the run is on that one): the same text, split by each model's tokenizer."""
    assert session.engine is not None and session.scenario is not None
    model = session.engine.model
    if model.name == other:
        other = "bundled"
    second = tinyinfer.load(other, runner=model.runner.name, device=device)
    models = (model, second)
    frames = [run_to_end(Session.live(m, dataclasses.replace(session.scenario, quantize=None),
                                      session.seed)) for m in models]
    first = [_raw_probs(_first_sample(f)) for f in frames]

    def top(probs: dict[int, float], frame: Frame, k: int) -> str:
        best = sorted(probs, key=lambda t: -probs[t])[:k]
        return " ".join(f"{_token(frame, t)} {probs[t]:.2f}".replace("0.", ".") for t in best)

    def answer(frame: Frame) -> str:  # short enough for two columns at 80 characters
        text = "".join(frame.text(t.token_id) or "" for t in frame.seqs[0].output)
        return repr(visible(text[:18]) + ("…" if len(text) > 18 else ""))

    rows = [
        ("parameters", tuple(f"{m.config.num_parameters / 1e6:.1f} M" for m in models)),
        ("layers · heads (KV)", tuple(f"{m.config.num_layers} · {m.config.num_heads} "
                                      f"({m.config.num_kv_heads})" for m in models)),
        ("linear weights", tuple(precision_of(m) for m in models)),
        ("vocabulary", tuple(f"{m.config.vocab_size:,}" for m in models)),
        ("1st prompt in tokens", tuple(str(f.seqs[0].prompt_len or len(f.seqs[0].prompt)) for f in frames)),
        ("KV bytes per token", tuple(f"{m.runner.info.kv_bytes_per_token(m.config):,}"
                                     for m in models)),
        ("1st token, top 2 (T = 1)", tuple(top(p, f, 2) for p, f in zip(first, frames))),
        ("1st answer begins", tuple(answer(f) for f in frames)),
        ("tokens generated", tuple(str(sum(len(s.output) for s in f.seqs)) for f in frames)),
    ]
    notes = ("The same requests, run to the end on each model with the same seed and sampling. Each "
             "model cuts the text with its own tokenizer: a larger vocabulary needs fewer tokens for "
             "the same words, and each token costs one position of KV cache.",
             "A real model spends its parameters on language in general: its first-token choices "
             "and its answer show what it learned, next to a small model trained on one author.")
    return Comparison("models", f"{session.scenario.name}: {model.name} vs {second.name} on the same "
                      "requests", (model.name, second.name), tuple(rows), notes)


def default_kind(session: Session) -> str:
    """The comparison a run is about: its feature's, else memory."""
    if session.source.precision:
        return "precision"
    if session.source.drafter:
        return "speculative"
    return "memory"


def compare(kind: str, session: Session, timings: bool = False, device: str | None = None) -> Comparison:
    """Run one comparison (slow: call from a worker)."""
    if kind == "speculative":
        return compare_speculation(session, timings)
    if kind == "precision":
        return compare_precisions(session, device)
    if kind == "models":
        return compare_models(session, device=device)
    return compare_memory(session)
