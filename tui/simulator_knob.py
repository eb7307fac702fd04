"""A numeric knob of the simulator: type a value, or step it with ↑/↓ like a slider."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input


class NumberKnob(Input):
    """An Input for one Scenario field; ↑/↓ multiply by `factor` or add `step`, within limits.

    An optional knob may be left empty: it then means its placeholder (e.g. the preset's price).
    """

    BINDINGS = [Binding("up", "nudge(1)", "step up", key_display="↑"),
                Binding("down", "nudge(-1)", "step down", key_display="↓")]

    def __init__(self, field: str, value: int | float | None, *, integer: bool, low: float,
                 high: float | None = None, factor: float = 1.0, step: float = 0.0,
                 placeholder: str = "") -> None:
        super().__init__("" if value is None else self.format(value, integer), placeholder=placeholder,
                         id=f"knob-{field}", compact=True, select_on_focus=False)
        self.field, self.integer, self.low, self.high = field, integer, low, high
        self.factor, self.step = factor, step

    @staticmethod
    def format(value: int | float, integer: bool) -> str:
        """The text a value shows as: whole numbers for counts, two decimals otherwise."""
        return str(int(value)) if integer else f"{value:.2f}"

    def reading(self) -> int | float | None:
        """The knob's value; None when an optional knob is empty. Raises ValueError saying why not."""
        text = self.value.strip()
        if not text and self.placeholder:
            return None
        kind, noun = (int, "a whole number") if self.integer else (float, "a number")
        try:
            number = kind(text)
        except ValueError:
            raise ValueError(f"{self.field}: {text!r} is not {noun}") from None
        if number < self.low or (self.high is not None and number > self.high):
            limit = f"between {self.low:g} and {self.high:g}" if self.high is not None else f"at least {self.low:g}"
            raise ValueError(f"{self.field} must be {limit}, got {text}")
        return number

    def action_nudge(self, direction: int) -> None:
        """Step the value up (1) or down (-1), clamped to the knob's limits."""
        try:
            current = self.reading()
            if current is None:
                current = float(self.placeholder)
        except ValueError:
            self.app.bell()
            return
        moved = current * self.factor ** direction if self.factor != 1 else current + direction * self.step
        moved = max(self.low, moved if self.high is None else min(self.high, moved))
        self.value = self.format(round(moved) if self.integer else round(moved, 4), self.integer)
        self.cursor_position = len(self.value)
