"""Speculative: each verify step's guesses, accepted ✓ or rejected ✗, and the running acceptance."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.trace import SeqStep

from tui.frames import Frame, emitted
from tui.palette import seq_color
from tui.panels.base import Panel
from tui.panels.tokens import visible


def totals(frame: Frame) -> tuple[int, int, int, int]:
    """(verify passes, guesses, accepted, tokens emitted by those passes) over the whole run."""
    parts = [p for t in frame.traces for p in t.seqs if p.draft_tokens]
    return (len(parts), sum(len(p.draft_tokens) for p in parts), sum(p.accepted for p in parts),
            sum(len(emitted(p)) for p in parts))


class SpeculativePanel(Panel):
    """Guesses of the followed sequence, marked; the last token is the bonus or the replacement."""

    PANEL_ID = "speculative"
    TITLE = "Speculative decoding"
    SWAPPABLE = True
    FEATURE = "speculative"
    BINDS = ("frame", "focus_seq", "drafter")

    focus_seq: reactive[int | None] = reactive(None)
    drafter: reactive[str] = reactive("")

    def row(self, frame: Frame, part: SeqStep) -> Text:
        def name(token_id: int) -> str:
            return repr(visible(frame.text(token_id) or f"#{token_id}"))

        row = Text(f"@{part.start:<4}", style="dim")
        for i, token_id in enumerate(part.draft_tokens):
            if i < part.accepted:
                row.append(f"✓{name(token_id)} ", "green")
            elif i == part.accepted:
                row.append(f"✗{name(token_id)} ", "red strike")
            else:
                row.append(f"·{name(token_id)} ", "dim strike")
        last = emitted(part)[-1]
        bonus = part.accepted == len(part.draft_tokens)
        row.append(("+" if bonus else "→") + name(last), "bold" if bonus else "yellow")
        return row

    def render(self) -> Text:
        frame = self.frame
        if frame is None:
            return Text("")
        passes, guessed, kept, made = totals(frame)
        out = Text(f"drafter: {self.drafter or 'not recorded'}", style="dim")
        if passes:
            out.append(f"\naccepted {kept}/{guessed} ({100 * kept / guessed:.0f}%) · "
                       f"{made / passes:.1f} tokens per pass")
        seq = frame.focus(self.focus_seq)
        rows = [p for p in (seq.samples if seq else ()) if p.draft_tokens]
        if seq is None or not rows:
            out.append("\nNo draft verified yet: drafting starts once a sequence decodes.", "dim")
            return out
        out.append("\n")
        out.append(seq.label, f"bold {seq_color(seq.seq_id)}")
        out.append("  ✓ accepted  ✗ rejected  + bonus  → replacement", "dim")
        for part in rows[-max(1, self.content_size.height - 3):]:
            out.append("\n")
            out.append_text(self.row(frame, part))
        return out
