"""`?`: every key of the run screen and what the panels show."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

PANELS_HELP = (
    ("Prompt & tokens", "each request's tokens in alternating colours; green = generated; "
                        "underlined = computed this step"),
    ("KV cache pages", "one cell per page, coloured by the sequence holding it"),
    ("Next token", "candidates with the probability they were sampled with, and a preview with "
                   "the current t/k/p (and min-p) settings over the whole vocabulary"),
    ("Attention", "newest query's weights over the context, one row per step"),
    ("Metrics", "TTFT, TPOT and tokens/s in engine time; pages; prefix-cache reuse"),
    ("Speculative", "runs with a drafter: each verify step's guesses, kept ✓, rejected ✗ → the "
                    "model's own token, or + a bonus"),
    ("Quantization", "quantized runs: each weight's rounding error, bars on one 0-16% scale"),
    ("Timeline", "one row per step; bar length = tokens computed"),
    ("c: compare", "the same requests side by side: speculative on/off, fp32/int8/int4, "
                   "paged/contiguous memory, this model vs a real instruct model (4)"),
)


class HelpScreen(ModalScreen[None]):
    """A scrollable list of keys and panels; any of escape, ? or q closes it."""

    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        keys = Table.grid(padding=(0, 2))
        keys.add_column(style="bold")
        keys.add_column()
        for binding in self.bindings:
            keys.add_row(self.app.get_key_display(binding), binding.tooltip or binding.description)
        keys.add_row("q", "Quit")
        panels = Table.grid(padding=(0, 2))
        panels.add_column(style="bold")
        panels.add_column()
        for name, what in PANELS_HELP:
            panels.add_row(name, what)
        with VerticalScroll(id="help"):
            yield Static(Text("Keys", style="bold underline"))
            yield Static(keys)
            yield Static(Text("\nPanels", style="bold underline"))
            yield Static(panels)

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "Help · escape closes"

    def action_close(self) -> None:
        self.dismiss(None)
