"""The derivation of the chosen prediction: `Quantity.explain()` down to specs and knobs."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import ScrollableContainer
from textual.reactive import reactive
from textual.widgets import Static

from tinyinfer.simulate.model import Simulation


class Derivation(ScrollableContainer):
    """Shows how the quantity named `selected` was computed in `simulation` (scrolls both ways)."""

    simulation: reactive[Simulation | None] = reactive(None)
    selected: reactive[str] = reactive("tpot")

    def compose(self) -> ComposeResult:
        yield Static(id="sim-explain-text")

    def _refresh_text(self) -> None:
        if self.simulation is None:
            return
        names = [q.name for _, q in self.simulation.rows()]
        name = self.selected if self.selected in names else names[0]
        self.border_title = f"How {name} is derived"
        self.query_one("#sim-explain-text", Static).update(Text(self.simulation.quantity(name).explain()))

    def watch_simulation(self) -> None:
        self._refresh_text()

    def watch_selected(self) -> None:
        self._refresh_text()
