"""The simulator's predictions: one row per Quantity, keyed by its name for `explain()`."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable

from tinyinfer.simulate.model import Simulation


class ResultsTable(DataTable):
    """Every row of `Simulation.rows()`; the cursor stays on the `selected` quantity as knobs change."""

    simulation: reactive[Simulation | None] = reactive(None)
    selected: reactive[str] = reactive("tpot")

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.border_title = "Predictions"
        self.border_subtitle = "↑↓ pick a row to see its derivation"

    def on_mount(self) -> None:
        self.add_column("quantity", key="label")
        self.add_column(Text("value", justify="right"), key="value")

    def watch_simulation(self, simulation: Simulation | None) -> None:
        if simulation is None:
            return
        keep = self.selected
        self.clear()
        for label, quantity in simulation.rows():
            self.add_row(label, Text(quantity.human(), justify="right"), key=quantity.name)
        names = [q.name for _, q in simulation.rows()]
        self.move_cursor(row=names.index(keep) if keep in names else 0, animate=False)
