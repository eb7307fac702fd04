"""Server test support: an engine the test decides the pace of, for tests that must not race
the decoder, and a capture of the server's log, for tests that promise no traceback."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import tinyinfer
from tinyinfer.trace import StepTrace


class HeldEngine(tinyinfer.Engine):
    """An engine that can be held: a held step runs nothing and returns an empty trace, so the
    server loop goes on taking adds and cancels while no sequence advances. The tests below
    decide when a long request may go on, so none depends on how fast this machine decodes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._go = threading.Event()
        self._go.set()
        self._until_text = False

    def hold(self, after_first_text: bool = False) -> None:
        """Hold every later step until resume(); or, with after_first_text, once a step has
        given some request its first text (a client then has its first streamed event)."""
        self._until_text = after_first_text
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def step(self) -> StepTrace:
        if self._until_text:
            trace = super().step()
            self._until_text = not any(self.completion(s.request_id).text for s in trace.seqs)
            return trace
        if not self._go.wait(0.01):  # the wait only keeps the held loop from spinning hot
            return StepTrace(step=self.step_count, seqs=())
        return super().step()


@contextlib.contextmanager
def server_log() -> Iterator[list[logging.LogRecord]]:
    """Every record uvicorn and tinyinfer log meanwhile (uvicorn's loggers do not propagate to
    the root logger, so pytest's caplog would miss them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn", "tinyinfer")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """The records that carry a traceback, or that log an error, as one line each."""
    return [f"{r.name}: {r.getMessage()}" for r in records
            if r.exc_info or r.levelno >= logging.ERROR]
