"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them in one pass.

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
from typing import Protocol, Sequence as Seq

import numpy as np

from tinyinfer.errors import TinyInferError
from tinyinfer.kv import PagePool
from tinyinfer.loading import Model
from tinyinfer.model.runner import make_batch
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


class Drafter(Protocol):
    """Anything that can guess a sequence's next tokens."""

    name: str

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] guessed tokens for each sequence (fewer, or none, is allowed)."""

    def rollback(self, seq: Sequence) -> None:
        """Forget any state beyond the tokens the target has accepted (seq.num_computed)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is gone: free everything the drafter keeps for it."""


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

    def rollback(self, seq: Sequence) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        return None


class DraftModelDrafter:
    """Guess with a small model that shares the target's tokenizer; it keeps its own KV pages."""

    name = "draft"

    def __init__(self, model: Model, num_pages: int = 512, block_size: int = 16):
        self.model = model
        self.pool = PagePool(num_pages, block_size, enable_prefix_caching=False)
        self.kv_cache = model.runner.new_kv_cache(num_pages, block_size)
        self.computed: dict[int, int] = {}  # seq_id -> tokens whose K/V the draft holds

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Run the draft model k times (batched over sequences), sampling each guess from q."""
        active = [i for i, (seq, k) in enumerate(zip(seqs, ks)) if k > 0 and self._reserve(seq, k)]
        tokens: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[np.ndarray]] = {i: [] for i in active}
        rounds = max((ks[i] for i in active), default=0)
        for r in range(rounds):
            live = [i for i in active if len(tokens[i]) < ks[i]]
            if not live:
                break
            feeds = []
            for i in live:
                seq, history = seqs[i], seqs[i].all_ids + tokens[i]
                start = self.computed[seq.seq_id]
                feeds.append((history[start:], start, self.pool.block_table(seq.seq_id), False))
                self.computed[seq.seq_id] = len(history)
            logits = self.model.runner.forward(make_batch(feeds, self.pool.block_size), self.kv_cache)
            for row, i in enumerate(live):
                seq = seqs[i]
                q = processed_probs(logits[row], seq.params, seq.prompt_ids, seq.output_ids + tokens[i])
                guess = int(np.argmax(q)) if seq.params.greedy else sample_from_probs(q, seq.rng)
                tokens[i].append(guess)
                probs[i].append(q)
        return [Draft(tuple(tokens[i]), tuple(probs[i])) if i in tokens else Draft(())
                for i in range(len(seqs))]

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Make room in the draft's pool for the sequence plus k guesses; False if it cannot."""
        if seq.seq_id not in self.computed:
            self.pool.add_sequence(seq.seq_id, seq.all_ids)
            self.computed[seq.seq_id] = 0
        needed = self.pool.pages_needed(seq.seq_id, seq.num_tokens + k)
        if not self.pool.can_allocate(needed):
            return False
        self.pool.ensure_capacity(seq.seq_id, seq.num_tokens + k)
        return True

    def rollback(self, seq: Sequence) -> None:
        if seq.seq_id in self.computed:
            keep = min(self.computed[seq.seq_id], seq.num_computed)
            self.computed[seq.seq_id] = keep
            self.pool.truncate(seq.seq_id, keep)

    def release(self, seq: Sequence) -> None:
        if self.computed.pop(seq.seq_id, None) is not None:
            self.pool.free(seq.seq_id)


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
        # Greedy: keep guesses while they equal the target's argmax (no distributions needed).
        for i, d in enumerate(draft.tokens):
            choice = greedy_choice(logits[i], params)
            result.choices.append(choice)
            if choice.token_id != d:
                return result
            result.accepted += 1
        result.choices.append(greedy_choice(logits[len(draft.tokens)], params))
        return result
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
    emitted: int = 0  # tokens produced by those forwards

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def forwards_saved(self) -> int:
        return self.emitted - self.verify_steps
