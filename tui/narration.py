"""The guided walkthrough's words: what the frame on screen shows, and why the engine does it.

Each engine step is classified by the events its trace records, the most instructive first (a
preemption beats a recompute beats a prefix hit ... beats a plain decode). The first time a kind
of event happens the narration explains it in full; later ones get a line of this step's own
facts, so stepping on never repeats a paragraph the learner has read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tinyinfer.trace import SeqStep, StepTrace
from tui.drawing import visible
from tui.frames import Frame, emitted


@dataclass(frozen=True)
class Narration:
    """One explanation: a headline, a few sentences, and the panel it is about."""

    title: str
    body: str
    panel: str  # id of the panel to highlight


@dataclass(frozen=True)
class Story:
    """What a run is about, beyond its frames: the scenario's opening and the weights' precision."""

    intro: str = ""
    precision: str = ""  # "int8", "int4-g128", ... when the run is about quantization; else ""
    replay: bool = False  # a recorded run, no model


def _names(seq_ids: Iterable[int]) -> str:
    ids = list(seq_ids)
    said = [f"seq {i}" for i in ids]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


def _prefills(trace: StepTrace) -> list[SeqStep]:
    return [s for s in trace.seqs if s.kind == "prefill"]


def _decodes(trace: StepTrace) -> list[SeqStep]:
    return [s for s in trace.seqs if s.kind == "decode"]


def _is_chunk(part: SeqStep, trace: StepTrace) -> bool:
    """Whether a prefill part is one chunk of a longer prompt: not its end, or not its start."""
    return part.token_id is None or (part.start > part.cached_tokens and part.seq_id not in trace.admitted)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _token(frame: Frame, token_id: int, fallback: str = "") -> str:
    return repr(visible(frame.text(token_id) or fallback or f"#{token_id}"))


# ---------------------------------------------------------------------- what happened


def kinds(traces: tuple[StepTrace, ...]) -> list[str]:
    """The headline event of every step, in one pass over the run (each step sees only the
    steps before it): preempt, recompute, prefix-hit, join, chunked, first-prefill, all-done,
    finished, speculative, all-accepted, rejected, first-decode, batched, reused, new-page,
    decode or idle."""
    out: list[str] = []
    preempted: set[int] = set()
    held: dict[int, set[int]] = {}  # page -> sequences that have held it
    prefilled = decoded = False
    widest = 1
    for trace in traces:
        prefills, decodes = _prefills(trace), _decodes(trace)
        drafted = [p for p in trace.seqs if p.draft_tokens]
        if trace.preempted:
            kind = "preempt"
        elif set(trace.admitted) & preempted:
            kind = "recompute"
        elif trace.prefix_hit_pages:
            kind = "prefix-hit"
        elif trace.admitted and decodes:
            kind = "join"
        elif any(_is_chunk(p, trace) for p in prefills):
            kind = "chunked"
        elif prefills and not prefilled:
            kind = "first-prefill"
        elif trace.finished and not trace.num_running and not trace.num_waiting:
            kind = "all-done"
        elif trace.finished:
            kind = "finished"
        elif drafted:
            first = not any(k in ("speculative", "all-accepted", "rejected") for k in out)
            kind = ("speculative" if first else "all-accepted"
                    if all(p.accepted == len(p.draft_tokens) for p in drafted) else "rejected")
        elif decodes and not decoded:
            kind = "first-decode"
        elif len(decodes) > widest:
            kind = "batched"
        elif decodes and any(held.get(p, set()) - _owners(trace, p) for p in trace.pages_allocated):
            kind = "reused"
        elif trace.pages_allocated and decodes:
            kind = "new-page"
        elif any(p.token_id is not None for p in trace.seqs):
            kind = "decode"
        else:
            kind = "idle"
        out.append(kind)
        preempted |= set(trace.preempted)
        prefilled |= bool(prefills)
        decoded |= bool(decodes)
        widest = max(widest, len(decodes))
        if trace.pool is not None:
            for page, owners in enumerate(trace.pool.owners):
                held.setdefault(page, set()).update(owners)
    return out


def _owners(trace: StepTrace, page: int) -> set[int]:
    return set(trace.pool.owners[page]) if trace.pool is not None else set()


def _held_before(traces: tuple[StepTrace, ...], page: int) -> int | None:
    """The last sequence other than the page's owner now that held a page, in earlier steps."""
    now = _owners(traces[-1], page)
    for trace in reversed(traces[:-1]):
        before = _owners(trace, page) - now
        if before:
            return min(before)
    return None


def _pages(pages: Iterable[int]) -> str:
    said = [str(p) for p in pages]
    return ("page " + said[0]) if len(said) == 1 else "pages " + ", ".join(said[:-1]) + " and " + said[-1]


# ---------------------------------------------------------------------- the words


def _start(frame: Frame, story: Story) -> Narration:
    replay = ("This is a replay of a recorded trace: no model is loaded. Press space to step "
              "through it, b to step back.")
    if story.replay and not frame.seqs:
        return Narration("Replay of a recorded run", replay, "timeline")
    sizes = [len(s.prompt) or s.prompt_len or 0 for s in frame.seqs]
    became = (f"The prompt became {sizes[0]} tokens" if len(sizes) == 1 else
              f"The {len(sizes)} prompts that arrive first became {', '.join(map(str, sizes))} tokens")
    body = (f"{story.intro} {became} (each colour in the Prompt panel is one token; press i to see "
            "their ids). The model only ever sees these ids. Nothing has run yet: press space to "
            "run the first engine step.").lstrip()
    if story.replay:
        return Narration("Replay of a recorded run", f"{replay} {body}", "tokens")
    return Narration("Tokenize", body, "tokens")


def _preempted(frame: Frame, trace: StepTrace, again: bool) -> Narration:
    victims = _names(trace.preempted)
    if again:
        return Narration(f"Preempted again: {victims}",
                         f"The pool was out of pages once more, so {victims} gave its pages back "
                         "and waits to be recomputed.", "pages")
    return Narration(
        "Preemption: the pool ran out of pages",
        "A running sequence needed a new page and none was free, so the newest running "
        f"sequence ({victims}) was preempted: its pages went back to the pool and it waits at the "
        "head of the queue. When pages free up it is admitted again and its tokens are recomputed "
        "(a prefill of prompt + output so far). Nothing it generated is lost.",
        "pages")


def _recomputed(frame: Frame, trace: StepTrace, again: bool) -> Narration:
    back = [p for p in _prefills(trace) if p.seq_id in trace.admitted
            and (s := frame.seq(p.seq_id)) is not None and s.preemptions]
    ids = [p.seq_id for p in back]
    positions = sum(p.end - p.start for p in back)
    each = ", ".join(f"{p.end - p.start}" for p in back)
    parts = []
    for p in back:
        seq = frame.seq(p.seq_id)
        prompt = seq.prompt_len or 0
        parts.append(f"{prompt} prompt + {max(0, p.end - prompt)} generated")
    said = "; ".join(f"{_names([i])}: {part}" for i, part in zip(ids, parts))
    if again:
        return Narration(f"Recompute: {_names(ids)}",
                         f"{_names(ids)} came back after preemption: {positions} positions "
                         f"({said}) prefilled again in this step.", "timeline")
    whose = "Its" if len(ids) == 1 else "Their"
    return Narration(
        "Recompute after preemption",
        f"{_names(ids)} {'was' if len(ids) == 1 else 'were'} admitted again now that pages are "
        f"free. {whose} old KV pages were given away, so everything {'it' if len(ids) == 1 else 'they'}"
        f" had computed — {said} — is prefilled again, {positions} positions ({each}) in this one "
        "step: the Timeline shows a prefill-sized bar in the middle of decoding. Preemption trades "
        "memory for recomputation; the text generated so far is kept.",
        "timeline")


def _prefix_hit(trace: StepTrace, page_size: int, again: bool) -> Narration:
    cached = sum(s.cached_tokens for s in trace.seqs if s.seq_id in trace.admitted)
    pages = len(trace.prefix_hit_pages)
    who = _names(s.seq_id for s in trace.seqs if s.seq_id in trace.admitted and s.cached_tokens)
    if again:
        return Narration("Prefix cache hit again",
                         f"{who} found {_plural(pages, 'page')} ({cached} tokens) of its prompt "
                         "cached and prefilled only the rest.", "pages")
    return Narration(
        "Prefix cache hit",
        f"The new prompt starts with the same tokens as an earlier one, so {pages} "
        f"full pages ({cached} tokens) were found by their hash and shared instead of recomputed. "
        "Only the rest of the prompt was prefilled: a much shorter step and a faster first token. "
        f"Shared pages are marked ×n in the page grid (each page holds {page_size} tokens).",
        "pages")


def _joined(trace: StepTrace, again: bool) -> Narration:
    joined = [p for p in _prefills(trace) if p.seq_id in trace.admitted]
    if again:
        parts = ", ".join(f"{_names([p.seq_id])} prefilled {p.start}..{p.end - 1}" for p in joined)
        return Narration("Another request joins mid-flight",
                         f"{parts}, in the same step as {_plural(len(_decodes(trace)), 'decode')} "
                         "of the running sequences.", "timeline")
    cut = [p for p in joined if p.token_id is None]
    chunked = (f" Only positions {cut[0].start}..{cut[0].end - 1} fit this step's token budget: the "
               "rest of the prompt comes in the next steps (chunked prefill)." if cut else "")
    return Narration(
        "Continuous batching: a request joins mid-flight",
        f"{_names(trace.admitted)} was admitted while others were decoding. The engine "
        "does not wait for the batch to finish: this one step mixes its prefill with the "
        "others' decode tokens (the Timeline row lists both), so the hardware stays busy and "
        f"nobody waits for stragglers.{chunked}",
        "timeline")


def _first_prefill(trace: StepTrace, page_size: int, story: Story) -> Narration:
    tokens = trace.prefill_tokens
    pages = len(trace.pages_allocated)
    prompts = len(_prefills(trace))
    whose = "prompt tokens" if prompts == 1 else f"tokens of {prompts} prompts"
    weights = f"its {story.precision} weights" if story.precision.startswith("int") else "its weights"
    return Narration(
        "Prefill: the whole prompt in one step",
        f"All {tokens} {whose} went through the model together: every layer multiplied a "
        f"[{tokens} x hidden] matrix by {weights}. Much arithmetic per weight read, so "
        f"prefill is compute-bound. Each token's keys and values were written to the KV cache, in "
        f"{_plural(pages, 'page')} of {page_size} token slots (a page is the unit the pool hands "
        "out, so memory grows with the text, not with the longest possible context). The last "
        "position's logits gave the first new token.",
        "timeline")


def _chunked(trace: StepTrace, again: bool) -> Narration:
    part = next(s for s in _prefills(trace) if _is_chunk(s, trace))
    if again:
        return Narration("Chunked prefill, continued",
                         f"seq {part.seq_id} computed prompt positions {part.start}..{part.end - 1}.",
                         "timeline")
    return Narration(
        "Chunked prefill",
        f"seq {part.seq_id} computed prompt positions {part.start}..{part.end - 1} only: the "
        "step's token budget is shared, so a long prompt is split across steps and running "
        "sequences keep decoding in between instead of stalling.",
        "timeline")


def _finished(trace: StepTrace, again: bool) -> Narration:
    parts = [s for s in trace.seqs if s.finish_reason]
    why = {"length": "it reached max_tokens", "stop": "it produced an end token or stop string"}
    said = "; ".join(f"seq {s.seq_id} finished ({why.get(s.finish_reason, s.finish_reason)})"
                     for s in parts)
    freed = len(trace.pages_freed)
    if again:
        return Narration("Finished: pages go back", f"{said}: {_plural(freed, 'page')} freed.", "pages")
    whose = "Its" if len(parts) == 1 else "Their"
    return Narration(
        "Finished: pages go back to the pool",
        f"{said}. {whose} {freed} pages were freed at once. Full pages keep their "
        "prefix hash (shown ○): they are free to reuse, yet a later prompt that starts with the "
        "same tokens can still hit them until they are evicted.",
        "pages")


def _reused(frame: Frame, trace: StepTrace, again: bool) -> Narration:
    reused = [(p, _held_before(frame.traces, p)) for p in trace.pages_allocated]
    reused = [(p, who) for p, who in reused if who is not None]
    owner = _names(sorted(set().union(*(_owners(trace, p) for p, _ in reused))))
    said = ", ".join(f"page {p} (seq {who}'s before)" for p, who in reused)
    if again:
        return Narration("A freed page, reused", f"{owner} now writes into {said}.", "pages")
    return Narration(
        "A freed page is reused",
        f"{owner} got {said}: a page that held another sequence's K/V until that sequence "
        "finished or was preempted. Freed pages are plain free pages: the new owner "
        "overwrites their slots, and its page table simply lists them. That is why the same page "
        "number shows up in two sequences' tables at different times.",
        "pages")


def _new_page(trace: StepTrace, page_size: int, again: bool) -> Narration:
    pages = _pages(trace.pages_allocated)
    whose = _names(sorted({o for p in trace.pages_allocated if trace.pool
                           for o in trace.pool.owners[p]})) if trace.pool else "A sequence"
    if again:
        return Narration("A new page", f"{whose} filled its last page: {pages} handed out.", "pages")
    return Narration(
        "A new page",
        f"A sequence filled its last page ({page_size} slots), so the pool handed out "
        f"{pages}. Pages need not be next to each other: "
        "each sequence has a page table mapping position p to page table[p // page_size]. "
        "No memory is reserved up front, so many more sequences fit (paged attention).",
        "pages")


def _first_decode(story: Story) -> Narration:
    body = ("Each running sequence fed only its newest token. To produce the next one the model "
            "still reads all of its weights, plus the whole KV cache for attention: little "
            "arithmetic per byte read, so decode is memory-bound. Without the KV cache every step "
            "would recompute keys and values for the whole context, work growing with its square.")
    if story.precision.startswith("int"):
        return Narration(
            f"Decode on {story.precision} weights",
            "Each running sequence fed only its newest token, and the model read all of its "
            "weights plus the KV cache to make the next one: little arithmetic per byte, so decode "
            f"is memory-bound, and {story.precision} weights mean fewer bytes per step. The "
            "Quantization panel shows how far rounding moved each weight; c compares fp32, int8 "
            "and int4 on this prompt side by side.",
            "quantization")
    return Narration("Decode: one token per step", body, "next_token")


def _batched(trace: StepTrace, again: bool) -> Narration:
    n = len(_decodes(trace))
    if again:
        return Narration("Batched decode", f"{n} sequences now decode together in one pass, the "
                         "most so far: still one read of the weights per step.", "metrics")
    return Narration(
        "Batched decode",
        f"{n} sequences decoded in one forward pass. The weights were read from memory once "
        f"for all {n}, so while decode is memory-bound, batching multiplies tokens per second "
        "almost for free. This is why servers batch many users together.",
        "metrics")


def _decode(frame: Frame, trace: StepTrace, page_size: int, story: Story, seen: int) -> Narration:
    """A plain decode step, after the first: this step's own facts in a line or two."""
    sampled = [p for p in trace.seqs if p.token_id is not None]
    part = sampled[0]
    p = part.token_prob
    chance = "" if p is None else f" (p = {p:.2f})" if p >= 0.005 else " (p < 0.01)"
    fill = (part.end - 1) % page_size + 1
    said = (f"seq {part.seq_id} sampled {_token(frame, part.token_id, part.token_text)}{chance} for "
            f"position {part.end}; its KV cache now holds {part.end} tokens, {fill} of {page_size} "
            "on its last page")
    if len(sampled) > 1:
        said = (f"{len(sampled)} sequences each sampled one token in one pass: "
                + ", ".join(f"seq {p.seq_id} {_token(frame, p.token_id, p.token_text)}" for p in sampled))
    weights = f" ({story.precision} weights)" if story.precision else ""
    hint = ("" if seen > 1 else " t/T, k/K, p/P change the Next token panel's preview; l/h pick "
            "the attention layer and head.")
    return Narration(f"Decode step {trace.step}{weights}", said + "." + hint, "next_token")


def _speculative(frame: Frame, trace: StepTrace, kind: str) -> Narration:
    part = next(p for p in trace.seqs if p.draft_tokens)
    k, kept, made = len(part.draft_tokens), part.accepted, len(emitted(part))
    if kind == "speculative":
        return Narration(
            "Speculative decoding: draft, then verify",
            f"A drafter guessed {k} tokens for seq {part.seq_id}. The model ran once over its newest "
            f"token plus all {k} guesses, like a small prefill, and kept the {kept} that match its own "
            f"picks, plus one token of its own: {made} token{'s' if made != 1 else ''} from one "
            f"target pass. On a memory-bound GPU checking {k + 1} positions costs about as much as "
            "one; on a CPU it costs more, so the saving is in target passes (c compares). The text "
            "is exactly the model's own.",
            "speculative")
    if kind == "all-accepted":
        return Narration(
            "Every guess accepted, plus a bonus",
            f"All {k} guesses for seq {part.seq_id} were accepted, and the logits at the last "
            f"guess gave one more token for free: {made} tokens from one pass of the model.",
            "speculative")
    guess = _token(frame, part.draft_tokens[kept])
    mine = _token(frame, emitted(part)[-1])
    return Narration(
        f"Verify: {kept} of {k} guesses accepted",
        f"Guess {kept + 1} for seq {part.seq_id}, {guess}, is not what the model picks there: it "
        f"takes {mine} instead (✗ then →)"
        + (f", drops the {k - kept - 1} guess{'es' if k - kept > 2 else ''} after it and rolls back "
           "their KV slots" if k - kept > 1 else "") + f". {made} token{'s' if made != 1 else ''} from this pass"
        + (", as many as a plain decode step." if made == 1 else "."),
        "speculative")


def _all_done() -> Narration:
    return Narration(
        "All requests finished",
        "Every request is done and the pool is empty again. Press b to step back through the "
        "run, a to add a request, n to start a new prompt, or c to compare this run with another "
        "setting side by side.",
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
            "each weight's relative error on the same scale as before.")


def speculation_switched(on: bool, drafter: str) -> str:
    """The walkthrough's opening after d switched speculative decoding."""
    if on:
        return (f"Speculative decoding is on ({drafter}): each step, the drafter guesses a few "
                "tokens and the model checks them all in one pass. Compare the step count with the "
                "run before.")
    return ("Speculative decoding is off: the same prompt now decodes one token per target pass. "
            "Count the steps and compare (c shows both runs side by side).")


def narrate(frame: Frame, story: Story = Story()) -> Narration:
    """Explain the frame on screen: its step's headline event, in full the first time."""
    if frame.event == "start":
        return _start(frame, story)
    if frame.event == "add":
        return Narration("A request joins the queue", f"{frame.note}. It waits until the next "
                         "step admits it into the running batch.", "tokens")
    if frame.event == "abort":
        return Narration("Aborted", f"{frame.note}; the next step carries on without it.", "pages")
    trace = frame.trace
    assert trace is not None
    page_size = frame.pool.page_size if frame.pool else 16
    every = kinds(frame.traces)
    kind = every[-1]
    again = kind in every[:-1]
    if kind == "preempt":
        return _preempted(frame, trace, again)
    if kind == "recompute":
        return _recomputed(frame, trace, again)
    if kind == "prefix-hit":
        return _prefix_hit(trace, page_size, again)
    if kind == "join":
        return _joined(trace, again)
    if kind == "chunked":
        return _chunked(trace, again)
    if kind == "first-prefill":
        return _first_prefill(trace, page_size, story)
    if kind == "all-done":
        return _all_done()
    if kind == "finished":
        return _finished(trace, again)
    if kind in ("speculative", "all-accepted", "rejected"):
        return _speculative(frame, trace, kind)
    if kind == "first-decode":
        return _first_decode(story)
    if kind == "batched":
        return _batched(trace, again)
    if kind == "reused":
        return _reused(frame, trace, again)
    if kind == "new-page":
        return _new_page(trace, page_size, again)
    if kind == "decode":
        return _decode(frame, trace, page_size, story, every.count("decode"))
    return Narration(f"Step {trace.step}", "Nothing was scheduled this step.", "timeline")
