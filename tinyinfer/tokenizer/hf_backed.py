"""Every other tokenizer.json, run by the Hugging Face `tokenizers` library itself.

SentencePiece-style BPE (Llama-2, Mistral, TinyLlama: `▁` for spaces, `<0xNN>` tokens for
bytes the vocabulary lacks), byte-level BPE missing some bytes (SmolLM2), normalizers, Unigram,
WordPiece: tiktoken cannot run these exactly, the library that wrote them can.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import tokenizers

from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer.base import Tokenizer, check_text
from tinyinfer.tokenizer.convert import unbyte

# How the ByteFallback decoder recognises a byte token.
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HuggingFaceTokenizer(Tokenizer):
    """Text ⇄ token ids through a `tokenizers.Tokenizer`, as transformers' fast tokenizers."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_token_id: int | None,
                 name: str) -> None:
        self.name = name
        serialized = tokenizer.to_str()
        # Two copies: one reads special-token text as plain text, one parses it (the library
        # sets this per tokenizer, not per call). A tokenizer.json may ask for truncation or
        # padding; transformers turns both off unless a call asks, and so does tinyinfer.
        self._plain, self._parsing = (tokenizers.Tokenizer.from_str(serialized) for _ in "ab")
        self._plain.encode_special_tokens = True
        for copy in (self._plain, self._parsing):
            copy.no_truncation()
            copy.no_padding()
        vocab = self._plain.get_vocab(with_added_tokens=True)
        added = self._plain.get_added_tokens_decoder()
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.special_tokens = {token.content: i for i, token in sorted(added.items())
                               if token.special}
        decoders = _decoder_types(json.loads(serialized).get("decoder"))
        self._byte_level = "ByteLevel" in decoders
        self._added_ids = frozenset(added)
        self._byte_of: dict[int, int] = {}  # byte-fallback token id -> its byte
        if "ByteFallback" in decoders:
            for token, i in vocab.items():
                match = BYTE_TOKEN.fullmatch(token)
                if match:
                    self._byte_of[i] = int(match[1], 16)
        self.eos_token_id = None if eos_token_id is None else self.check_id(eos_token_id,
                                                                            "eos_token_id")

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        tokenizer = self._parsing if allow_special else self._plain
        return tokenizer.encode(check_text(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._plain.decode([self.check_id(i) for i in ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        index = self.check_id(token_id)
        if index in self._byte_of:
            return bytes([self._byte_of[index]])
        if self._byte_level and index not in self._added_ids:
            raw = unbyte(self._plain.id_to_token(index))
            if raw is not None:
                return raw
        # What the token adds after a token like itself: a decoder's start-of-text rules (the
        # SentencePiece leading-space strip) do not apply there.
        alone = self.decode([index])
        twice = self.decode([index, index])
        return (twice[len(alone):] if twice.startswith(alone) else alone).encode()

    def holds_back(self, token_id: int) -> bool:
        return token_id in self._byte_of

    def _names(self, index: int) -> bool:
        return self._plain.id_to_token(index) is not None


def _decoder_types(decoder: Any) -> set[str]:
    """The types of a tokenizer.json decoder and of the steps of a Sequence decoder."""
    if not isinstance(decoder, dict):
        return set()
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {step.get("type") for step in steps if isinstance(step, dict)}
