"""The top line: what runs (model, runner, scenario), which step is on screen, and live or replay."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


class StatusBar(Widget):
    """One line of state; the run screen sets its text."""

    text: reactive[str] = reactive("")
    running: reactive[bool] = reactive(False)

    def render(self) -> Text:
        mark = (" ▶ running ", "bold green") if self.running else (" ❚❚ paused ", "bold yellow")
        return Text.assemble((" tinyinfer ", "bold reverse"), mark, "│ ", self.text)
