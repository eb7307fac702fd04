"""The simulator screen: turn the knobs of a scenario and watch the roofline predictions move.

Every change re-runs `simulate()` (and a batch `sweep()`) at once. The knobs post Textual's
Changed messages up to this screen, which holds the current Simulation as a reactive and
binds it down into the table, the derivation and the plot; they never talk to each other.
"""

from __future__ import annotations

import dataclasses

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Footer, Input, Label, Select, Static

from tinyinfer.simulate.model import (
    HARDWARE,
    KV_PRECISIONS,
    MODEL_CONFIGS,
    WEIGHT_PRECISIONS,
    Hardware,
    ModelSpec,
    Scenario,
    Simulation,
    SimulationError,
    model_preset,
    simulate,
    sweep,
)
from tui.simulator_explain import Derivation
from tui.simulator_knob import NumberKnob
from tui.simulator_results import ResultsTable
from tui.simulator_sweep import SweepPlot

SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def sweep_batches(batch: int) -> list[int]:
    """The plot's batch sizes: powers of two up to 256, plus the knobs' own batch."""
    return sorted(set(SWEEP_BATCHES) | {batch})


class SimulatorScreen(Screen[None]):
    """Knobs on the left, predictions on the right, the chosen row's derivation and a sweep below."""

    CSS_PATH = "simulator.tcss"
    BINDINGS = [Binding("escape", "close", "Back")]

    simulation: reactive[Simulation | None] = reactive(None, init=False)
    sweep: reactive[tuple[Simulation, ...]] = reactive(tuple, init=False)
    selected: reactive[str] = reactive("tpot", init=False)
    problem: reactive[str] = reactive("", init=False)

    def __init__(self, scenario: Scenario | None = None) -> None:
        """Start from `scenario` (default: Llama-3 8B on an H100); knobs not shown keep its values."""
        super().__init__()
        self.base = scenario or Scenario.of("llama-3-8b", "h100")
        self.models: dict[str, ModelSpec] = {name: model_preset(name) for name in MODEL_CONFIGS}
        self.models.setdefault(self.base.model.name, self.base.model)
        self.hardware: dict[str, Hardware] = dict(HARDWARE)
        self.hardware.setdefault(self.base.hardware.name, self.base.hardware)

    def compose(self) -> ComposeResult:
        s = self.base
        yield Static(id="sim-status")
        with Horizontal(id="sim-main"):
            with Vertical(id="sim-knobs"):
                yield self._row("model", Select([(n, n) for n in self.models], value=s.model.name,
                                                allow_blank=False, compact=True, id="knob-model"))
                yield self._row("hardware", Select([(n, n) for n in self.hardware], value=s.hardware.name,
                                                   allow_blank=False, compact=True, id="knob-hardware"))
                yield self._row("weights", Select([(p, p) for p in WEIGHT_PRECISIONS], value=s.weight_precision,
                                                  allow_blank=False, compact=True, id="knob-weight_precision"))
                yield self._row("KV cache", Select([(p, p) for p in KV_PRECISIONS], value=s.kv_precision,
                                                   allow_blank=False, compact=True, id="knob-kv_precision"))
                yield self._row("batch", NumberKnob("batch", s.batch, integer=True, low=1, factor=2))
                yield self._row("prompt tok", NumberKnob("prompt_tokens", s.prompt_tokens, integer=True,
                                                         low=1, factor=2))
                yield self._row("output tok", NumberKnob("output_tokens", s.output_tokens, integer=True,
                                                         low=1, factor=2))
                yield self._row("GPUs", NumberKnob("num_gpus", s.num_gpus, integer=True, low=1, high=64,
                                                   factor=2))
                yield self._row("spec k", NumberKnob("spec_k", s.spec_k, integer=True, low=0, high=16, step=1))
                yield self._row("acceptance", NumberKnob("spec_acceptance", s.spec_acceptance, integer=False,
                                                         low=0, high=1, step=0.05))
                yield self._row("$ / hour", NumberKnob("price_per_hour", s.price_per_hour, integer=False,
                                                       low=0, step=0.25,
                                                       placeholder=f"{s.hardware.price_per_hour:.2f}"))
                with VerticalScroll(id="sim-message-box", can_focus=False):
                    yield Static(id="sim-message")
            yield ResultsTable(id="sim-results").data_bind(SimulatorScreen.simulation,
                                                           SimulatorScreen.selected)
        with Horizontal(id="sim-bottom"):
            yield Derivation(id="sim-explain").data_bind(SimulatorScreen.simulation, SimulatorScreen.selected)
            yield SweepPlot(id="sim-sweep").data_bind(SimulatorScreen.simulation, SimulatorScreen.sweep)
        yield Footer()

    @staticmethod
    def _row(label: str, knob: Widget) -> Horizontal:
        return Horizontal(Label(label, classes="knob-label"), knob, classes="knob")

    def on_mount(self) -> None:
        self.query_one("#sim-knobs").border_title = "Knobs"
        self.recompute()

    def read_scenario(self) -> Scenario:
        """The scenario the knobs describe; raises ValueError naming the knob that is wrong."""
        picks = {field: self.query_one(f"#knob-{field}", Select).value
                 for field in ("model", "hardware", "weight_precision", "kv_precision")}
        numbers = {knob.field: knob.reading() for knob in self.query(NumberKnob)}
        return dataclasses.replace(self.base, model=self.models[picks.pop("model")],
                                   hardware=self.hardware[picks.pop("hardware")], **picks, **numbers)

    def recompute(self) -> None:
        """Simulate the knobs' scenario, or say what is wrong and keep the last predictions."""
        try:
            scenario = self.read_scenario()
            if self.simulation is not None and scenario == self.simulation.scenario:
                self.problem = ""
                return
            simulation = simulate(scenario)
        except (ValueError, SimulationError) as exc:
            self.problem = str(exc)
            return
        self.sweep = tuple(sweep(scenario, "batch", sweep_batches(scenario.batch)))
        self.simulation = simulation
        self.problem = ""

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.recompute()

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        if event.select.id == "knob-hardware":
            price = self.hardware[str(event.value)].price_per_hour
            self.query_one("#knob-price_per_hour", NumberKnob).placeholder = f"{price:.2f}"
        self.recompute()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key.value is not None:
            self.selected = event.row_key.value

    def watch_simulation(self) -> None:
        self._show_state()

    def watch_problem(self) -> None:
        self.set_class(bool(self.problem), "-problem")
        self._show_state()

    def _show_state(self) -> None:
        """The status line (what is simulated) and the message box (the problem, or the notes)."""
        simulation = self.simulation
        if simulation is None:
            return
        s = simulation.scenario
        gpus = f"{s.num_gpus} x " if s.num_gpus > 1 else ""
        status = Text.assemble((" simulator ", "bold reverse"), " ", (s.model.title, "bold"),
                               f" on {gpus}{s.hardware.title} │ ")
        status.append("showing the last valid knobs" if self.problem else
                      f"decode {simulation.decode_bound}-bound, prefill {simulation.prefill_bound}-bound",
                      style="bold red" if self.problem else "")
        self.query_one("#sim-status", Static).update(status)
        message = Text(self.problem, style="bold red") if self.problem else \
            Text("\n").join(Text(f"• {note}", style="yellow") for note in simulation.notes)
        self.query_one("#sim-message", Static).update(message)

    def action_close(self) -> None:
        self.dismiss(None)
