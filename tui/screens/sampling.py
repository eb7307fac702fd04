"""A dialog for exact sampling settings: temperature, top-k, top-p, min-p and max tokens."""

from __future__ import annotations

import dataclasses

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from tinyinfer import SamplingParams
from tinyinfer.errors import SamplingParamsError

FIELDS = (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float), ("max_tokens", int))


class SamplingScreen(ModalScreen[SamplingParams | None]):
    """Returns validated settings (for the preview and for new requests), or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, params: SamplingParams) -> None:
        super().__init__()
        self.params = params

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Sampling for the preview and for new requests", classes="dialog-title")
            for name, _ in FIELDS:
                yield Label(name.replace("_", " "))
                yield Input(str(getattr(self.params, name)), id=name)
            yield Label("enter: apply · escape: cancel", id="sampling-error", classes="hint")

    def on_input_submitted(self) -> None:
        try:
            values = {name: kind(self.query_one(f"#{name}", Input).value) for name, kind in FIELDS}
            self.dismiss(dataclasses.replace(self.params, **values))
        except (ValueError, SamplingParamsError) as exc:
            self.query_one("#sampling-error", Label).update(str(exc))

    def action_cancel(self) -> None:
        self.dismiss(None)
