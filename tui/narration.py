"""The guided walkthrough's words: what the frame on screen shows, and why the engine does it.

`narrate` picks the most instructive thing that happened in a frame (preemption beats a prefix
hit beats a plain decode) and explains it, naming the panel to highlight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tinyinfer.engine_config import DEFAULTS
from tinyinfer.trace import SeqStep, StepTrace
from tui.frames import Frame, emitted


@dataclass(frozen=True)
class Narration:
    """One explanation: a headline, a few sentences, and the panel it is about."""

    title: str
    body: str
    panel: str  # id of the panel to highlight


def _seen_before(frame: Frame, test: Callable[[StepTrace], object]) -> bool:
    """Whether an earlier step of the frame's run passed the test."""
    return any(test(t) for t in frame.traces[:-1])


def _names(seq_ids: Iterable[int]) -> str:
    return ", ".join(f"seq {i}" for i in seq_ids)


def _prefills(trace: StepTrace) -> list[SeqStep]:
    return [s for s in trace.seqs if s.kind == "prefill"]


def _decodes(trace: StepTrace) -> list[SeqStep]:
    return [s for s in trace.seqs if s.kind == "decode"]


def _start(frame: Frame, intro: str) -> Narration:
    if not frame.seqs:
        return Narration("Replay of a recorded run", "This is a replay of a recorded trace: no "
                         "model is loaded. Press space to step through it, b to step back.",
                         "timeline")
    sizes = [len(s.prompt) for s in frame.seqs]
    became = (f"The prompt became {sizes[0]} tokens" if len(sizes) == 1 else
              f"The {len(sizes)} prompts that arrive first became {', '.join(map(str, sizes))} tokens")
    body = (f"{intro} {became} (each colour in the Prompt panel is one token; press i to see "
            "their ids). The model only ever sees these ids. Nothing has run yet: press space to "
            "run the first engine step.")
    return Narration("Tokenize", body, "tokens")


def _preempted(trace: StepTrace) -> Narration:
    return Narration(
        "Preemption: the pool ran out of pages",
        "A running sequence needed a new page and none was free, so the newest running "
        f"sequence ({_names(trace.preempted)}) was preempted: its pages went back to the pool "
        "and it waits at the head of the queue. When pages free up it is admitted again and "
        "its tokens are recomputed (a prefill of prompt + output so far). Nothing it generated "
        "is lost.",
        "pages")


def _prefix_hit(trace: StepTrace, page_size: int) -> Narration:
    cached = sum(s.cached_tokens for s in trace.seqs if s.seq_id in trace.admitted)
    pages = len(trace.prefix_hit_pages)
    return Narration(
        "Prefix cache hit",
        f"The new prompt starts with the same tokens as an earlier one, so {pages} "
        f"full pages ({cached} tokens) were found by their hash and shared instead of recomputed. "
        "Only the rest of the prompt was prefilled: a much shorter step and a faster first token. "
        f"Shared pages are marked ×n in the page grid (each page holds {page_size} tokens).",
        "pages")


def _joined(frame: Frame, trace: StepTrace) -> Narration:
    back = [i for i in trace.admitted if (s := frame.seq(i)) is not None and s.preemptions]
    if back:
        return Narration(
            "Recompute after preemption",
            f"{_names(back)} was admitted again now that pages are free. Its old KV pages were "
            "given away, so its prompt and the tokens it had already generated are prefilled "
            "again in one step: preemption trades memory for recomputation.",
            "timeline")
    return Narration(
        "Continuous batching: a request joins mid-flight",
        f"{_names(trace.admitted)} was admitted while others were decoding. The engine "
        "does not wait for the batch to finish: this one step mixes its prefill with the "
        "others' decode tokens, so the hardware stays busy and nobody waits for stragglers.",
        "timeline")


def _first_prefill(trace: StepTrace, page_size: int) -> Narration:
    tokens = trace.prefill_tokens
    pages = len(trace.pages_allocated)
    prompts = len(_prefills(trace))
    whose = "prompt tokens" if prompts == 1 else f"tokens of {prompts} prompts"
    return Narration(
        "Prefill: the whole prompt in one step",
        f"All {tokens} {whose} went through the model together: every layer multiplied a "
        f"[{tokens} x hidden] matrix by its weights. Much arithmetic per weight read, so prefill "
        f"is compute-bound. Each token's keys and values were written to the KV cache, in "
        f"{pages} page{'s' if pages != 1 else ''} of {page_size} token slots (a page is the "
        "unit the pool hands out, so memory grows with the text, not with the longest possible "
        "context). The last position's logits gave the first new token.",
        "timeline")


def _chunked(trace: StepTrace) -> Narration:
    part = next(s for s in _prefills(trace) if s.start > s.cached_tokens or s.token_id is None)
    return Narration(
        "Chunked prefill",
        f"seq {part.seq_id} computed prompt positions {part.start}..{part.end - 1} only: the "
        "step's token budget is shared, so a long prompt is split across steps and running "
        "sequences keep decoding in between instead of stalling.",
        "timeline")


def _finished(trace: StepTrace) -> Narration:
    parts = [s for s in trace.seqs if s.finish_reason]
    why = {"length": "it reached max_tokens", "stop": "it produced an end token or stop string"}
    said = "; ".join(f"seq {s.seq_id} finished ({why.get(s.finish_reason, s.finish_reason)})"
                     for s in parts)
    whose = "Its" if len(parts) == 1 else "Their"
    return Narration(
        "Finished: pages go back to the pool",
        f"{said}. {whose} {len(trace.pages_freed)} pages were freed at once. Full pages keep their "
        "prefix hash (shown ○): they are free to reuse, yet a later prompt that starts with the "
        "same tokens can still hit them until they are evicted.",
        "pages")


def _new_page(trace: StepTrace, page_size: int) -> Narration:
    return Narration(
        "A new page",
        f"A sequence filled its last page ({page_size} slots), so the pool handed out page "
        f"{', '.join(map(str, trace.pages_allocated))}. Pages need not be next to each other: "
        "each sequence has a page table mapping position p to page table[p // page_size]. "
        "No memory is reserved up front, so many more sequences fit (paged attention).",
        "pages")


def _first_decode(trace: StepTrace) -> Narration:
    return Narration(
        "Decode: one token per step",
        "Each running sequence fed only its newest token. To produce the next one the model "
        "still reads all of its weights, plus the whole KV cache for attention: little "
        "arithmetic per byte read, so decode is memory-bound. Without the KV cache every step "
        "would recompute keys and values for the whole context, work growing with its square.",
        "next_token")


def _batched(trace: StepTrace) -> Narration:
    n = len(_decodes(trace))
    return Narration(
        "Batched decode",
        f"{n} sequences decoded in one forward pass. The weights were read from memory once "
        f"for all {n}, so while decode is memory-bound, batching multiplies tokens per second "
        "almost for free. This is why servers batch many users together.",
        "metrics")


def _decode(frame: Frame, trace: StepTrace) -> Narration:
    part = next(s for s in trace.seqs if s.token_id is not None)
    p = next((c.prob for c in part.candidates if c.token_id == part.token_id), None)
    chance = f" (p = {p:.2f})" if p is not None else ""
    text = frame.text(part.token_id) or part.token_text
    return Narration(
        f"Decode step {trace.step}",
        f"seq {part.seq_id} sampled {text!r}{chance}. The Next token panel shows the "
        "candidates; t/T, k/K and p/P change temperature, top-k and top-p and the preview column "
        "shows how the distribution would change. Attention (l/h: layer/head) shows which "
        "earlier tokens the newest one looked at.",
        "next_token")


def _speculative(frame: Frame, trace: StepTrace) -> Narration:
    part = next(p for p in trace.seqs if p.draft_tokens)
    k, kept, made = len(part.draft_tokens), part.accepted, len(emitted(part))
    if not _seen_before(frame, lambda t: any(p.draft_tokens for p in t.seqs)):
        return Narration(
            "Speculative decoding: draft, then verify",
            f"A cheap drafter guessed {k} tokens for seq {part.seq_id}. The model then ran once "
            f"over its newest token plus all {k} guesses: decode is memory-bound, so checking "
            f"{k + 1} positions costs about as much as one. {kept} guesses matched what the model "
            f"would pick, so this pass emitted {made} token{'s' if made != 1 else ''}. The text "
            "is exactly what the model alone would write.",
            "speculative")
    if kept == k:
        return Narration(
            "Every guess accepted, plus a bonus",
            f"All {k} guesses for seq {part.seq_id} were accepted, and the logits at the last "
            f"guess gave one more token for free: {made} tokens from one pass of the model.",
            "speculative")
    return Narration(
        f"Verify: {kept} of {k} guesses accepted",
        f"Guess {kept + 1} for seq {part.seq_id} was rejected: the model's own token replaced it, "
        "the guesses after it were dropped and their KV slots rolled back. Still "
        f"{made} token{'s' if made != 1 else ''} from one pass.",
        "speculative")


def _all_done(frame: Frame) -> Narration:
    return Narration(
        "All requests finished",
        "Every request is done and the pool is empty again. Press b to step back through the "
        "run, a to add a request, or n to start a new prompt.",
        "metrics")


PRECISION_NOTES = {
    "fp32": "32-bit floats as trained: no rounding at all",
    "int8": "each weight rounded to one of 256 steps of its output row's scale, a quarter of "
            "fp32's bytes",
    "int4": "each weight rounded to one of 16 steps of its group's scale (128 inputs per group), "
            "an eighth of fp32's bytes",
}


def precision_switched(precision: str, before: str) -> str:
    """The walkthrough's opening after m reloaded the model at another weight precision."""
    note = PRECISION_NOTES.get(precision.split("-")[0], precision)
    return (f"The model was reloaded with {precision} linear weights ({note}); before it ran "
            f"{before}. This is a new engine at the same prompt and seed, so the Next token "
            "panel's probabilities differ only by the rounding; the Quantization panel shows "
            "each weight's relative error.")


def narrate(frame: Frame, intro: str = "", page_size: int = DEFAULTS.page_size) -> Narration:
    """Explain the frame on screen, most instructive event first."""
    if frame.event == "start":
        return _start(frame, intro)
    if frame.event == "add":
        return Narration("A request joins the queue", f"{frame.note}. It waits until the next "
                         "step admits it into the running batch.", "tokens")
    if frame.event == "abort":
        return Narration("Aborted", f"{frame.note}; the next step carries on without it.", "pages")
    trace = frame.trace
    assert trace is not None
    if trace.preempted:
        return _preempted(trace)
    if trace.prefix_hit_pages:
        return _prefix_hit(trace, page_size)
    if trace.admitted and _decodes(trace):
        return _joined(frame, trace)
    if _prefills(trace) and not _seen_before(frame, _prefills):
        if any(s.token_id is None for s in _prefills(trace)):
            return _chunked(trace)
        return _first_prefill(trace, page_size)
    if any(s.token_id is None for s in _prefills(trace)):
        return _chunked(trace)
    if trace.finished:
        if not frame.unfinished:
            return _all_done(frame)
        return _finished(trace)
    if any(p.draft_tokens for p in trace.seqs):
        return _speculative(frame, trace)
    if _decodes(trace) and not _seen_before(frame, _decodes):
        return _first_decode(trace)
    if len(_decodes(trace)) > max([1] + [len(_decodes(t)) for t in frame.traces[:-1]]):
        return _batched(trace)  # the decode batch is bigger than ever before
    if trace.pages_allocated and _decodes(trace):
        return _new_page(trace, page_size)
    if any(s.token_id is not None for s in trace.seqs):
        return _decode(frame, trace)
    return Narration(f"Step {trace.step}", "Nothing was scheduled this step.", "timeline")
