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
        self.rng = np.random.default_rng(seed)
        self.continuations: dict[tuple[int, ...], list[int]] = {}

    def follow(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        """The greedy continuation of each prompt that later guesses propose."""
        self.continuations = {tuple(p): list(o) for p, o in zip(prompts, outputs)}

    def guess(self, seq: Sequence, guesses: list[int], logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The oracle's guess at this position, with q one-hot on it. The draft model's logits
        only cost."""
        token = self._guess(seq, len(seq.output_ids) + len(guesses))
        q = np.zeros(logits.shape[-1])
        q[token] = 1.0
        return token, q

    def fixed_guesses(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The oracle's greedy guesses, decided on the host while the draft model's rounds run
        (their argmaxes only cost), drawn round by round across the sequences, as the rounds
        run."""
        guesses: list[list[int]] = [[] for _ in seqs]
        for r in range(max(ks, default=0)):
            for seq, k, own in zip(seqs, ks, guesses):
                if k > r:
                    own.append(self._guess(seq, len(seq.output_ids) + r))
        return guesses

    def _guess(self, seq: Sequence, at: int) -> int:
        """The followed token at output position ``at``, or (chance 1 − acceptance, or past what
        was followed) another one."""
        vocab = self.model.config.vocab_size
        known = self.continuations.get(tuple(seq.prompt_ids), [])
        right = known[at] if at < len(known) else None
        if right is not None and self.rng.random() < self.acceptance:
            return right
        wrong = int(self.rng.integers(vocab - 1))
        return wrong if right is None or wrong < right else wrong + 1  # never `right`
