"""Colours shared by the panels: each sequence keeps one colour everywhere on screen."""

from __future__ import annotations

SEQ_COLORS = ("#e06c75", "#61afef", "#98c379", "#e5c07b", "#c678dd", "#56b6c2", "#d19a66",
              "#be5046")
PROMPT_BACKGROUNDS = ("#3b4252", "#4c566a")  # alternate so token boundaries show
OUTPUT_BACKGROUNDS = ("#2e5234", "#3d6b45")
FREE = "#5c6370"


def seq_color(seq_id: int | None) -> str:
    """The colour of a sequence; grey until the engine has given it an id."""
    return FREE if seq_id is None else SEQ_COLORS[seq_id % len(SEQ_COLORS)]
