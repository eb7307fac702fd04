"""The walkthrough's narration: what the highlighted stage is doing and why."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tui.narration import Narration


class NarrationPanel(Widget):
    """Headline and explanation for the frame on screen; hidden in free mode."""

    narration: reactive[Narration | None] = reactive(None, layout=True)

    def __init__(self) -> None:
        super().__init__(id="narration")
        self.border_title = "Walkthrough"

    def watch_narration(self, narration: Narration | None) -> None:
        self.border_subtitle = "w: free mode"
        if narration is not None:
            self.border_title = f"Walkthrough · {narration.title}"

    def render(self) -> Text:
        if self.narration is None:
            return Text("")
        return Text(self.narration.body)
