"""The fast path: byte-level BPE run by tiktoken, and tiktoken's own rank files."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from pathlib import Path

import tiktoken

from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer.base import Tokenizer, check_text
from tinyinfer.tokenizer.convert import check_ranks


class TiktokenTokenizer(Tokenizer):
    """Text ⇄ token ids for one model: a checked layer over a tiktoken.Encoding."""

    def __init__(self, encoding: tiktoken.Encoding, eos_token_id: int | None, name: str, *,
                 text_tokens: Iterable[str] = ()) -> None:
        """Wrap ``encoding``; ``text_tokens`` are added tokens matched inside ordinary text."""
        self.encoding = encoding
        self.name = name
        self.vocab_size = encoding.n_vocab
        self._text_tokens = frozenset(text_tokens)
        missing = self._text_tokens - encoding.special_tokens_set
        if missing:
            raise TokenizerError(
                f"text tokens {sorted(missing)} are not added tokens of encoding {encoding.name!r}")
        self.special_tokens = {text: encoding.encode_single_token(text)
                               for text in sorted(encoding.special_tokens_set - self._text_tokens)}
        self.eos_token_id = None if eos_token_id is None else self.check_id(eos_token_id,
                                                                            "eos_token_id")

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        allowed = "all" if allow_special else self._text_tokens
        return self.encoding.encode(check_text(text), allowed_special=allowed,
                                    disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        try:
            raw = self.encoding.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError, ValueError):
            for token_id in ids:
                self.check_id(token_id)
            raise
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.encoding.decode_single_token_bytes(self.check_id(token_id))

    def _names(self, index: int) -> bool:
        try:
            self.encoding.decode_single_token_bytes(index)  # ids may have gaps below vocab_size
        except KeyError:
            return False
        return True


def build_encoding(name: str, pattern: str, ranks: dict[bytes, int], specials: dict[str, int],
                   source: Path | str) -> tiktoken.Encoding:
    """A tiktoken Encoding, with errors naming the file they came from."""
    clashes = set(specials.values()) & set(ranks.values())
    if clashes:
        raise TokenizerError(f"{source}: ids {sorted(clashes)[:8]} are both special and BPE tokens")
    try:
        return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=specials)
    except ValueError as e:
        raise TokenizerError(f"{source}: tiktoken rejected the tokenizer: {e}") from e


def tiktoken_gpt2() -> TiktokenTokenizer:
    """GPT-2's own tokenizer from tiktoken (downloaded once, then read from tiktoken's cache)."""
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise TokenizerError(
            f"could not load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}). tiktoken "
            "downloads it once and caches it (see TIKTOKEN_CACHE_DIR); without the internet, "
            "load a model folder that has tokenizer.json or tokenizer.tiktoken instead") from e
    return TiktokenTokenizer(encoding, encoding.eot_token, "gpt2")


def write_tiktoken_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    """Store mergeable ranks in tiktoken's format: ``base64(token_bytes) rank`` per line."""
    lines = (f"{base64.b64encode(token).decode('ascii')} {rank}\n"
             for token, rank in sorted(ranks.items(), key=lambda item: item[1]))
    Path(path).write_text("".join(lines), encoding="ascii")


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read mergeable ranks written by write_tiktoken_ranks (or by tiktoken itself)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line:
            continue
        try:
            encoded, rank_text = line.split()
            token, rank = base64.b64decode(encoded, validate=True), int(rank_text)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path} line {number} is not 'base64(token) rank': "
                                 f"{line[:60]!r}; the file is corrupt, regenerate it") from e
        if token in ranks:
            raise TokenizerError(f"{path} line {number}: token {token!r} is listed twice")
        ranks[token] = rank
    check_ranks(ranks, str(path))
    return ranks
