"""Next token: the candidates with probability bars, the sampled one marked, and a live preview.

The "sampled" column is what the engine used (that request's own temperature / top-k / top-p),
as the trace recorded it. The "preview" column re-applies the settings chosen now (t/T, k/K,
p/P, min-p in the s dialog) to the step's raw top logits, so a learner sees what those knobs do
to the same distribution.
"""

from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.reactive import reactive

from tinyinfer import SamplingParams
from tinyinfer.trace import SeqStep

from tui.drawing import visible
from tui.frames import Frame
from tui.palette import seq_color
from tui.panels.base import Panel, sentence

TOKEN_WIDTH = 10


def preview_probs(part: SeqStep, params: SamplingParams) -> dict[int, float]:
    """Probabilities the given settings would give the step's recorded top logits, in the
    sampler's order (temperature, top-k, top-p, min-p: tinyinfer.sampling.probs_from_logits).

    The rest of the vocabulary enters as one remainder, Σ exp(logit / T) as the trace summed it
    at T = 0.1 ... 2.0 (in between: interpolated), so normalising and top-p see the whole
    vocabulary; over the top logits alone they would inflate them and cut tokens the engine kept.
    Exact at those temperatures unless the nucleus or min-p ends among the unrecorded tokens
    (then within one such token's probability).
    """
    if not part.top_logits:
        return {}
    ids = [t for t, _ in part.top_logits]  # best first
    x = np.array([v for _, v in part.top_logits], dtype=np.float64)
    if params.greedy:
        return {t: float(i == 0) for i, t in enumerate(ids)}
    t = params.temperature
    w = np.exp((x - x[0]) / t)
    rest = float(np.exp(rest_logsumexp(part, t) - x[0] / t)) if part.rest_logsumexp else 0.0
    if 0 < params.top_k < len(w):
        w[params.top_k:], rest = 0.0, 0.0
    if params.top_p < 1.0:
        cumulative = np.cumsum(w) / (w.sum() + rest)
        if cumulative[-1] >= params.top_p:  # the nucleus ends among the recorded tokens
            w[int(np.searchsorted(cumulative, params.top_p, side="left")) + 1:], rest = 0.0, 0.0
        else:  # it ends in the rest, once top_p of the mass is in: that is what it normalises by
            rest = params.top_p * (w.sum() + rest) - w.sum()
    if params.min_p > 0.0:
        cut = w < params.min_p * w[0]
        w[cut] = 0.0
        rest = 0.0 if cut.any() else rest  # every remaining token is below the recorded ones
    return dict(zip(ids, (w / (w.sum() + rest)).tolist()))


def rest_logsumexp(part: SeqStep, temperature: float) -> float:
    """log Σ exp(logit / T) over the logits outside the top ones, at the trace's nearest
    temperatures (linear in 1/T between them, where log-sum-exp is convex and smooth)."""
    ts = np.array([t for t, _ in part.rest_logsumexp])
    values = np.array([v for _, v in part.rest_logsumexp])
    return float(np.interp(1.0 / temperature, 1.0 / ts[::-1], values[::-1]))


def settings(params: SamplingParams) -> str:
    """Sampling settings in a few characters."""
    said = f"T={params.temperature:.1f} top-k={params.top_k or 'off'} top-p={params.top_p:.2f}"
    return said + (f" min-p={params.min_p:.2f}" if params.min_p else "")


def bar(p: float | None, width: int) -> Text:
    """A probability and a bar of `width` cells: `cut` if filtered out, `·` if not recorded."""
    if p is None or p == 0:
        return Text(f"{'   ·' if p is None else ' cut':<{width + 5}}", style="dim")
    full = round(p * width)
    said = "1.0" if p >= 0.995 else "<.01" if p < 0.005 else f"{p:.2f}"[1:]
    return Text.assemble((f"{said:>4}", ""), " ", ("█" * full, "#61afef"), " " * (width - full))


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
            return sentence("No token sampled yet: the first one comes out of the prefill step.",
                            self.content_size.width)
        width = self.content_size.width
        bar_width = max(3, (width - TOKEN_WIDTH - 14) // 2)
        engine = {c.token_id: c.prob for c in part.candidates}
        if part.token_prob is not None:  # the sampled token's own chance, even outside the top few
            engine[part.token_id] = part.token_prob
        preview = preview_probs(part, self.sampling)
        step = next(t.step for t in reversed(frame.traces) if any(p is part for p in t.seqs))
        out = Text.assemble((f"{seq.label}", f"bold {seq_color(seq.seq_id)}"), f" at step {step} sampled "
                            f"{visible(frame.text(part.token_id) or part.token_text)!r}")
        out.append(f"\n  {'token':<{TOKEN_WIDTH}}{'sampled':<{bar_width + 6}}preview", "dim")
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
