"""Tensor parallel: which rank owns which heads, MLP units and vocabulary rows, its slice of
every KV page, and how the last step's time split into computing and all-reducing."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.trace import PoolView, RankShare, StepTrace

from tui.panels.base import Panel
from tui.panels.metrics import human_bytes, ms

FLOW = "each layer: attention on own heads → all-reduce → MLP on own units → all-reduce"
ENDS = "embedding and LM head: own vocabulary rows; rank 0 gathers the logits and samples"
WAIT = "time in an all-reduce includes waiting for the slowest rank to arrive"
GAP = "  "
BAR = 12  # characters of the compute (█) / all-reduce (░) bar


def span(units: tuple[int, int]) -> str:
    """A [start, stop) range as the units it covers and their count: '2–3 (2)', '1 (1)'."""
    start, stop = units
    if stop <= start:
        return "none"
    return f"{start if stop - start == 1 else f'{start}–{stop - 1}'} ({stop - start})"


def rank_cells(pool: PoolView, rank: RankShare, trace: StepTrace | None,
               show_timings: bool) -> list[str]:
    """One table row: the heads it owns and its bytes of each page, its MLP units and vocabulary
    rows, and (maybe) its last step's times."""
    page = human_bytes(pool.page_bytes / len(pool.ranks)) if pool.page_bytes else "—"
    cells = [str(rank.rank), span(rank.heads), span(rank.kv_heads), page, span(rank.mlp_units),
             span(rank.vocab_rows)]
    if show_timings:
        timings = trace.rank_timings if trace is not None else {}
        compute = timings.get(f"rank{rank.rank}_compute")
        reduce = timings.get(f"rank{rank.rank}_all_reduce")
        cells += [ms(compute), ms(reduce), split_bar(compute, reduce)]
    return cells


def split_bar(compute: float | None, reduce: float | None) -> str:
    """The step's time as a bar: █ computing, ░ in all-reduces (empty before the first step)."""
    if compute is None or reduce is None or compute + reduce <= 0:
        return ""
    solid = round(BAR * compute / (compute + reduce))
    return "█" * solid + "░" * (BAR - solid)


class RanksPanel(Panel):
    """One row per rank of a model split over processes; only in tensor-parallel runs."""

    PANEL_ID = "ranks"
    TITLE = "Tensor parallel: who owns what"
    SWAPPABLE = True
    FEATURE = "tensor-parallel"
    BINDS = ("frame", "show_timings")

    show_timings: reactive[bool] = reactive(True)

    def table(self, pool: PoolView, trace: StepTrace | None) -> list[Text]:
        header = ["rank", "q heads", "KV heads", "KV/page", "MLP units", "vocab rows"]
        if self.show_timings:
            header += ["compute", "all-reduce", "█ compute ░ all-reduce"]
        rows = [rank_cells(pool, r, trace, self.show_timings) for r in pool.ranks]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

        def line(cells: list[str], style: str = "") -> Text:
            return Text(GAP.join(c.ljust(w) for c, w in zip(cells, widths)).rstrip(), style=style)

        return [line(header, "dim")] + [line(row) for row in rows]

    def render(self) -> Text:
        frame = self.frame
        pool = frame.pool if frame else None
        if frame is None or pool is None or not pool.ranks:
            return Text("This run is not split over processes.", style="dim")
        n = len(pool.ranks)
        whole = f" of each {human_bytes(pool.page_bytes)} page" if pool.page_bytes else " of each page"
        title = Text.assemble((f"{n} ranks", "bold"),
                              f" · each holds its KV heads' slice{whole}")
        last = frame.traces[-1] if frame.traces else None
        lines = [title, *self.table(pool, last), Text(FLOW, "italic"), Text(ENDS, "dim")]
        if self.show_timings:
            lines.append(Text(WAIT, "dim"))
        return Text("\n").join(lines)
