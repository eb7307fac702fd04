"""`python -m tui.simulator_app`: the simulator screen on its own (also `tinyinfer simulate --tui`)."""

from __future__ import annotations

import argparse
import sys

from textual.app import App
from textual.binding import Binding

from tinyinfer.simulate.model import Scenario, SimulationError
from tui.simulator_screen import SimulatorScreen


class SimulatorApp(App[None]):
    """Play with the knobs of the roofline simulator; escape or q leaves."""

    TITLE = "tinyinfer simulator"
    BINDINGS = [Binding("q", "quit", "Quit")]
    ENABLE_COMMAND_PALETTE = False

    def __init__(self, scenario: Scenario | None = None) -> None:
        """Open on `scenario` (default: Llama-3 8B on an H100)."""
        super().__init__()
        self.scenario = scenario

    def on_mount(self) -> None:
        self.push_screen(SimulatorScreen(self.scenario), callback=lambda _: self.exit())


def main(argv: list[str] | None = None) -> int:
    """Parse the starting model and hardware, then run the app; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tui.simulator_app",
                                     description="Turn the knobs of the inference simulator in a terminal UI.")
    parser.add_argument("--model", default="llama-3-8b", help="model preset or a folder with config.json")
    parser.add_argument("--hardware", default="h100", help="hardware preset (default: h100)")
    args = parser.parse_args(argv)
    try:
        scenario = Scenario.of(args.model, args.hardware)
    except SimulationError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    SimulatorApp(scenario).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
