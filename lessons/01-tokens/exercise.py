"""Lesson 01 exercise: byte-pair encoding, the way the engine's tokenizer does it.

Fill in every function body (each now raises NotImplementedError), then run
`tinyinfer lesson check 01`. A ranks table maps token bytes to token ids: ids 0-255 are
the single bytes, and a lower id means an earlier (more frequent) merge.
"""

from __future__ import annotations

import regex  # like `re`, but understands \p{L} (any letter) in the pre-tokenizer pattern


def bpe_encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Token ids of one pre-tokenized piece, by repeatedly merging its lowest-ranked pair.

    If the whole piece is a token, return just that token. Otherwise start from single bytes
    and, while some adjacent pair (a, b) has a + b in ranks, merge the pair whose a + b has
    the lowest rank (the leftmost one on a tie). Return the ids of the parts that remain.
    """
    raise NotImplementedError


def encode(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """Token ids of text: split it into pieces with the pre-tokenizer regex, then BPE each piece.

    regex.findall(pattern, text) gives the pieces; encode each one as UTF-8 bytes.
    """
    raise NotImplementedError


def decode(ids: list[int], ranks: dict[bytes, int]) -> str:
    """Text of token ids: join the tokens' bytes, decode as UTF-8 (errors="replace").

    A token can end in the middle of a multi-byte character, so decode the joined bytes,
    not each token on its own.
    """
    raise NotImplementedError


def chars_per_token(text: str, ids: list[int]) -> float:
    """How many characters (not bytes) of text each token covers, on average."""
    raise NotImplementedError
