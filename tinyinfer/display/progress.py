"""Progress bars for long commands, on stderr and only when stderr is a terminal.

    with progress.task("requests", total=len(workload)) as advance:
        ...
        advance(len(trace.finished))

Results stay on stdout, unchanged; in a pipe or a test nothing is drawn. A task opened while
another is running becomes a second line of the same display (rich allows one at a time), and
each bar disappears when its work is done.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")
_console: Console | None = None
_active: Progress | None = None


def use_console(console: Console | None) -> None:
    """Draw on ``console`` from now on (None: a console on stderr, the default)."""
    global _console
    _console = console


@contextmanager
def hidden() -> Iterator[None]:
    """Draw no bars inside the block (another program, such as a Textual app, owns the screen)."""
    global _console
    before, _console = _console, Console(file=io.StringIO())
    try:
        yield
    finally:
        _console = before


@contextmanager
def task(description: str, total: int | None = None) -> Iterator[Callable[[float], None]]:
    """A bar for one piece of work; yields ``advance(n=1)``. ``total=None``: a spinner and a count."""
    global _active
    if threading.current_thread() is not threading.main_thread():  # the one display is the main thread's
        yield lambda n=1: None
        return
    if _active is not None:  # nested: one more line in the running display
        yield from _task_on(_active, description, total)
        return
    console = _console or Console(stderr=True)
    display = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                       MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"),
                       TimeRemainingColumn(), console=console, transient=True,
                       disable=not console.is_terminal,
                       redirect_stdout=False, redirect_stderr=False)  # results stay on stdout
    with display:
        _active = display
        try:
            yield from _task_on(display, description, total)
        finally:
            _active = None


def _task_on(display: Progress, description: str, total: int | None) -> Iterator[Callable[[float], None]]:
    task_id = display.add_task(description, total=total)
    try:
        yield lambda n=1: display.advance(task_id, n)
    finally:
        display.remove_task(task_id)


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Each of ``items`` in turn, counted on a bar (total: len(items) where it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with task(description, total) as advance:
        for item in items:
            yield item
            advance(1)
