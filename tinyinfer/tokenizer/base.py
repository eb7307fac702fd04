"""The Tokenizer interface every part of tinyinfer uses, and streaming decode over it.

Two implementations: `TiktokenTokenizer` (byte-level BPE run by tiktoken: the bundled model,
GPT-2, Llama-3 style) and `HuggingFaceTokenizer` (any tokenizer.json, run by the Hugging Face
`tokenizers` library itself). Callers see only this class.
"""

from __future__ import annotations

import numbers
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from tinyinfer.errors import TokenizerError


class Tokenizer(ABC):
    """Text ⇄ token ids for one model."""

    name: str
    vocab_size: int  # ids run 0..vocab_size-1; a vocabulary may leave some unused
    eos_token_id: int | None
    special_tokens: dict[str, int]  # added tokens marked special (BOS, EOS, role markers): text -> id

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_token_id={self.eos_token_id})")

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``, without a BOS or any token the text does not spell.

        ``allow_special=False`` (the default, for user text): a special token's text, such as
        ``<|im_start|>``, is encoded as plain text, as transformers does with
        ``split_special_tokens=True``. ``allow_special=True`` (for text a chat template wrote):
        it becomes the special token, as transformers' default. Added tokens not marked special
        are matched in both cases, as in transformers.
        """

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included; bytes that are not UTF-8 become U+FFFD."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to a text, for UIs and logprobs that show tokens one by one.

        A token may end in the middle of a UTF-8 character. A word-start token of a
        SentencePiece vocabulary (``▁the``) reads as inside a text: `` the``.
        """

    @abstractmethod
    def _names(self, index: int) -> bool:
        """Whether ``index`` (in 0..vocab_size-1) is the id of a token."""

    def holds_back(self, token_id: int) -> bool:
        """Whether a stream must wait for the next token before showing this one's text.

        True for a byte-fallback token (``<0xE6>``): a run of them decodes together, so the
        run's text is settled only where it ends.
        """
        return False

    def generated_bytes(self, token_id: int) -> bytes:
        """Bytes of a token a model generated; b"" for ids the vocabulary lacks.

        Checkpoints often pad the embedding beyond the tokenizer (Qwen2: 151936 rows, 151665
        tokens): a sampled padding id has no text rather than being an error mid-stream.
        """
        return b"" if self.is_padding(token_id) else self.token_bytes(token_id)

    def is_padding(self, token_id: Any) -> bool:
        """True for a non-negative id that names no token; TokenizerError for any other non-id."""
        try:
            self.check_id(token_id)
        except TokenizerError:
            if isinstance(token_id, numbers.Integral) and token_id >= 0:
                return True
            raise
        return False

    def check_id(self, token_id: Any, what: str = "token id") -> int:
        """``token_id`` as an int, or TokenizerError unless it names a token of this vocabulary."""
        try:
            index = operator.index(token_id)
        except TypeError:
            index = -1
        if not (0 <= index < self.vocab_size and self._names(index)):
            raise TokenizerError(
                f"{what} {token_id!r} is not a token of {self.name!r} "
                f"(vocabulary of {self.vocab_size} ids, 0..{self.vocab_size - 1})")
        return index


def check_text(text: Any) -> str:
    """``text`` if it is a str; TokenizerError otherwise."""
    if not isinstance(text, str):
        raise TokenizerError(f"can only encode str, got {type(text).__name__}")
    return text


class IncrementalDecoder:
    """Turns a stream of token ids into text, showing each piece once it is settled.

    The pieces add up to the text that decoding the whole sequence (``context`` and every id
    pushed; padding ids have no text) adds after ``context``'s own text. Each push decodes a
    short window again: the last token already shown (or of the context), then the newer ones.
    Where the window's text ends in U+FFFD (bytes of a character split over tokens) or its last
    token is held back (a byte-fallback run), nothing is shown yet. Decoding the window as a
    whole, rather than token by token, keeps the rules of the decoders language models ship:
    bytes joined into characters, and a SentencePiece decoder's leading-space strip only at the
    start of the sequence (a generation continuing a prompt keeps its first word's space, as
    vLLM's does).
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        """A stream that continues ``context`` (a prompt's ids), of which nothing is shown."""
        self._tokenizer = tokenizer
        self._window: list[int] = []  # the last token shown or of the context, then newer ones
        self._shown = ""  # the text of the window's first token, already shown
        if context:
            last = context[-1]
            if not (tokenizer.is_padding(last) or tokenizer.holds_back(last)):
                shown = tokenizer.decode([last])
                if not shown.endswith("\ufffd"):  # else the stream starts afresh
                    self._window, self._shown = [int(last)], shown

    def push(self, token_id: int) -> str:
        """Text settled by this token ("" while it may still change)."""
        if self._tokenizer.is_padding(token_id):
            return ""
        self._window.append(int(token_id))
        if self._tokenizer.holds_back(token_id):
            return ""
        text = self._tokenizer.decode(self._window)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self._shown):]
        self._window = self._window[-1:]
        self._shown = self._tokenizer.decode(self._window)
        return piece

    def flush(self) -> str:
        """End of stream: whatever is held back (an unfinished character shown as U+FFFD)."""
        text = self._tokenizer.decode(self._window)[len(self._shown):] if self._window else ""
        self._window, self._shown = [], ""
        return text
