"""Driving a TinyInferApp under Textual's pilot: shared by the TUI tests."""

from __future__ import annotations

import io
from typing import Callable

from rich.console import Console
from textual.worker import WorkerFailed

from tui.screens.run import RunScreen


async def settle(pilot, failures_expected: bool = False) -> None:
    """Wait for the workers to end, and for the redraws they cause. A worker that fails fails the
    test, unless the test expects it (a load that fails is an outcome the screen shows)."""
    for worker in list(pilot.app.workers):
        try:
            await worker.wait()
        except WorkerFailed:
            if not failures_expected:
                raise
    await pilot.pause()


async def started(pilot, ready: Callable[[RunScreen], bool] = lambda screen: True) -> RunScreen:
    """Wait for the loading screen to hand over to the run screen (and for it to be ``ready``)."""
    for _ in range(100):
        await settle(pilot)
        if isinstance(pilot.app.screen, RunScreen) and ready(pilot.app.screen):
            return pilot.app.screen
    raise AssertionError(f"still on {pilot.app.screen!r}")


def screen_text(app) -> str:
    """What the terminal shows now, as plain text: the same composition `App.export_screenshot`
    draws, so a fact cut off by a panel's edge is missing here too."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text()
