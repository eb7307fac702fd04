"""Attention: where each new token looked, for one layer and head, as a heatmap over the context.

Every step records the attention weights of a sequence's newest query over all earlier
positions (reference runner, detail="full"). Stacking those rows step by step draws the
causal triangle: row = the query's position, column = the key's position.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.reactive import reactive

from tui.drawing import visible
from tui.frames import SeqView
from tui.palette import seq_color
from tui.panels.base import Panel, pack, sentence

SHADES = " ░▒▓█"


def binned(weights: tuple[float, ...], bin_size: int) -> list[float]:
    """Attention mass per group of bin_size neighbouring positions."""
    return [sum(weights[i:i + bin_size]) for i in range(0, len(weights), bin_size)]


def token_at(seq: SeqView, position: int) -> str | None:
    """The text of the token at a position of a sequence, if the frame knows it."""
    if seq.prompt and position < len(seq.prompt):
        return seq.prompt[position].text
    offset = position - (seq.prompt_len or 0)
    return seq.output[offset].text if 0 <= offset < len(seq.output) else None


class AttentionPanel(Panel):
    """Heatmap of one layer and head for the followed sequence; l/L and h/H choose."""

    PANEL_ID = "attention"
    TITLE = "Attention"
    SWAPPABLE = True
    BINDS = ("frame", "focus_seq", "layer_index", "head_index", "runner")

    focus_seq: reactive[int | None] = reactive(None)
    layer_index: reactive[int] = reactive(0)
    head_index: reactive[int] = reactive(0)
    runner: reactive[str] = reactive("numpy")

    def unavailable(self) -> Text:
        if self.runner == "replay":
            why = "This trace holds no attention weights (record with --runner numpy)."
        elif self.runner != "numpy":
            why = (f"Attention weights are recorded by the reference runner only; this run uses "
                   f"the {self.runner} runner. Start with --runner numpy to see them.")
        else:
            why = "No attention recorded for this sequence yet."
        return sentence(why, self.content_size.width)

    def render(self) -> Text:
        frame = self.frame
        seq = frame.focus(self.focus_seq) if frame else None
        rows = [p for p in (seq.samples if seq else ()) if p.attention]
        if seq is None or not seq.samples:
            return sentence("No token sampled yet: the first attention row comes with prefill.",
                            self.content_size.width)
        if not rows:
            return self.unavailable()
        n_layers, n_heads = len(rows[-1].attention), len(rows[-1].attention[0])
        layer, head = self.layer_index % n_layers, self.head_index % n_heads
        last = rows[-1]
        width = max(8, self.content_size.width)
        bin_size = max(1, math.ceil(last.end / max(4, width - 5)))
        header = [Text(seq.label, f"bold {seq_color(seq.seq_id)}"),
                  Text(f"layer {layer + 1}/{n_layers}"), Text(f"head {head + 1}/{n_heads}"),
                  Text(f"query @{last.end - 1}", "dim")]
        if bin_size > 1:  # on the header, where it cannot be cut off
            header.append(Text(f"{bin_size} pos/col", "bold"))
        weights = last.attention[layer][head]
        top = sorted(range(len(weights)), key=lambda i: -weights[i])[:3]
        most = pack([Text("most:", "italic")] + [
            Text(f"{visible(token_at(seq, i) or '?')!r}@{i} {weights[i]:.2f}", "italic") for i in top],
            width, 6)
        lines = pack(header, width, 2)
        height = max(1, self.content_size.height - len(lines) - len(most))
        for part in rows[-height:]:
            mass = binned(part.attention[layer][head], bin_size)
            peak = max(mass) or 1.0
            cells = "".join(SHADES[min(4, math.ceil(4 * m / peak))] for m in mass)
            lines.append(Text.assemble((f"{part.end - 1:>4} ", "dim"), (cells, "#c678dd")))
        return Text("\n").join(lines + most)
