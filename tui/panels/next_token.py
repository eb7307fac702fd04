"""Next token: the candidates with probability bars, the sampled one marked, and a live preview.

The "sampled" column is what the engine used (that request's own temperature / top-k / top-p).
The "preview" column re-applies the settings chosen now (t/T, k/K, p/P) to the step's raw top
logits, so a learner sees what those knobs do to the same distribution.
"""

from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.reactive import reactive

from tinyinfer import SamplingParams
from tinyinfer.sampling import probs_from_logits
from tinyinfer.trace import SeqStep

from tui.frames import Frame
from tui.palette import seq_color
from tui.panels.base import Panel
from tui.panels.tokens import visible

TOKEN_WIDTH = 10


def preview_probs(part: SeqStep, params: SamplingParams) -> dict[int, float]:
    """Probabilities the given settings would give, over the step's recorded top logits."""
    if not part.top_logits:
        return {}
    ids = [t for t, _ in part.top_logits]
    probs = probs_from_logits(np.array([x for _, x in part.top_logits]), params)
    return dict(zip(ids, probs.tolist()))


def settings(params: SamplingParams) -> str:
    """Sampling settings in a few characters."""
    return f"T={params.temperature:.1f} top-k={params.top_k or 'off'} top-p={params.top_p:.2f}"


def bar(p: float | None, width: int) -> Text:
    """A probability and a bar of `width` cells: `cut` if filtered out, `·` if not recorded."""
    if p is None or p == 0:
        return Text(f"{'  ·' if p is None else ' cut':<{width + 4}}", style="dim")
    full = round(p * width)
    return Text.assemble((f"{p:.2f}"[1:] if p < 1 else "1.0", ""), " ",
                         ("█" * full, "#61afef"), " " * (width - full))


class NextTokenPanel(Panel):
    """Top candidates of the followed sequence's latest sampled step, engine and preview side by side."""

    PANEL_ID = "next_token"
    TITLE = "Next token"
    SWAPPABLE = True
    BINDS = ("frame", "focus_seq", "sampling")

    focus_seq: reactive[int | None] = reactive(None)
    sampling: reactive[SamplingParams] = reactive(SamplingParams())

    def rows(self, frame: Frame, part: SeqStep, n: int) -> list[int]:
        """The n most likely token ids by raw logit (else by engine probability), sampled one kept."""
        ranked = [t for t, _ in part.top_logits] or [c.token_id for c in part.candidates]
        chosen = ranked[:n]
        if part.token_id not in chosen:
            chosen = chosen[: n - 1] + [part.token_id]
        return chosen

    def render(self) -> Text:
        frame = self.frame
        seq = frame.focus(self.focus_seq) if frame else None
        part = seq.last_sample if seq else None
        if frame is None or seq is None or part is None:
            return Text("No token sampled yet: the first one comes out of the prefill step.",
                        style="dim")
        width = self.content_size.width
        bar_width = max(3, (width - TOKEN_WIDTH - 12) // 2)
        engine = {c.token_id: c.prob for c in part.candidates}
        preview = preview_probs(part, self.sampling)
        step = next(t.step for t in reversed(frame.traces) if any(p is part for p in t.seqs))
        out = Text.assemble((f"{seq.label}", f"bold {seq_color(seq.seq_id)}"), f" at step {step} sampled "
                            f"{visible(frame.text(part.token_id) or part.token_text)!r}")
        out.append(f"\n  {'token':<{TOKEN_WIDTH}}{'sampled':<{bar_width + 5}}preview", "dim")
        for token_id in self.rows(frame, part, max(1, self.content_size.height - 3)):
            text = frame.text(token_id)
            name = repr(visible(text))[:TOKEN_WIDTH - 1] if text is not None else f"#{token_id}"
            mark = ("▶ ", "bold") if token_id == part.token_id else ("  ", "")
            out.append("\n")
            out.append(*mark)
            out.append(f"{name:<{TOKEN_WIDTH}}", "bold" if token_id == part.token_id else "")
            out.append_text(bar(engine.get(token_id), bar_width))
            out.append(" ")
            out.append_text(bar(preview.get(token_id), bar_width) if preview else
                            Text("needs detail=full", style="dim"))
        out.append(f"\npreview {settings(self.sampling)}", "italic")
        return out
