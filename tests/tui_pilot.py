"""Driving a TinyInferApp under Textual's pilot: shared by the TUI tests."""

from __future__ import annotations

from typing import Callable

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
