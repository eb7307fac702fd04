"""Timeline: one row per engine step, so a prefill (many tokens, one step) stands out from decodes."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.trace import SeqStep, StepTrace

from tui.palette import seq_color
from tui.panels.base import Panel, pack


def part_label(part: SeqStep) -> str:
    """A sequence's share of a step: `s0 pre 0:45` (positions 0..44), `s1 dec@47`, or a
    verified draft `s1 ver@47 3/4` (3 of 4 guesses accepted)."""
    if part.draft_tokens:
        return f"s{part.seq_id} ver@{part.start} {part.accepted}/{len(part.draft_tokens)}"
    if part.kind == "decode":
        return f"s{part.seq_id} dec@{part.start}"
    return f"s{part.seq_id} pre {part.start}:{part.end}"


class TimelinePanel(Panel):
    """Every step as a row: tokens computed (bar), the model's time, and who did what.

    A step's parts wrap under the "what" column rather than being cut: a step that mixes one
    sequence's prefill with the others' decodes is the point of continuous batching.
    """

    PANEL_ID = "timeline"
    TITLE = "Timeline"
    BINDS = ("frame", "show_timings")

    show_timings: reactive[bool] = reactive(True)

    def bar_width(self) -> int:
        return max(4, min(12, (self.content_size.width - 24) // 2))

    def row(self, trace: StepTrace, widest: int, current: bool) -> list[Text]:
        """The step's lines: the numbers, then its parts packed under the "what" column."""
        tokens = trace.num_batched_tokens
        width = self.bar_width()
        bar = max(1, round(width * tokens / widest)) if tokens else 0
        kind = "prefill" if trace.prefill_tokens else "decode"
        head = Text.assemble(
            (f"{trace.step:>3} ", "bold" if current else "dim"),
            (f"{'█' * bar:<{width}}", "#e5c07b" if kind == "prefill" else "#61afef"),
            (f"{tokens:>4}", ""),
        )
        if self.show_timings:
            head.append(f" {1e3 * trace.timings.get('forward', 0.0):6.1f}ms", "dim")
        parts = [Text(part_label(p), seq_color(p.seq_id)) for p in trace.seqs] or [Text("idle", "dim")]
        lines = pack([head, *parts], max(self.content_size.width, head.cell_len + 12), head.cell_len + 1)
        if current:
            for line in lines:
                line.stylize("reverse")
        return lines

    def render(self) -> Text:
        frame = self.frame
        if frame is None or not frame.traces:
            return Text("No steps yet: press space.", style="dim")
        header = Text.assemble(("  # ", "dim"), (f"{'tokens':<{self.bar_width()}}", "dim"), ("   n", "dim"),
                               (" fwd time" if self.show_timings else "", "dim"), (" what", "dim"))
        widest = max(1, max(t.num_batched_tokens for t in frame.traces))
        room = max(1, self.content_size.height - 1)
        shown: list[Text] = []
        for trace in reversed(frame.traces):  # the newest steps, whole, as many as fit
            lines = self.row(trace, widest, frame.trace is trace)
            if shown and len(shown) + len(lines) > room:
                break
            shown[:0] = lines
        return Text("\n").join([header, *shown[-room:]])
