"""KV cache pages: the page pool as a grid, each page coloured by the sequence holding it."""

from __future__ import annotations

from rich.text import Text

from tinyinfer.trace import PoolView, StepTrace
from tui.palette import FREE, seq_color
from tui.panels.base import Panel

CELL = 3


def page_label(pool: PoolView, page: int) -> str:
    """What a page's cell says: its owner, ×n when shared, ○ cached but free, · free."""
    owners = pool.owners[page]
    if not owners:
        return "○" if page in pool.cached_pages else "·"
    if len(owners) > 1:
        return f"×{len(owners)}"
    return str(owners[0])


def events(trace: StepTrace) -> str:
    """The step's page traffic in words."""
    said = []
    if trace.pages_allocated:
        said.append(f"+{len(trace.pages_allocated)} allocated")
    if trace.pages_freed:
        said.append(f"{len(trace.pages_freed)} freed")
    if trace.prefix_hit_pages:
        said.append(f"{len(trace.prefix_hit_pages)} prefix hits")
    if trace.preempted:
        said.append("preempted " + ",".join(f"s{i}" for i in trace.preempted))
    return f"step {trace.step}: " + (", ".join(said) if said else "no page changes")


class PagesPanel(Panel):
    """Free, cached and owned pages, with allocation, freeing, prefix hits and preemption."""

    PANEL_ID = "pages"
    TITLE = "KV cache pages"

    def labels(self) -> list[str]:
        """Each page's cell label, in page order (what the grid shows)."""
        pool = self.frame.pool if self.frame else None
        return [] if pool is None else [page_label(pool, p) for p in range(pool.num_pages)]

    def cell(self, pool: PoolView, page: int, new: bool) -> Text:
        label = page_label(pool, page)
        owners = pool.owners[page]
        if not owners:
            style = FREE
        else:
            style = f"bold black on {seq_color(owners[0])}" + (" underline" if new else "")
        return Text(f"{label:^{CELL}}", style=style)

    def render(self) -> Text:
        frame = self.frame
        pool = frame.pool if frame else None
        if frame is None or pool is None:
            return Text("This trace records no page pool.", style="dim")
        trace = frame.trace
        new = set(trace.pages_allocated) if trace else set()
        out = Text.assemble((f"{pool.used}/{pool.num_pages} used", "bold"),
                            f" · {pool.cached} cached · {pool.page_size} tok/page")
        per_row = max(1, self.content_size.width // CELL)
        words = 4 if pool.ranks else 3  # lines around the grid: counts, events, legend, ranks
        room = max(1, self.content_size.height - words) * per_row
        for page in range(min(pool.num_pages, room)):
            if page % per_row == 0:
                out.append("\n")
            out.append_text(self.cell(pool, page, page in new))
        if pool.num_pages > room:
            out.append(f" +{pool.num_pages - room}", "dim")
        out.append("\n" + (events(trace) if trace else frame.note), "italic")
        out.append("\nN seq  ×n shared  ○ cached  · free", "dim")
        if pool.ranks:
            out.append(f"\npages split by KV head over {len(pool.ranks)} ranks", "dim")
        return out
