"""Plain-text tables whose columns never run together: aligned, two spaces apart, a rule under
the header. Missing values (None, NaN) print as "–"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MISSING = "–"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows of values as right-aligned columns under their headers (first column left)."""
    cells = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def cell(value: Any) -> str:
    """A value as table text: floats to 3 significant digits (thousands grouped), None/NaN as –."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def human_bytes(n: float) -> str:
    """Bytes in decimal units (GB = 10^9 bytes, as datasheets and the claims use)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
