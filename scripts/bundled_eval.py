"""Held-out measurements for the bundled models: bits per byte, perplexity, draft agreement."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM


@dataclass(frozen=True)
class TextScore:
    """Total next-token loss of a model over held-out text."""

    nats: float
    tokens: int
    bytes: int

    @property
    def bits_per_byte(self) -> float:
        """Tokenizer-independent: total nats / ln 2 / UTF-8 bytes."""
        return self.nats / math.log(2) / self.bytes

    @property
    def perplexity(self) -> float:
        """Per-token perplexity: exp(mean nats per token)."""
        return math.exp(self.nats / self.tokens)

    def as_dict(self) -> dict[str, float]:
        """The score and its derived metrics, for the results JSON."""
        return {
            "nats": self.nats,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "bits_per_byte": self.bits_per_byte,
            "perplexity": self.perplexity,
            "nats_per_token": self.nats / self.tokens,
        }


@torch.no_grad()
def score_work(model: LlamaForCausalLM, ids: list[int], eot_id: int, context: int) -> float:
    """Nats to predict every token of one work, after `<|endoftext|>`, with sliding windows.

    Windows of `context` tokens advance by half a window, so each token is predicted
    with at least half a window of history (the first tokens of the work excepted).
    """
    device = next(model.parameters()).device
    seq = torch.tensor([eot_id, *ids], device=device)
    stride = context // 2
    total = 0.0
    for first in range(1, seq.numel(), stride):
        end = min(first + stride, seq.numel())  # score targets seq[first:end]
        window = seq[max(0, end - 1 - context) : end - 1]
        logits = model(input_ids=window[None]).logits[0].float()  # [T, V]
        n = end - first
        total += F.cross_entropy(logits[-n:], seq[first:end], reduction="sum").item()
    return total


def score_works(
    model: LlamaForCausalLM, works_ids: list[list[int]], texts: list[str], eot_id: int, context: int
) -> TextScore:
    """Total loss over several held-out works."""
    nats = sum(score_work(model, ids, eot_id, context) for ids in works_ids)
    return TextScore(nats, sum(len(ids) for ids in works_ids), sum(len(t.encode("utf-8")) for t in texts))


def pick_prompts(works_ids: list[list[int]], count: int, length: int, room: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, evenly spaced in the works, each with `room` tokens after it."""
    per_work = [count // len(works_ids) + (i < count % len(works_ids)) for i in range(len(works_ids))]
    prompts = []
    for ids, n in zip(works_ids, per_work):
        last_start = len(ids) - length - room
        if last_start < 0:
            raise SystemExit(f"a held-out work of {len(ids)} tokens is too short for {length}+{room} tokens")
        prompts += [ids[(j * last_start) // max(1, n - 1) :][:length] for j in range(n)]
    return prompts


@torch.no_grad()
def greedy_continuations(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """The model's greedy continuation of each (equal-length) prompt: [P, new_tokens]."""
    device = next(model.parameters()).device
    seqs = torch.tensor(prompts, device=device)
    for _ in range(new_tokens):
        logits = model(input_ids=seqs).logits[:, -1]
        seqs = torch.cat([seqs, logits.argmax(-1, keepdim=True)], dim=1)
    return seqs[:, len(prompts[0]) :]


@torch.no_grad()
def draft_matches(draft: LlamaForCausalLM, prompts: list[list[int]], path: torch.Tensor) -> torch.Tensor:
    """Whether the draft's greedy next token equals the target's at each step of the target path: [P, N]."""
    device = next(draft.parameters()).device
    seqs = torch.cat([torch.tensor(prompts, device=device), path.to(device)], dim=1)
    plen = len(prompts[0])
    guesses = draft(input_ids=seqs[:, :-1]).logits[:, plen - 1 :].argmax(-1)
    return (guesses == path.to(device)).cpu()


def accepted_lengths(matches: torch.Tensor, k: int) -> list[int]:
    """Draft tokens accepted per verification under greedy speculative decoding with k drafts.

    Along the target's greedy path, a draft proposal i is accepted only if proposals 0..i-1
    were, and then it was made from exactly the target's prefix; so the draft's teacher-forced
    matches decide every round. Each round the target adds one token of its own after the
    accepted ones, so the next round starts `accepted + 1` tokens later.
    """
    counts = []
    for row in matches.tolist():
        pos = 0
        while pos < len(row) - k:
            accepted = 0
            while accepted < k and row[pos + accepted]:
                accepted += 1
            counts.append(accepted)
            pos += accepted + 1
    return counts


def speculative_agreement(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int, k: int
) -> dict[str, float]:
    """Greedy agreement of draft with target and the mean accepted length at `k` drafts per round."""
    path = greedy_continuations(target, prompts, new_tokens)
    matches = draft_matches(draft, prompts, path)
    counts = accepted_lengths(matches, k)
    return {
        "prompts": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "continuation_tokens": new_tokens,
        "greedy_agreement": matches.float().mean().item(),
        "k": k,
        "mean_accepted": sum(counts) / len(counts),
        "tokens_per_target_pass": 1 + sum(counts) / len(counts),
        "rounds": len(counts),
    }


@torch.no_grad()
def generate(
    model: LlamaForCausalLM, prompt: list[int], new_tokens: int, context: int, temperature: float, seed: int
) -> list[int]:
    """Continue a prompt greedily (temperature 0) or by sampling at `temperature`."""
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = list(prompt)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([seq[-context:]], device=device)).logits[0, -1].float().cpu()
        if temperature == 0:
            seq.append(int(logits.argmax()))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            seq.append(int(torch.multinomial(probs, 1, generator=gen)))
    return seq[len(prompt) :]
