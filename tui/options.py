"""How the TUI was asked to start: the command line's choices as one value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tinyinfer.cli.args import check_draft_quantize
from tinyinfer.errors import TinyInferError
from tinyinfer.model import BUNDLED

from tui.scenarios import SCENARIOS


@dataclass(frozen=True)
class Options:
    """Launch settings (see `tinyinfer tui --help`)."""

    model: str = "bundled"
    runner: str = "numpy"
    device: str | None = None
    tensor_parallel: int = 1  # processes the model is split over (torch runner)
    scenario: str = "single"
    speculative: bool = False  # start with speculative decoding on (the speculative scenario does)
    drafter: str | None = None  # "draft", "lookup"; None: a draft model if there is one, else lookup
    draft_model: str | None = None  # None: bundled-draft (with the bundled model, or drafter "draft")
    num_draft: int = 4
    draft_quantize: str | None = None  # the draft model's weight format (None: as saved)
    draft_quantize_head: bool = False  # its embedding and LM head in that format too
    quantize: str | None = None  # weight format to load with (int8, int4, ...); None: the scenario's
    kv_cache_dtype: str = "auto"  # K/V storage: "auto" (the compute dtype) or "int8"
    replay: Path | None = None
    record: Path | None = None
    seed: int = 0
    walkthrough: bool = True  # narration on; False is free mode
    show_timings: bool = True  # off for deterministic screenshots
    run_interval: float = 0.25  # seconds between steps while running

    def draft_model_name(self) -> str | None:
        """The draft model speculative decoding runs: --draft-model, else bundled-draft beside the
        bundled model (or with --speculative draft); None where it drafts by prompt lookup."""
        if self.drafter == "lookup":
            return None
        if self.draft_model is not None:
            return self.draft_model
        if self.drafter == "draft" or self.model == "bundled" and BUNDLED["bundled-draft"].is_dir():
            return "bundled-draft"
        return None

    def check(self) -> None:
        """Refuse settings that do not combine, before anything loads."""
        check_draft_quantize(self.draft_quantize, self.draft_quantize_head, self.draft_model_name() is not None,
                             "drop --speculative lookup" if self.drafter == "lookup" else
                             "give --draft-model (without one, this model drafts by prompt lookup)")
        if self.tensor_parallel == 1:
            return
        if self.replay is not None:
            raise TinyInferError("--replay shows a recorded run without loading a model: drop "
                                 "--tensor-parallel (a recorded tensor-parallel run shows its "
                                 "ranks anyway)")
        if self.runner != "torch":
            raise TinyInferError("--tensor-parallel runs the torch runner on every rank: drop "
                                 f"--runner {self.runner}")
        if self.quantize is not None or SCENARIOS[self.scenario].quantize is not None:
            raise TinyInferError("tensor parallelism splits float weights only: drop --quantize and "
                                 "the quantization scenario, or run them without --tensor-parallel")
