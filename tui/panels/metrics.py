"""Metrics: TTFT, TPOT, tokens/s, pages in use, KV memory and the prefix-cache hit rate.

Times are engine time summed from the step traces, so the seconds a learner spends reading
between steps do not count.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tinyinfer.trace import StepTrace

from tui.frames import Frame, SeqView
from tui.panels.base import Panel, pack


def step_seconds(trace: StepTrace) -> float:
    return sum(trace.timings.values())


def ttft(frame: Frame, seq: SeqView) -> float | None:
    """Engine time from a request's arrival to its first token."""
    if seq.first_token_step is None:
        return None
    return sum(step_seconds(t) for t in frame.traces[seq.arrival_step:seq.first_token_step])


def tpot(frame: Frame, seq: SeqView) -> float | None:
    """Mean engine time per output token after the first."""
    if seq.first_token_step is None or len(seq.output) < 2:
        return None
    last = max(t.step for t in frame.traces if any(p is seq.samples[-1] for p in t.seqs))
    return sum(step_seconds(t) for t in frame.traces[seq.first_token_step:last]) / (len(seq.output) - 1)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1e3 * seconds:.1f}ms"


class MetricsPanel(Panel):
    """Counts always; times only when timings are shown (tests and snapshots hide them)."""

    PANEL_ID = "metrics"
    TITLE = "Metrics"
    SWAPPABLE = True
    BINDS = ("frame", "show_timings", "kv_bytes_per_page")

    show_timings: reactive[bool] = reactive(True)
    kv_bytes_per_page: reactive[int | None] = reactive(None)

    def lines(self, frame: Frame) -> list[Text]:
        traces = frame.traces
        states = [s.state for s in frame.seqs]
        out = [
            Text(f"{len(traces)} steps · {sum(t.prefill_tokens for t in traces)} prefill + "
                 f"{sum(t.decode_tokens for t in traces)} decode"),
            Text(f"running {states.count('running')} · waiting {states.count('waiting')} · "
                 f"finished {states.count('finished')}"),
        ]
        width = max(20, self.content_size.width)
        if self.show_timings:
            started = [s for s in frame.seqs if s.first_token_step is not None]
            firsts = [Text(f"s{s.seq_id} {ms(ttft(frame, s))}") for s in started] or [Text("—")]
            out += pack([Text("TTFT"), *firsts], width, 5)
            tpots = [x for x in (tpot(frame, s) for s in started) if x is not None]
            engine = sum(step_seconds(t) for t in traces)
            made = sum(len(s.output) for s in frame.seqs)
            rate = f"{made / engine:.0f} tok/s" if engine else "—"
            out.append(Text(f"TPOT {ms(sum(tpots) / len(tpots) if tpots else None)} · {rate}"))
        else:
            out.append(Text("times hidden (--no-timings)", style="dim"))
        pool = frame.pool
        if pool is not None:
            memory = (f" · KV {human_bytes(pool.used * self.kv_bytes_per_page)}"
                      if self.kv_bytes_per_page else "")
            out.append(Text(f"pages {pool.used}/{pool.num_pages} in use{memory}"))
        admitted = [s for s in frame.seqs if s.seq_id is not None and s.prompt_len]
        prompt = sum(s.prompt_len or 0 for s in admitted)
        hits = sum(s.cached_tokens for s in admitted)
        if prompt:
            out.append(Text(f"prefix hits {hits}/{prompt} prompt tok ({100 * hits / prompt:.0f}%)"))
        trace = frame.trace
        if self.show_timings and trace is not None:
            stages = [Text(f"{k} {ms(v)}", style="dim") for k, v in trace.timings.items()]
            out += pack([Text("this step:", style="dim"), *stages], width, 2)
        return out

    def render(self) -> Text:
        if self.frame is None:
            return Text("")
        return Text("\n").join(self.lines(self.frame)[: max(1, self.content_size.height)])
