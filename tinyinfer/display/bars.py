"""Horizontal bars drawn with text, to an eighth of a cell: how commands and the TUI plot a sweep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(value: float, top: float, width: int) -> str:
    """`width` cells, the first value/top of them filled: full blocks, then an eighth-block tip."""
    eighths = round(8 * width * value / top) if top > 0 else 0
    return ("█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")).ljust(width)


@dataclass(frozen=True)
class BarColumn:
    """One plotted quantity of a sweep: its title, a value per row, and how a value is printed."""

    title: str
    values: Sequence[float]
    text: Callable[[float], str]


def bar_table(key: str, labels: Sequence[str], columns: Sequence[BarColumn], width: int,
              notes: Sequence[str] = ()) -> list[str]:
    """A header and one line per label: for each column a bar scaled to the column's largest
    value, then the value as text; labels right-aligned under `key`, notes at the line ends."""
    label_width = max(len(key), *(len(label) for label in labels))
    texts = [[c.text(v) for v in c.values] for c in columns]
    text_widths = [max(len(t) for t in column) for column in texts]
    header = f"{key:>{label_width}}" + "".join(
        f"  {c.title:<{width + 1 + w}}" for c, w in zip(columns, text_widths))
    lines = [header.rstrip()]
    for i, label in enumerate(labels):
        cells = "".join(f"  {bar(c.values[i], max(c.values), width)} {t[i]:>{w}}"
                        for c, t, w in zip(columns, texts, text_widths))
        note = notes[i] if i < len(notes) else ""
        lines.append(f"{label:>{label_width}}{cells}  {note}".rstrip())
    return lines
