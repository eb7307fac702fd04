"""Prompt & tokens: each request's text cut into tokens, generated tokens appended live."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tui.drawing import visible
from tui.frames import SeqView
from tui.palette import OUTPUT_BACKGROUNDS, PROMPT_BACKGROUNDS, seq_color
from tui.panels.base import Panel

def status(seq: SeqView) -> str:
    """A sequence's state in a few words."""
    if seq.state == "finished":
        return f"finished ({seq.finish_reason})"
    if seq.state == "waiting":
        return "waiting" + (f", preempted ×{seq.preemptions}" if seq.preemptions else "")
    if seq.prompt_len is not None and seq.computed < seq.prompt_len:
        return f"prefill {seq.computed}/{seq.prompt_len}"
    return "decoding"


class TokensPanel(Panel):
    """Tokens in alternating colours (prompt grey, output green); ids instead of text on toggle."""

    PANEL_ID = "tokens"
    TITLE = "Prompt & tokens"
    BINDS = ("frame", "show_ids", "focus_seq")

    show_ids: reactive[bool] = reactive(False)
    focus_seq: reactive[int | None] = reactive(None)

    def token_line(self, seq: SeqView) -> Text:
        """All of a sequence's tokens as one styled line; this step's positions underlined."""
        trace = self.frame.trace if self.frame else None
        fresh = [range(p.start, p.end) for p in (trace.seqs if trace else ()) if p.seq_id == seq.seq_id]
        line = Text()
        if not seq.prompt and seq.prompt_len:
            line.append(f"[{seq.prompt_len} prompt tokens: not in the trace] ", style="dim italic")
        tokens = [(t, PROMPT_BACKGROUNDS) for t in seq.prompt] + [(t, OUTPUT_BACKGROUNDS) for t in seq.output]
        offset = 0 if seq.prompt else (seq.prompt_len or 0)
        for i, (token, backgrounds) in enumerate(tokens):
            style = f"on {backgrounds[i % 2]}"
            if any(i + offset in r for r in fresh):
                style += " underline"
            piece = f"{token.token_id} " if self.show_ids else visible(token.text)
            line.append(piece, style=style)
        return line

    def render(self) -> Text:
        frame = self.frame
        if frame is None or not frame.seqs:
            return Text("No requests yet.", style="dim")
        width = max(8, self.content_size.width)
        per_seq = max(2, self.content_size.height // len(frame.seqs))
        focused = frame.focus(self.focus_seq)
        out = Text()
        for seq in frame.seqs:
            mark = "▶" if focused is seq else "●"
            header = Text.assemble((f"{mark} {seq.label} ", f"bold {seq_color(seq.seq_id)}"),
                                   (status(seq), "dim"))
            out.append_text(header)
            lines = self.token_line(seq).wrap(self.app.console, width)
            keep = per_seq - 1
            if len(lines) > keep:
                lines = lines[len(lines) - keep:]
                lines[0] = Text("…") + lines[0][1:]
            for line in lines:
                out.append("\n")
                out.append_text(line)
            out.append("\n")
        out.rstrip()
        return out
