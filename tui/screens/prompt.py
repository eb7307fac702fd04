"""A one-line dialog asking for prompt text (\\n in the text stands for a line break)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label


class PromptScreen(ModalScreen[str | None]):
    """Returns the typed prompt, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, suggestion: str) -> None:
        super().__init__()
        self.title_text = title
        self.suggestion = suggestion

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(value=self.suggestion, id="prompt")
            yield Label("enter: go · escape: cancel · \\n = new line", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.replace("\\n", "\n")
        self.dismiss(text if text.strip() else None)

    def action_cancel(self) -> None:
        self.dismiss(None)
