"""Speculative: each verify step's guesses, accepted ✓ or rejected ✗, and the running acceptance."""

from __future__ import annotations

import textwrap

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.trace import SeqStep

from tui.drawing import visible
from tui.frames import Frame, emitted
from tui.palette import seq_color
from tui.panels.base import Panel, pack


def totals(frame: Frame) -> tuple[int, int, int, int]:
    """(verify passes, guesses, accepted, tokens emitted by those passes) over the whole run."""
    parts = [p for t in frame.traces for p in t.seqs if p.draft_tokens]
    return (len(parts), sum(len(p.draft_tokens) for p in parts), sum(p.accepted for p in parts),
            sum(len(emitted(p)) for p in parts))


class SpeculativePanel(Panel):
    """Guesses of the followed sequence, marked; after them the bonus or the model's replacement."""

    PANEL_ID = "speculative"
    TITLE = "Speculative decoding"
    SWAPPABLE = True
    FEATURE = "speculative"
    BINDS = ("frame", "focus_seq", "drafter")

    focus_seq: reactive[int | None] = reactive(None)
    drafter: reactive[str] = reactive("")

    def row(self, frame: Frame, part: SeqStep, width: int) -> list[Text]:
        """A verify step: kept guesses, the rejected one and the model's replacement (or the
        bonus), then the dropped guesses, which give way first when the line is short."""
        def name(token_id: int) -> str:
            return repr(visible(frame.text(token_id) or f"#{token_id}"))

        kept = part.accepted
        cells = [Text(f"@{part.start:<4}", style="dim")]
        cells += [Text(f"✓{name(t)}", "green") for t in part.draft_tokens[:kept]]
        last = emitted(part)[-1]
        if kept == len(part.draft_tokens):
            cells.append(Text(f"+{name(last)}", "bold"))
        else:
            cells.append(Text.assemble((f"✗{name(part.draft_tokens[kept])}", "red strike"),
                                       (f"→{name(last)}", "bold yellow")))
        lines = pack(cells, width, 5)
        dropped = [Text(f"·{name(t)}", "dim strike") for t in part.draft_tokens[kept + 1:]]
        for i, cell in enumerate(dropped):
            room = width - lines[-1].cell_len - 1
            if cell.cell_len > room or (i < len(dropped) - 1 and cell.cell_len + 2 > room):
                lines[-1].append(" …", "dim")
                break
            lines[-1].append(" ")
            lines[-1].append_text(cell)
        return lines

    def render(self) -> Text:
        frame = self.frame
        if frame is None:
            return Text("")
        width = max(20, self.content_size.width)
        passes, guessed, kept, made = totals(frame)
        seq = frame.focus(self.focus_seq)
        rows = [p for p in (seq.samples if seq else ()) if p.draft_tokens]
        drafter = Text(f"drafter: {self.drafter or 'not recorded'}", style="dim")
        if seq is None or not rows:
            # wrapped to the panel here: its lines are not wrapped for it (they are drawn cell by cell)
            note = textwrap.wrap("No draft verified yet: drafting starts once a sequence decodes.", width)
            return Text("\n").join([drafter, *(Text(line, "dim") for line in note)])
        lines = pack([Text(seq.label, f"bold {seq_color(seq.seq_id)}"),
                      Text(self.drafter or "drafter not recorded", "dim")], width, 2)
        lines += pack([Text(f"accepted {kept}/{guessed} ({100 * kept / guessed:.0f}%)"),
                       Text(f"· {made / passes:.1f} tok/pass")], width, 2)
        lines += pack([Text(w, "dim") for w in ("✓ kept", "✗ rejected", "→ model's", "+ bonus")],
                      width, 2)
        room = max(1, self.content_size.height - len(lines))
        shown: list[Text] = []
        for part in reversed(rows):  # the newest verify steps, whole, as many as fit
            block = self.row(frame, part, width)
            if shown and len(shown) + len(block) > room:
                break
            shown[:0] = block
        return Text("\n").join(lines + shown)
