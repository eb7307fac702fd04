"""`c`: the run's requests again under other settings, side by side (tui/compare.py runs them)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Static
from textual.worker import Worker, WorkerState

from tui.compare import KINDS, Comparison, compare
from tui.session import Session


def comparison_table(comparison: Comparison) -> Table:
    """One row per measure, one column per setting; the settings' names on top."""
    table = Table(title=comparison.title, title_justify="left", expand=False, show_edge=False,
                  header_style="bold", title_style="bold")
    table.add_column("", style="dim", no_wrap=False)
    for column in comparison.columns:
        table.add_column(column, justify="right", no_wrap=True)
    for what, values in comparison.rows:
        table.add_row(what, *values)
    return table


class CompareScreen(Screen):
    """Runs one comparison in a worker and shows it; 1 to 4 pick another, escape goes back."""

    BINDINGS = [
        Binding("escape,c", "close", "Back to the run"),
        Binding("1", "show('speculative')", "Speculative"),
        Binding("2", "show('precision')", "Precision"),
        Binding("3", "show('memory')", "Memory"),
        Binding("4", "show('models')", "Models"),
    ]

    def __init__(self, session: Session, kind: str, cache: dict[str, Comparison],
                 timings: bool = False, device: str | None = None) -> None:
        """`cache` keeps comparisons already run for this session (the run screen owns it)."""
        super().__init__()
        self.session = session
        self.kind = kind
        self.cache = cache
        self.timings = timings
        self.device = device

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="compare"):
            yield Static(id="compare-body")
        yield LoadingIndicator(id="compare-busy")
        yield Footer()

    def on_mount(self) -> None:
        self.action_show(self.kind)

    def action_show(self, kind: str) -> None:
        if any(w.is_running for w in self.workers):
            return
        self.kind = kind
        self.query_one("#compare").border_title = f"Compare · {KINDS[kind]}"
        if kind in self.cache:
            self._show(self.cache[kind])
            return
        self.query_one("#compare-body", Static).update(Text(
            f"Running the requests again: {KINDS[kind]} …", style="dim"))
        self.query_one("#compare-busy").display = True
        self._run(kind)

    @work(thread=True, exit_on_error=False, group="compare")
    def _run(self, kind: str) -> None:
        result = compare(kind, self.session, self.timings, self.device)
        self.app.call_from_thread(self._done, result)

    def _done(self, comparison: Comparison) -> None:
        self.cache[comparison.kind] = comparison
        if comparison.kind == self.kind:
            self._show(comparison)

    def _show(self, comparison: Comparison) -> None:
        self.query_one("#compare-busy").display = False
        notes = Text("\n").join(Text(note) for note in comparison.notes)
        body = Table.grid()
        body.add_row(comparison_table(comparison))
        body.add_row(Text(""))
        body.add_row(notes)
        self.query_one("#compare-body", Static).update(body)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:
            self.query_one("#compare-busy").display = False
            self.query_one("#compare-body", Static).update(Text(
                f"Cannot compare: {event.worker.error}", style="red"))

    def action_close(self) -> None:
        if not any(w.is_running for w in self.workers):
            self.dismiss(None)
