"""The panel framework: a bordered widget that redraws itself from the frame on screen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tui.frames import Frame


class Panel(Widget):
    """One box of the main screen; subclasses render `frame` (and any other bound reactives).

    The run screen binds each reactive named in BINDS to its own reactive of that name, so a
    panel never reaches into the screen or its siblings: attributes flow down.
    """

    DEFAULT_CLASSES = "panel"
    PANEL_ID: ClassVar[str] = ""
    TITLE: ClassVar[str] = ""
    SWAPPABLE: ClassVar[bool] = False  # shares the one swap slot of the compact layout
    FEATURE: ClassVar[str | None] = None  # shown only in runs using this engine feature
    BINDS: ClassVar[tuple[str, ...]] = ("frame",)

    frame: reactive[Frame | None] = reactive(None)

    def __init__(self) -> None:
        super().__init__(id=self.PANEL_ID)
        self.border_title = self.TITLE


def pack(cells: Sequence[Text], width: int, indent: int = 0) -> list[Text]:
    """Cells in order on as few lines of `width` as they need, one space apart, never split.

    Panels lay out their facts with it instead of letting the terminal cut a line: a cell that
    does not fit starts a new line, indented by `indent` columns under the first.
    """
    lines = [Text()]
    for cell in cells:
        line = lines[-1]
        used = line.cell_len > (indent if len(lines) > 1 else 0)
        if used and line.cell_len + 1 + cell.cell_len > width:
            line = Text(" " * indent)
            lines.append(line)
            used = False
        if used:
            line.append(" ")
        line.append_text(cell)
    return lines


def sentence(text: str, width: int, style: str = "dim") -> Text:
    """A message on as many lines of `width` as it needs, broken between words, never cut."""
    return Text("\n").join(pack([Text(word, style) for word in text.split()], max(20, width)))
