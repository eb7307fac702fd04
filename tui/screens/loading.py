"""The first screen: load the model (or read the recorded trace) in a worker, then run."""

from __future__ import annotations

import time

from textual import work
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, LoadingIndicator, Static
from textual.worker import Worker, WorkerState

from tinyinfer import Model

from tui.options import Options
from tui.screens.run import RunScreen
from tui.session import Session, open_session


class LoadingScreen(Screen):
    """Shows what is loading and for how long; on failure, says why and waits for q."""

    def __init__(self, options: Options, model: Model | None = None) -> None:
        super().__init__()
        self.options = options
        self.model = model
        self.started = time.perf_counter()

    def what(self) -> str:
        if self.options.replay is not None:
            return f"Reading the recorded trace {self.options.replay}"
        split = (f", split over {self.options.tensor_parallel} processes"
                 if self.options.tensor_parallel > 1 else "")
        return f"Loading model {self.options.model} with the {self.options.runner} runner{split}"

    def compose(self) -> ComposeResult:
        yield Static(self.what() + " …", id="loading-text")
        yield LoadingIndicator()
        yield Footer()

    def on_mount(self) -> None:
        self._clock = self.set_interval(0.5, self._tick)
        self._load()

    def _tick(self) -> None:
        seconds = time.perf_counter() - self.started
        self.query_one("#loading-text", Static).update(f"{self.what()} … {seconds:.0f} s")

    @work(thread=True, exit_on_error=False)
    def _load(self) -> Session:
        return open_session(self.options, self.model)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.SUCCESS:
            self._clock.stop()
            self.app.switch_screen(RunScreen(event.worker.result, self.options))
        elif event.state == WorkerState.ERROR:
            self._clock.stop()
            self.query_one(LoadingIndicator).display = False
            self.query_one("#loading-text", Static).update(
                f"{self.what()} failed:\n\n{event.worker.error}\n\nPress q to quit.")
