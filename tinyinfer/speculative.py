"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them in one pass.

This module is the policy only: what to guess (prompt n-grams, or a draft model's next-token
distribution) and which guesses to keep. The engine runs the models and owns their KV pages.

The target model computes logits at the last token and at every drafted token at once.
Walking the draft left to right, a drafted token d is accepted with probability
min(1, p(d) / q(d)) — p is the target's distribution, q the drafter's — and on the first
rejection a replacement is drawn from normalise(max(0, p − q)). If all k survive, one bonus
token is drawn from the target's last distribution. This makes the output distribution
exactly the target's (Leviathan et al. 2023; Chen et al. 2023); under greedy decoding it is
token-identical to plain greedy decoding. A step thus emits between 1 and k + 1 tokens for
one target forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable
from typing import Sequence as Seq

import numpy as np

from tinyinfer.errors import TinyInferError
from tinyinfer.model import Model
from tinyinfer.sampling import (
    MAX_LOGPROBS,
    TokenChoice,
    describe_choice,
    greedy_choice,
    is_plain_greedy,
    processed_probs,
    sample_from_probs,
)
from tinyinfer.scheduler import Sequence


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and the drafter's distribution q for each (None: q is one-hot)."""

    tokens: tuple[int, ...]
    probs: tuple[np.ndarray, ...] | None = None


class PromptLookupDrafter:
    """Guess by n-gram lookup: find the latest earlier occurrence of the last n tokens in the
    prompt and output, and propose what followed it. No second model; shines when the output
    copies from the input (editing, summarising with quotes, code)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise TinyInferError("prompt lookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(tuple(self.lookup(seq.all_ids, k))) for seq, k in zip(seqs, ks)]

    def lookup(self, ids: Seq[int], k: int) -> list[int]:
        """The k tokens that followed the most recent earlier match of the longest suffix n-gram."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(ids) <= n or k <= 0:
                continue
            suffix = list(ids[-n:])
            for start in range(len(ids) - n - 1, -1, -1):
                if list(ids[start:start + n]) == suffix:
                    return list(ids[start + n:start + n + k])
        return []


class DraftModelDrafter:
    """Guess with a small model that shares the target's tokenizer.

    The engine runs the draft model (on its own KV pages) one round per guess, batched over
    sequences, and asks ``guess`` to turn each round's logits into the next guessed token. When
    every sequence decodes plainly greedy, the guesses are the rounds' argmaxes, which stay on
    the device and feed the verification there, unless ``fixed_guesses`` names them first.
    """

    name = "draft"

    def __init__(self, model: Model):
        self.model = model

    def guess(self, seq: Sequence, guesses: list[int], logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The next guess after ``guesses``, from the draft's logits [V]: sampled from the draft's
        distribution q under the sequence's own sampling settings (greedy: q's argmax); and q."""
        q = processed_probs(logits, seq.params, seq.prompt_ids, seq.output_ids + guesses)
        token = int(np.argmax(q)) if seq.params.greedy else sample_from_probs(q, seq.rng)
        return token, q

    def fixed_guesses(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]] | None:
        """For sequences that decode plainly greedy (no penalties, no masks): the guesses, ks[i]
        for seqs[i], if the drafter decides them on the host (asked once the draft model's
        rounds are launched, before the verification is); None (a draft model's way) when they
        are the draft model's own argmaxes, reduced on the device, never a logits row on the
        host, and fed to the verification there before the host reads them. Verification of
        such a sequence needs no q either. The draft model still runs its rounds on its own
        argmaxes: fixed guesses change what is proposed, not what the draft model reads next."""
        return None


# What the engine accepts as a drafter: n-gram lookup, or a draft model it runs.
Drafter = PromptLookupDrafter | DraftModelDrafter


@dataclass
class Verification:
    """Outcome of checking one sequence's draft against the target."""

    choices: list[TokenChoice] = field(default_factory=list)  # tokens emitted, in order
    accepted: int = 0  # drafted tokens kept


def verify(logits: np.ndarray, draft: Draft, seq: Sequence,
           eos_token_id: int | None = None) -> Verification:
    """Apply the exact acceptance rule.  logits: [len(draft) + 1, V] target rows."""
    params, result = seq.params, Verification()
    history = list(seq.output_ids)
    if is_plain_greedy(params, len(history), MAX_LOGPROBS):
        return verify_greedy(lambda i: greedy_choice(logits[i], params), draft)
    for i, d in enumerate(draft.tokens):
        p = processed_probs(logits[i], params, seq.prompt_ids, history, eos_token_id=eos_token_id)
        q = _draft_probs(draft, i, p.size)
        if params.greedy:
            accept = int(np.argmax(p)) == d
        else:
            accept = seq.rng.random() < min(1.0, p[d] / q[d])
        if not accept:
            token = int(np.argmax(p)) if params.greedy else _resample(p, q, seq.rng)
            result.choices.append(describe_choice(logits[i], p, token, params))
            return result
        result.choices.append(describe_choice(logits[i], p, d, params))
        result.accepted += 1
        history.append(d)
    last = len(draft.tokens)
    p = processed_probs(logits[last], params, seq.prompt_ids, history, eos_token_id=eos_token_id)
    token = int(np.argmax(p)) if params.greedy else sample_from_probs(p, seq.rng)
    result.choices.append(describe_choice(logits[last], p, token, params))
    return result


def verify_greedy(choice_at: Callable[[int], TokenChoice], draft: Draft) -> Verification:
    """The acceptance rule for plain greedy decoding: keep guesses while each equals the
    target's own greedy choice at its position (``choice_at(i)``, for row i of the k + 1
    verified rows), then emit the target's choice where they first differ, or after the last.
    No distributions are needed, so the rows may come reduced to their top logits."""
    result = Verification()
    for i, d in enumerate(draft.tokens):
        choice = choice_at(i)
        result.choices.append(choice)
        if choice.token_id != d:
            return result
        result.accepted += 1
    result.choices.append(choice_at(len(draft.tokens)))
    return result


def _draft_probs(draft: Draft, i: int, vocab_size: int) -> np.ndarray:
    if draft.probs is not None:
        return draft.probs[i]
    q = np.zeros(vocab_size)
    q[draft.tokens[i]] = 1.0  # a deterministic guess
    return q


def _resample(p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> int:
    """Draw from normalise(max(0, p − q)): the mass the target has and the drafter lacked."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return sample_from_probs(residual / total if total > 0 else p, rng)


@dataclass
class SpeculativeStats:
    """Running totals: how well the drafter guesses and how many target passes it saves."""

    verify_steps: int = 0  # target forwards that checked a draft
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verify steps that turned a drafted token down (at most one each)
    emitted: int = 0  # tokens produced by those forwards
    draft_seconds: float = 0.0  # wall time drafting, in steps that verified a draft
    verify_seconds: float = 0.0  # wall time of those steps' target forwards
    step_seconds: float = 0.0  # wall time of those steps, start to end

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance(self) -> float:
        """The chance that a drafted token the target examined was kept: accepted / (accepted +
        rejected) — the per-token rate α of the closed form (drafts after a rejection are never
        examined, so acceptance_rate is lower)."""
        examined = self.accepted + self.rejected
        return self.accepted / examined if examined else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def forwards_saved(self) -> int:
        return self.emitted - self.verify_steps
