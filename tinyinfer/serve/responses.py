"""Engine deltas → OpenAI response bodies and stream chunks, for completions and chat.

The two endpoints differ only in shape: `text` versus `message` / `delta`, and two logprob
layouts (the legacy `tokens` / `token_logprobs` lists versus chat's per-token objects).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Sequence

from tinyinfer.errors import TokenizerError
from tinyinfer.serve.loop import Delta, Usage
from tinyinfer.tokenizer import Tokenizer


def token_bytes(tokenizer: Tokenizer | None, token_id: int) -> bytes:
    """A token's bytes, or b"" for ids the tokenizer does not name (padding rows)."""
    if tokenizer is None:
        return b""
    try:
        return tokenizer.token_bytes(token_id)
    except TokenizerError:
        return b""


def usage_body(usages: Sequence[Usage], n: int) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once (not once per choice), every generated token."""
    firsts = usages[::n]  # choices are ordered prompt by prompt, n choices each
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)}}


class Shape:
    """What both endpoints share: ids, timestamps, the model name and the usage chunk."""

    object_name = ""
    chunk_object = ""
    id_prefix = ""
    input_field = ""  # the request field that holds the input (an error about it names it)

    def __init__(self, model: str, tokenizer: Tokenizer | None, n: int, num_choices: int,
                 want_logprobs: bool, fingerprint: str) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.n = n  # choices per prompt
        self.num_choices = num_choices  # prompts x n
        self.want_logprobs = want_logprobs
        self.fingerprint = fingerprint

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def _text(self, token_id: int) -> str:
        return token_bytes(self.tokenizer, token_id).decode("utf-8", errors="replace")

    def response(self, choices: Sequence[Sequence[Delta]]) -> dict[str, Any]:
        """The whole non-streamed answer: one choice per list of deltas."""
        body = self._envelope(self.object_name, [
            self.choice(i, "".join(d.text for d in deltas), deltas, deltas[-1].finish_reason)
            for i, deltas in enumerate(choices)])
        body["usage"] = usage_body([deltas[-1].usage for deltas in choices], self.n)  # type: ignore[misc]
        return body

    def usage_chunk(self, usages: Sequence[Usage]) -> dict[str, Any]:
        """The last stream chunk when stream_options.include_usage is set: no choices, usage."""
        return {**self._envelope(self.chunk_object, []), "usage": usage_body(usages, self.n)}

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any token (chat announces the assistant role)."""
        return []

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """One stream chunk for one delta, or None when it carries nothing to show."""
        if not delta.text and delta.finish_reason is None and not self.want_logprobs:
            return None
        return self._envelope(self.chunk_object, [
            self.chunk_choice(delta.index, delta.text, [delta], delta.finish_reason)])

    def choice(self, index: int, text: str, deltas: Sequence[Delta],
               finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, index: int, text: str, deltas: Sequence[Delta],
                     finish: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    """/v1/completions: choices carry `text` and legacy logprobs."""

    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    input_field = "prompt"

    def logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        """Legacy layout: parallel lists of token strings, logprobs, alternatives, offsets."""
        if not self.want_logprobs:
            return None
        tokens = [self._text(d.token_id) for d in deltas]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [d.logprob for d in deltas],
                "top_logprobs": [{self._text(t): lp for t, lp in d.top_logprobs} for d in deltas],
                "text_offset": offsets}

    def choice(self, index: int, text: str, deltas: Sequence[Delta],
               finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self.logprobs(deltas),
                "finish_reason": finish}

    chunk_choice = choice


class ChatShape(Shape):
    """/v1/chat/completions: choices carry a `message` (or a stream `delta`)."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    input_field = "messages"

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(self.tokenizer, token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    def logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        """Chat layout: one object per token with its bytes and its top alternatives."""
        if not self.want_logprobs:
            return None
        return {"content": [
            {**self._token(d.token_id, d.logprob),
             "top_logprobs": [self._token(t, lp) for t, lp in d.top_logprobs]}
            for d in deltas]}

    def choice(self, index: int, text: str, deltas: Sequence[Delta],
               finish: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(deltas), "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        return [self._envelope(self.chunk_object, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(self.num_choices)]

    def chunk_choice(self, index: int, text: str, deltas: Sequence[Delta],
                     finish: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self.logprobs(deltas), "finish_reason": finish}
