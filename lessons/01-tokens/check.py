"""Lesson 01 checker: your BPE against tiktoken, the library the engine's Tokenizer runs.

The ranks table is trained here, on held-out Shakespeare, so the check needs no model.
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from types import ModuleType

import numpy as np
import regex
import tiktoken

from lessons.checking import CaseFailed, Checklist, expect_close, expect_equal
from lessons.support import heldout_text
from tinyinfer.tokenizer import GPT2_PATTERN

checks = Checklist()


@cache
def ranks() -> dict[bytes, int]:
    """A byte-level BPE ranks table: 256 bytes, then 300 merges learned by pair counting."""
    table = {bytes([b]): b for b in range(256)}
    words = Counter(regex.findall(GPT2_PATTERN, heldout_text(6000)))
    split = {w: [w.encode()[i:i + 1] for i in range(len(w.encode()))] for w in words}
    for _ in range(300):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            parts = split[word]
            for pair in zip(parts, parts[1:]):
                pairs[pair] += count
        if not pairs:
            break
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        table.setdefault(a + b, len(table))
        for word, parts in split.items():
            i = 0
            while i < len(parts) - 1:
                if parts[i] == a and parts[i + 1] == b:
                    parts[i:i + 2] = [a + b]
                i += 1
    return table


@cache
def reference() -> tiktoken.Encoding:
    """The engine's tokenizer machinery (a tiktoken Encoding) over the same ranks."""
    return tiktoken.Encoding("lesson-01", pat_str=GPT2_PATTERN, mergeable_ranks=ranks(), special_tokens={})


def random_text(seed: int, words: int = 40) -> str:
    """Shakespeare words mixed with numbers, accents, dashes and odd spacing."""
    rng = np.random.default_rng(seed)
    vocab = heldout_text(3000).split() + ["1623", "naïve", "café", "—", "’tis", "\n\n", "   ", "Ω", "🙂"]
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), words))


def expect_tokens(got: list[int], want: list[int], what: str) -> None:
    """Compare token ids, showing each token's bytes so a wrong merge is visible."""
    try:
        expect_equal(got, want, what)
    except CaseFailed as failed:
        table = {rank: token for token, rank in ranks().items()}
        def spell(ids: list[int]) -> str:
            return "  ".join(f"{i}={table[i]!r}" if i in table else f"{i}=?" for i in ids)
        raise CaseFailed(failed.what, spell(want), spell(list(got)) if isinstance(got, list) else failed.got,
                         failed.detail) from None


def single_pieces(text: str) -> list[str]:
    """Pieces of text that the pre-tokenizer leaves whole when they stand alone."""
    return [p for p in regex.findall(GPT2_PATTERN, text) if regex.findall(GPT2_PATTERN, p) == [p]]


@checks.case("a few fixed pieces", "bpe_encode_piece",
             "start from single bytes; merge the adjacent pair whose joined bytes have the lowest rank")
def piece_fixed(ex: ModuleType) -> None:
    for piece in (" the", "And", " Macbeth", "Scotland", " thou", "!", "—"):
        expect_tokens(ex.bpe_encode_piece(piece.encode(), ranks()), reference().encode_ordinary(piece),
                     f"bpe_encode_piece({piece.encode()!r})")


@checks.case("200 random pieces (seed 1)", "bpe_encode_piece",
             "look at every adjacent pair and merge the one with the lowest rank, not the first one found "
             "(the leftmost on a tie); a piece that is itself a token is returned at once")
def piece_random(ex: ModuleType) -> None:
    for piece in single_pieces(random_text(1, 200)):
        expect_tokens(ex.bpe_encode_piece(piece.encode(), ranks()), reference().encode_ordinary(piece),
                     f"bpe_encode_piece({piece.encode()!r})")


@checks.case("a line of a play", "encode",
             "regex.findall(pattern, text) gives the pieces; BPE each one's UTF-8 bytes and concatenate")
def encode_fixed(ex: ModuleType) -> None:
    text = "MACBETH:\nSo foul and fair a day I have not seen.\n"
    expect_equal(ex.encode(text, ranks(), GPT2_PATTERN), reference().encode_ordinary(text),
                 f"encode({text!r})")


@checks.case("random texts with accents, emoji and odd spacing (seeds 2-6)", "encode",
             "encode each piece as UTF-8 bytes; characters such as 'é' or '🙂' are several bytes")
def encode_random(ex: ModuleType) -> None:
    for seed in range(2, 7):
        text = random_text(seed)
        expect_equal(ex.encode(text, ranks(), GPT2_PATTERN), reference().encode_ordinary(text),
                     f"encode of random text (seed {seed})")


@checks.case("decode(encode(text)) gives the text back", "decode",
             "invert ranks to find each id's bytes, join all bytes, then decode once")
def decode_roundtrip(ex: ModuleType) -> None:
    text = random_text(7)
    expect_equal(ex.decode(reference().encode_ordinary(text), ranks()), text, "decode of an encoded text")


SPLIT_CANDIDATES = "éïΩ—’🙂"  # characters of two to four UTF-8 bytes


def split_characters() -> list[str]:
    """Characters whose bytes the ranks table leaves in separate tokens (no merge joins them)."""
    return [c for c in SPLIT_CANDIDATES if len(reference().encode_ordinary(c)) > 1]


@checks.case("ids that cut a character in half", "decode",
             "join every token's bytes first, then decode once: one character's bytes can be split "
             "over two tokens, and decoding each token alone turns each half into '\ufffd'")
def decode_partial(ex: ModuleType) -> None:
    for c in split_characters():
        ids = reference().encode_ordinary(f"caf{c} au lait")  # the character spans two or more ids
        expect_equal(ex.decode(ids, ranks()), reference().decode(ids, errors="replace"), f"decode({ids})")
        half = reference().encode_ordinary(c)[:1] + reference().encode_ordinary(" and")  # its first byte only
        expect_equal(ex.decode(half, ranks()), reference().decode(half, errors="replace"), f"decode({half})")


@checks.case("ASCII and accented text", "chars_per_token",
             "len(text) counts characters; len(text.encode()) would count bytes")
def chars_fixed(ex: ModuleType) -> None:
    for text in ("To be, or not to be", "naïve café — déjà vu"):
        ids = reference().encode_ordinary(text)
        expect_close(ex.chars_per_token(text, ids), len(text) / len(ids), f"chars_per_token({text!r}, ...)")
