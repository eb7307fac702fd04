"""The Textual app: starts on the loading screen, then runs the chosen scenario or replay."""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding

from tinyinfer import Model

from tui.options import Options
from tui.screens.loading import LoadingScreen


class TinyInferApp(App[None]):
    """`tinyinfer tui`: step through a real inference run, stage by stage."""

    CSS_PATH = "app.tcss"
    TITLE = "tinyinfer"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall")]
    BINDINGS = [Binding("q", "quit", "Quit")]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, options: Options | None = None, model: Model | None = None) -> None:
        """Pass a loaded `model` to skip loading (tests reuse one model across apps)."""
        super().__init__()
        self.options = options or Options()
        self.model = model

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen(self.options, self.model))
