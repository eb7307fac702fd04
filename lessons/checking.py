"""The checker toolkit: named cases that compare a student's functions with the engine's.

A lesson's ``check.py`` builds a ``Checklist`` of cases. Running it never shows a traceback:
each case ends as ``ok``, ``FAIL`` (which case, expected vs got, a hint), ``todo`` (the
function still raises NotImplementedError) or ``error`` (the student's code raised, shown as
the exception and the line of their file it came from).
"""

from __future__ import annotations

import signal
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

CASE_TIME_LIMIT = 20  # seconds; a case that runs longer is reported, not waited for


class CaseFailed(Exception):
    """A case's answer is wrong: what was compared, the expected and the actual value."""

    def __init__(self, what: str, expected: str = "", got: str = "", detail: str = "") -> None:
        super().__init__(what)
        self.what, self.expected, self.got, self.detail = what, expected, got, detail


class CaseTimeout(Exception):
    """A case ran past CASE_TIME_LIMIT."""


@dataclass(frozen=True)
class Case:
    """One check of one exercise function."""

    name: str
    function: str  # the exercise function (or class) under test
    hint: str
    run: Callable[[ModuleType], None]


@dataclass(frozen=True)
class Outcome:
    """How one case ended: status is "ok", "fail", "todo" or "error"."""

    case: Case
    status: str
    lines: tuple[str, ...] = ()
    timed_out: bool = False


@dataclass
class Checklist:
    """The cases of one lesson, in the order a student should make them pass."""

    cases: list[Case] = field(default_factory=list)

    def case(self, name: str, function: str, hint: str) -> Callable[[Callable[[ModuleType], None]], Callable]:
        """Decorator: register ``fn(exercise_module)`` as a case checking ``function``."""
        def register(fn: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
            self.cases.append(Case(name, function, hint, fn))
            return fn
        return register

    def run(self, module: ModuleType) -> list[Outcome]:
        """Run every case against ``module``; a function found unwritten or stuck skips its other cases."""
        outcomes: list[Outcome] = []
        unwritten: set[str] = set()
        stuck: set[str] = set()
        source = getattr(module, "__file__", None) or ""
        for case in self.cases:
            if case.function in unwritten:
                outcomes.append(Outcome(case, "todo"))
            elif case.function in stuck:
                outcomes.append(Outcome(case, "error", (f"not run: {case.function} did not finish above",)))
            else:
                outcome = run_case(case, module, source)
                if outcome.status == "todo":
                    unwritten.add(case.function)
                if outcome.timed_out:
                    stuck.add(case.function)
                outcomes.append(outcome)
        return outcomes


def run_case(case: Case, module: ModuleType, source: str) -> Outcome:
    """Run one case and turn whatever happens into an Outcome."""
    if not hasattr(module, case.function):
        return Outcome(case, "fail", (f"exercise has no {case.function!r}: did you rename or delete it?",))
    try:
        with time_limit(CASE_TIME_LIMIT):
            case.run(module)
    except NotImplementedError:
        return Outcome(case, "todo")
    except CaseFailed as failed:
        lines = [failed.what]
        if failed.expected or failed.got:
            lines += [f"expected {failed.expected}", f"got      {failed.got}"]
        if failed.detail:
            lines.append(failed.detail)
        lines.append(f"hint: {case.hint}")
        return Outcome(case, "fail", tuple(lines))
    except CaseTimeout:
        return Outcome(case, "error", (
            f"{case.function} ran for more than {CASE_TIME_LIMIT} s: is there a loop that never ends?",
            f"hint: {case.hint}"), timed_out=True)
    except Exception as exc:  # the student's code raised: say what and where, nothing more
        return Outcome(case, "error", (
            f"{case.function} raised {type(exc).__name__}: {exc}",
            *where_in_student_code(exc, source),
            f"hint: {case.hint}"))
    return Outcome(case, "ok")


def where_in_student_code(exc: BaseException, source: str) -> list[str]:
    """The last line of the student's file that the exception passed through, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == source]
    if not frames:
        return []
    last = frames[-1]
    return [f"at line {last.lineno} of your exercise, in {last.name}: {(last.line or '').strip()}"]


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise CaseTimeout after ``seconds`` (main thread on POSIX only; elsewhere no limit)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- comparisons


def show(value: Any) -> str:
    """A short, readable rendering of a value for a failure message."""
    if isinstance(value, np.ndarray):
        body = np.array2string(value, precision=4, threshold=12, edgeitems=2, suppress_small=True)
        return f"{' '.join(body.split())}  (shape {value.shape}, {value.dtype})"
    text = repr(value)
    return text if len(text) <= 160 else text[:150] + " ... " + text[-6:]


def as_array(got: Any, what: str) -> np.ndarray:
    """The student's result as a float array, or a failure saying what came back instead."""
    if got is None:
        raise CaseFailed(f"{what} returned None: did you forget the return statement?")
    try:
        return np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        raise CaseFailed(f"{what} should return an array, but returned {type(got).__name__}",
                         got=show(got)) from None


def expect_close(got: Any, expected: np.ndarray, what: str, rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    """Fail unless ``got`` has the expected shape and values (within tolerance)."""
    expected = np.asarray(expected)
    arr = as_array(got, what)
    if expected.ndim == 0 and arr.ndim == 0:
        if not np.isclose(arr, expected, rtol=rtol, atol=atol):
            raise CaseFailed(f"{what} does not match the engine", f"{float(expected):.6g}", f"{float(arr):.6g}")
        return
    if arr.shape != expected.shape:
        raise CaseFailed(f"{what} has the wrong shape", f"shape {expected.shape}", f"shape {arr.shape}")
    if not np.isfinite(arr).all() and np.isfinite(expected).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise CaseFailed(f"{what} contains NaN or inf (first at index {bad})",
                         show(expected), show(np.asarray(got)))
    if not np.allclose(arr, expected, rtol=rtol, atol=atol, equal_nan=True):
        diff = np.abs(arr - expected)
        diff = np.where(np.isnan(diff), np.inf, diff)
        where = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
        raise CaseFailed(
            f"{what} does not match the engine",
            show(expected), show(np.asarray(got)),
            f"largest difference {float(diff[where]):.3g} at index {where}: "
            f"expected {float(expected[where]):.6g}, got {float(arr[where]):.6g}")


def expect_equal(got: Any, expected: Any, what: str) -> None:
    """Fail unless ``got == expected``; for sequences, point at the first difference."""
    if got is None and expected is not None:
        raise CaseFailed(f"{what} returned None: did you forget the return statement?")
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple, np.ndarray)):
        got_list = [x.item() if isinstance(x, np.generic) else x for x in got]
        if got_list == list(expected):
            return
        first = next((i for i, (a, b) in enumerate(zip(got_list, expected)) if a != b),
                     min(len(got_list), len(expected)))
        detail = (f"they first differ at index {first}"
                  + (f" (lengths {len(expected)} expected, {len(got_list)} got)"
                     if len(got_list) != len(expected) else ""))
        raise CaseFailed(f"{what} does not match the engine", show(list(expected)), show(got_list), detail)
    if got != expected:
        raise CaseFailed(f"{what} does not match the engine", show(expected), show(got))


def expect(condition: bool, what: str, detail: str = "") -> None:
    """Fail with ``what`` unless ``condition`` holds."""
    if not condition:
        raise CaseFailed(what, detail=detail)


def expect_raises(error: type[BaseException], fn: Callable[[], Any], what: str) -> None:
    """Fail unless calling ``fn`` raises ``error``."""
    try:
        result = fn()
    except error:
        return
    raise CaseFailed(f"{what} should raise {error.__name__}", error.__name__, f"returned {show(result)}")


# ---------------------------------------------------------------- reports


@dataclass(frozen=True)
class Report:
    """The outcome of checking one exercise file."""

    title: str
    path: str
    outcomes: tuple[Outcome, ...]
    load_error: str = ""

    @property
    def passed(self) -> bool:
        return not self.load_error and bool(self.outcomes) and all(o.status == "ok" for o in self.outcomes)

    @property
    def num_ok(self) -> int:
        return sum(o.status == "ok" for o in self.outcomes)

    def render(self, next_step: str = "", retry: str = "") -> str:
        """The report as the student reads it."""
        lines = [f"{self.title} -- checking {self.path}", ""]
        if self.load_error:
            return "\n".join(lines + [f"  your exercise does not load: {self.load_error}",
                                      "  fix that line and check again."])
        todo_shown: set[str] = set()
        for o in self.outcomes:
            label = f"{o.case.function} · {o.case.name}"
            if o.status == "todo":
                if o.case.function not in todo_shown:
                    todo_shown.add(o.case.function)
                    n = sum(x.case.function == o.case.function for x in self.outcomes)
                    lines.append(f"  todo  {o.case.function}: not written yet (it raises "
                                 f"NotImplementedError; {n} case{'s wait' if n != 1 else ' waits'} for it)")
                continue
            lines.append(f"  {'ok' if o.status == 'ok' else 'FAIL':<4}  {label}")
            lines += [f"        {line}" for line in o.lines]
        total = len(self.outcomes)
        lines.append("")
        if self.passed:
            lines.append(f"All {total} cases pass. {next_step}".rstrip())
        else:
            lines.append(f"{self.num_ok} of {total} cases pass. {retry}".rstrip())
        return "\n".join(lines)
