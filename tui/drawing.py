"""Plain text the panels, the narration and the comparisons draw alike (no Textual here):
token text made visible, weight names made short, errors as bars on one fixed scale."""

from __future__ import annotations

# Control characters as the symbols Unicode has for them (␀ ... ␟, ␡): a token's bytes must
# never reach the terminal as a control code. Line breaks and tabs get friendlier arrows.
VISIBLE = str.maketrans({**{chr(c): chr(0x2400 + c) for c in range(32)}, "\x7f": "␡",
                         "\n": "↵", "\t": "→"})
EIGHTHS = " ▏▎▍▌▋▊▉"
BAR_WIDTH = 12
FULL_SCALE = 0.16  # relative error of a full bar, the same at every precision (int4 ≈ 8-12 %)


def visible(text: str) -> str:
    """Token text with line breaks, tabs and other control characters drawn as symbols, so
    every token has a width and none acts on the terminal."""
    return text.translate(VISIBLE) or "∅"


def short_name(name: str) -> str:
    """'layers.3.gate.weight' -> '3.gate'."""
    return name.removeprefix("layers.").removesuffix(".weight")


def error_bar(relative: float, width: int = BAR_WIDTH, full: float = FULL_SCALE) -> str:
    """A bar on the fixed scale, to an eighth of a cell, so int8's 0.7 % is a sliver next to
    int4's 11 %; ▶ at the end when the error runs off the scale."""
    if relative > full:
        return "█" * (width - 1) + "▶"
    eighths = round(8 * width * relative / full)
    bar = "█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")
    return bar + " " * (width - len(bar))
