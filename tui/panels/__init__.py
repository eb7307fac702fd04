"""The panels of the run screen, in layout order. Adding a panel is one module and one line here."""

from __future__ import annotations

from tui.panels.attention import AttentionPanel
from tui.panels.base import Panel
from tui.panels.metrics import MetricsPanel
from tui.panels.next_token import NextTokenPanel
from tui.panels.pages import PagesPanel
from tui.panels.quantization import QuantizationPanel
from tui.panels.ranks import RanksPanel
from tui.panels.speculative import SpeculativePanel
from tui.panels.timeline import TimelinePanel
from tui.panels.tokens import TokensPanel

PANELS: tuple[type[Panel], ...] = (
    TokensPanel, PagesPanel, NextTokenPanel, AttentionPanel, MetricsPanel, SpeculativePanel,
    QuantizationPanel, TimelinePanel, RanksPanel,
)

__all__ = ["PANELS", "Panel"]
