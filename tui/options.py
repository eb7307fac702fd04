"""How the TUI was asked to start: the command line's choices as one value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Options:
    """Launch settings (see `tinyinfer tui --help`)."""

    model: str = "bundled"
    runner: str = "numpy"
    device: str | None = None
    scenario: str = "single"
    speculative: bool = False  # start with speculative decoding on (the speculative scenario does)
    draft_model: str | None = None  # None: bundled-draft for the bundled model, else prompt lookup
    num_draft: int = 4
    quantize: str | None = None  # weight format to load with (int8, int4, ...); None: the scenario's
    replay: Path | None = None
    record: Path | None = None
    seed: int = 0
    walkthrough: bool = True  # narration on; False is free mode
    show_timings: bool = True  # off for deterministic screenshots
    run_interval: float = 0.25  # seconds between steps while running
