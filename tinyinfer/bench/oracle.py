"""A benchmark-only drafter whose acceptance rate is chosen rather than hoped for.

A real draft model's acceptance depends on how well its weights match the target's; random
weights of real shapes (the benchmark's presets) agree on almost nothing. To measure what
speculative decoding costs and gains at a given acceptance α, the oracle drafter runs a draft
model for its cost but proposes the target's own greedy continuation, each token replaced by
a wrong one with chance 1 − α. Under greedy verification the target then keeps each examined
draft token with chance α, as the closed form assumes.

The continuation comes from an earlier greedy run (``follow``): the benchmark first decodes
every prompt plainly, then once speculatively (untimed) and follows that run's tokens — the
target's tokens as verification computes them, which in bf16 may round differently from a
one-token decode step.

Whether the guess at an output position is right, and the wrong token it proposes otherwise,
are drawn once per followed prompt and position (seeded by the prompt's place in ``follow``),
not in the order the engine asks: the synchronous and the asynchronous engine, or one run
after another, meet the same corruptions, so their speeds compare at the same acceptances.
(Each position is examined once at most, so the draws stay independent with chance α.)
"""

from __future__ import annotations

import numpy as np

from tinyinfer.errors import TinyInferError
from tinyinfer.model import Model
from tinyinfer.scheduler import Sequence
from tinyinfer.speculative import DraftModelDrafter


class OracleDrafter(DraftModelDrafter):
    """Run ``model`` as the draft model (its cost), but propose the followed continuation with
    each token corrupted at rate 1 − acceptance (seeded)."""

    name = "oracle"

    def __init__(self, model: Model, acceptance: float, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise TinyInferError(f"the oracle's acceptance must be within [0, 1], got {acceptance}")
        super().__init__(model)
        self.acceptance = acceptance
        self.seed = seed
        self.rng = np.random.default_rng(seed)  # wrong tokens past what was followed
        # per followed prompt: its continuation, whether each position's guess is right, and
        # the wrong token each position proposes otherwise
        self.continuations: dict[tuple[int, ...], tuple[list[int], np.ndarray, np.ndarray]] = {}

    def follow(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """The greedy continuation of each prompt that later guesses propose, and the draws
        that decide each of its positions' guesses."""
        vocab = self.model.config.vocab_size
        self.continuations = {}
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            rng = np.random.default_rng([self.seed, i])
            self.continuations[tuple(prompt)] = (list(output), rng.random(len(output)) < self.acceptance,
                                                 rng.integers(vocab - 1, size=len(output)))

    def guess(self, seq: Sequence, guesses: list[int], logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The oracle's guess at this position, with q one-hot on it. The draft model's logits
        only cost."""
        token = self._guess(seq, len(seq.output_ids) + len(guesses))
        q = np.zeros(logits.shape[-1])
        q[token] = 1.0
        return token, q

    def fixed_guesses(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The oracle's greedy guesses, decided on the host while the draft model's rounds run
        (their argmaxes only cost)."""
        return [[self._guess(seq, len(seq.output_ids) + r) for r in range(k)] for seq, k in zip(seqs, ks)]

    def _guess(self, seq: Sequence, at: int) -> int:
        """The followed token at output position ``at``, or (chance 1 − acceptance, or past what
        was followed) another one."""
        known, keep, wrong = self.continuations.get(tuple(seq.prompt_ids), ([], None, None))
        if at >= len(known):
            return int(self.rng.integers(self.model.config.vocab_size))
        right = known[at]
        if keep[at]:
            return right
        return int(wrong[at] + (wrong[at] >= right))  # never `right`
