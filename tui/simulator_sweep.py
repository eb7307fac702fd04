"""A small text plot of decode throughput and TPOT against batch size, from `sweep()`."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tinyinfer.display.bars import bar
from tinyinfer.simulate.model import Simulation

BAR_WIDTH = 12


def count(value: float) -> str:
    """A rate in at most 6 characters: 9,999 · 12.3K · 4.5M."""
    if value < 1e4:
        return f"{value:,.0f}"
    return f"{value / 1e3:.1f}K" if value < 1e6 else f"{value / 1e6:.1f}M"


class SweepPlot(Widget):
    """One row per batch size: throughput and TPOT bars; ▶ marks the knobs' batch."""

    sweep: reactive[tuple[Simulation, ...]] = reactive(tuple)
    simulation: reactive[Simulation | None] = reactive(None)

    def on_mount(self) -> None:
        self.border_title = "Batch sweep"

    def render(self) -> Text:
        if not self.sweep or self.simulation is None:
            return Text("")
        top_rate = max(s.decode_throughput.value for s in self.sweep)
        top_tpot = max(s.tpot.value for s in self.sweep)
        current = self.simulation.scenario.batch
        out = Text()
        out.append(f"{'batch':>6} {'decode tokens/s':<{BAR_WIDTH + 7}}  TPOT\n", style="bold")
        for s in self.sweep:
            here = s.scenario.batch == current
            style = "reverse" if here else ""
            if s.scenario.batch > s.max_concurrent.value:
                mark, colour = "!", "red"
            else:
                mark, colour = ("c", "magenta") if s.decode_bound == "compute" else (" ", "green")
            out.append(f"{'▶' if here else ' '}{s.scenario.batch:>5} ", style=style)
            out.append(bar(s.decode_throughput.value, top_rate, BAR_WIDTH), style=colour)
            out.append(f"{count(s.decode_throughput.value):>7}  ", style=style)
            out.append(bar(s.tpot.value, top_tpot, BAR_WIDTH), style=colour)
            out.append(f"{s.tpot.human():>8}", style=style)
            out.append(f" {mark}\n", style=f"bold {colour}")
        knee = self.simulation.knee_batch.human()
        out.append(f"c compute-bound · ! KV full · knee at {knee}", style="dim")
        return out
