"""The top line: what runs (model, runner, scenario), which step is on screen, and live or replay.

The line is made of parts, each with a rank. When the terminal is too narrow for all of them,
the brand goes first, then the lowest-ranked parts (the scenario's name, ...), so what a learner
needs most — the step, the model and runner, the drafter — stays whole instead of being cut off
at the right edge.
"""

from __future__ import annotations

from typing import NamedTuple

from rich.cells import cell_len
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


class StatusPart(NamedTuple):
    """One piece of the line; `group` 0 is where the run stands, 1 what runs."""

    text: str
    rank: int  # the higher, the longer it stays when the line must shrink
    group: int


def line_text(parts: tuple[StatusPart, ...]) -> str:
    """The parts in order: within a group joined by " · ", the groups by " │ "."""
    groups = sorted({part.group for part in parts})
    return " │ ".join(" · ".join(p.text for p in parts if p.group == g) for g in groups)


def fit(parts: tuple[StatusPart, ...], width: int) -> tuple[StatusPart, ...]:
    """Drop the lowest-ranked parts until the line fits `width` cells (the highest-ranked part
    always stays)."""
    kept = list(parts)
    while len(kept) > 1 and cell_len(line_text(tuple(kept))) > width:
        kept.remove(min(kept, key=lambda p: p.rank))
    return tuple(kept)


BRAND = " tinyinfer "


class StatusBar(Widget):
    """One line of state; the run screen sets its parts."""

    parts: reactive[tuple[StatusPart, ...]] = reactive(())
    running: reactive[bool] = reactive(False)

    def render(self) -> Text:
        mark = (" ▶ running ", "bold green") if self.running else (" ❚❚ paused ", "bold yellow")
        room = self.size.width - cell_len(mark[0]) - 2  # the mark and the "│ " after it
        body = line_text(self.parts)
        if cell_len(BRAND) + cell_len(body) <= room:
            return Text.assemble((BRAND, "bold reverse"), mark, "│ ", body)
        # too narrow: the brand goes first, then the lowest-ranked parts
        return Text.assemble(mark, "│ ", line_text(fit(self.parts, room)))
