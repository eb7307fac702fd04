"""Driving a TinyInferApp under Textual's pilot: shared by the TUI tests."""

from __future__ import annotations

from typing import Callable

from tui.screens.run import RunScreen


async def settle(pilot) -> None:
    """Wait for engine workers and the redraws they cause."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def started(pilot, ready: Callable[[RunScreen], bool] = lambda screen: True) -> RunScreen:
    """Wait for the loading screen to hand over to the run screen (and for it to be ``ready``)."""
    for _ in range(100):
        await settle(pilot)
        if isinstance(pilot.app.screen, RunScreen) and ready(pilot.app.screen):
            return pilot.app.screen
    raise AssertionError(f"still on {pilot.app.screen!r}")
