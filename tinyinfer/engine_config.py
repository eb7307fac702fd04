"""`EngineConfig`: every knob of the engine, and each default written once.

    Engine(model, config=EngineConfig(max_num_seqs=4))   # or, the same: Engine(model, max_num_seqs=4)

The page pool, the scheduler, the benchmarks and the command line read their defaults here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyinfer.errors import TinyInferError

# "none": no pool view in traces (benchmarks, serving); "basic": pool view and candidates;
# "full": also raw top logits and reference attention weights.
DETAIL_LEVELS = ("none", "basic", "full")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine batches, schedules and stores K/V."""

    page_size: int = 16  # tokens per KV page
    # The pool: num_pages pages, or (None) as many as kv_cache_memory pays for at the runner's
    # bytes per value, capped at max_num_seqs full contexts and never under one full context.
    num_pages: int | None = None
    kv_cache_memory: int = 256 * 1024 * 1024  # bytes
    max_num_seqs: int = 16  # sequences running at once
    # Tokens computed per step: a prompt longer than what is left of it is prefilled in chunks.
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    batching: str = "continuous"  # or "static": admit only when the whole batch has finished
    kv_allocation: str = "paged"  # or "contiguous": reserve a full context per sequence
    detail: str = "basic"  # one of DETAIL_LEVELS
    num_draft: int = 4  # tokens a drafter guesses per step (speculative decoding only)
    draft_num_pages: int = 512  # KV pages of a draft model, in pages of page_size tokens
    seed: int = 0  # seeds each request's sampler unless its SamplingParams has a seed
    # Prepare step N+1 on the host while the device runs step N (plain greedy decode steps; the
    # rest run one at a time). Off: each step() runs one whole step, as the TUI and lessons show.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.detail not in DETAIL_LEVELS:
            raise TinyInferError(f"detail must be one of {DETAIL_LEVELS}, not {self.detail}")
        if self.async_scheduling and self.detail != "none":
            raise TinyInferError(f"async_scheduling needs detail='none', not {self.detail!r}: while "
                                 "one step runs the pool already holds the next one's pages, so a "
                                 "step-by-step trace cannot show it (leave async_scheduling off to "
                                 "step through)")


DEFAULTS = EngineConfig()
