"""The panel framework: a bordered widget that redraws itself from the frame on screen."""

from __future__ import annotations

from typing import ClassVar

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
