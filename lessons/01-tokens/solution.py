"""Lesson 01 solution (for teachers): byte-pair encoding the way tiktoken does it."""

from __future__ import annotations

import regex


def bpe_encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Token ids of one pre-tokenized piece, by repeatedly merging its lowest-ranked pair."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best, best_rank = i, rank
        if best < 0:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


def encode(text: str, ranks: dict[bytes, int], pattern: str) -> list[int]:
    """Token ids of text: split it into pieces with the pre-tokenizer regex, then BPE each piece."""
    ids: list[int] = []
    for piece in regex.findall(pattern, text):
        ids += bpe_encode_piece(piece.encode("utf-8"), ranks)
    return ids


def decode(ids: list[int], ranks: dict[bytes, int]) -> str:
    """Text of token ids: join the tokens' bytes, decode as UTF-8 (errors="replace")."""
    token_bytes = {rank: token for token, rank in ranks.items()}
    return b"".join(token_bytes[i] for i in ids).decode("utf-8", errors="replace")


def chars_per_token(text: str, ids: list[int]) -> float:
    """How many characters (not bytes) of text each token covers, on average."""
    return len(text) / len(ids)
