"""Quantization: each linear weight's rounding error at the running precision, and one histogram."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.model import Model
from tinyinfer.quant import Histogram, LayerError
from tui.drawing import FULL_SCALE, error_bar, short_name
from tui.panels.base import Panel, pack, sentence
from tui.session import precision_of

PRECISIONS = ("fp32", "int8", "int4")  # the m key cycles through these
SPARK = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class QuantReport:
    """What tinyinfer.quant measured for one model at one precision; no errors for fp32."""

    precision: str  # "fp32" or a QuantConfig name
    errors: tuple[LayerError, ...] = ()
    histograms: tuple[tuple[Histogram, Histogram], ...] = ()  # (weights, errors) per layer
    note: str = ""  # why nothing was measured, when that is the case


def report_of(model: Model) -> QuantReport:
    """The per-layer errors and histograms measured when the model was quantized at load.

    They ride on the Model (`Model.quant_errors`, from `tinyinfer.load(..., measure_error=True)`),
    which the screen holds already: the panel reads no checkpoint and quantizes nothing.
    """
    precision = precision_of(model)
    if model.quantization is None:
        return QuantReport(precision)
    if model.quant_errors is None:
        return QuantReport(precision, note="No float weights to compare with: this checkpoint "
                                           "was saved quantized (or loaded without measure_error).")
    return QuantReport(precision, model.quant_errors.layers, model.quant_errors.histograms)


def sparkline(hist: Histogram) -> str:
    """One character per bin, its height the bin's count (linear, tallest bin = █)."""
    top = max(hist.counts) or 1
    return "".join(" " if c == 0 else SPARK[min(len(SPARK) - 1, c * len(SPARK) // (top + 1))]
                   for c in hist.counts)


def next_precision(current: str) -> str:
    """The precision the m key switches to: fp32 → int8 → int4 → fp32."""
    family = "int4" if current.startswith("int4") else current
    i = PRECISIONS.index(family) if family in PRECISIONS else -1
    return PRECISIONS[(i + 1) % len(PRECISIONS)]


class QuantizationPanel(Panel):
    """Relative error ‖W−Ŵ‖/‖W‖ of every linear weight as bars; histograms of the chosen one."""

    PANEL_ID = "quantization"
    TITLE = "Quantization"
    SWAPPABLE = True
    FEATURE = "quantization"
    BINDS = ("frame", "quant_report", "quant_layer")

    quant_report: reactive[QuantReport | None] = reactive(None)
    quant_layer: reactive[int] = reactive(0)

    def render(self) -> Text:
        report = self.quant_report
        if report is None:
            return sentence("Measuring the rounding error of every linear weight …", self.content_size.width)
        out = Text(f"weights {report.precision}", style="bold")
        if report.note:
            out.append(f"\n{report.note}", "dim")
            return out
        if not report.errors:
            out.append("  (as trained: no rounding)\nm quantizes the running model to "
                       f"{next_precision(report.precision)} and starts the prompt again.", "dim")
            return out
        errors = report.errors
        chosen = self.quant_layer % len(errors)
        mean = sum(e.relative for e in errors) / len(errors)
        width = max(20, self.content_size.width)
        lines = pack([out, Text(f"· mean ‖W−Ŵ‖/‖W‖ {100 * mean:.2f}%"),
                      Text(f"(bar 0–{100 * FULL_SCALE:.0f}%)", "dim")], width, 2)
        weights, errs = report.histograms[chosen]
        e = errors[chosen]
        below = [Text(f"{short_name(e.name)} (j/J) max |err| {e.max_abs:.2g}", "dim"),
                 Text(f"W   {sparkline(weights)} ±{max(abs(weights.edges[0]), abs(weights.edges[-1])):.2g}"),
                 Text(f"err {sparkline(errs)} ±{max(abs(errs.edges[0]), abs(errs.edges[-1])):.2g}")]
        rows = max(1, self.content_size.height - len(lines) - len(below))
        first = min(max(0, chosen - rows // 2), max(0, len(errors) - rows))
        name_width = max(len(short_name(e.name)) for e in errors)
        for i in range(first, min(len(errors), first + rows)):
            e = errors[i]
            lines.append(Text.assemble(
                ("▶" if i == chosen else " "), (f"{short_name(e.name):<{name_width}} ", "bold" if i == chosen else ""),
                (error_bar(e.relative), "magenta"), f" {100 * e.relative:5.2f}%"))
        return Text("\n").join(lines + below)
