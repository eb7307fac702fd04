"""Text ⇄ token ids: one Tokenizer over a tiktoken.Encoding, loaded from a model folder.

Byte-level BPE (GPT-2, Qwen2, SmolLM, Llama-3) is exactly what tiktoken runs: split the text
with a regex, turn each piece into bytes, then merge adjacent pairs, lowest rank first. A
Hugging Face ``tokenizer.json`` describes the same algorithm with other bookkeeping (a vocab
of printable stand-in characters and an ordered merge list), so it is converted once, here.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import numbers
import operator
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from tinyinfer.errors import TokenizerError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GPT-2's regex run after Digits(individual_digits=True) (SmolLM, StarCoder): each digit is a
# piece of its own, and a whitespace run stops before a digit as it would at a piece's end.
GPT2_DIGITS_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
)

_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD")


class Tokenizer:
    """Text ⇄ token ids for one model: a checked layer over a tiktoken.Encoding."""

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        eos_token_id: int | None,
        name: str,
        *,
        normalization: str | None = None,
        text_tokens: Iterable[str] = (),
    ) -> None:
        """Wrap ``encoding``; ``text_tokens`` are added tokens matched inside ordinary text."""
        self.encoding = encoding
        self.name = name
        self.vocab_size: int = encoding.n_vocab
        if normalization is not None and normalization not in _NORMALIZERS:
            raise TokenizerError(
                f"unknown Unicode normalization {normalization!r}; use one of {_NORMALIZERS}"
            )
        self.normalization = normalization
        self._text_tokens = frozenset(text_tokens)
        missing = self._text_tokens - encoding.special_tokens_set
        if missing:
            raise TokenizerError(
                f"text tokens {sorted(missing)} are not added tokens of encoding {encoding.name!r}"
            )
        self.special_tokens: dict[str, int] = {
            text: encoding.encode_single_token(text)
            for text in sorted(encoding.special_tokens_set - self._text_tokens)
        }
        self.eos_token_id = (
            None if eos_token_id is None else self._check_id(eos_token_id, "eos_token_id")
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"eos_token_id={self.eos_token_id})"
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are encoded as plain text."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only encode str, got {type(text).__name__}")
        if self.normalization is not None:
            text = unicodedata.normalize(self.normalization, text)
        return self.encoding.encode(text, allowed_special=self._text_tokens, disallowed_special=())

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of ``ids``; a token may end in the middle of a UTF-8 character."""
        try:
            return self.encoding.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError, ValueError):
            for token_id in ids:
                self._check_id(token_id, "token id")
            raise

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token, for UIs that show each token on its own."""
        return self.encoding.decode_single_token_bytes(self._check_id(token_id, "token id"))

    def generated_bytes(self, token_id: int) -> bytes:
        """Bytes of a token a model generated; b"" for ids the vocabulary lacks.

        Checkpoints often pad the embedding beyond the tokenizer (Qwen2: 151936 rows, 151665
        tokens): a sampled padding id has no text rather than being an error mid-stream.
        """
        try:
            return self.token_bytes(token_id)
        except TokenizerError:
            if isinstance(token_id, numbers.Integral) and token_id >= 0:
                return b""
            raise

    def _check_id(self, token_id: Any, what: str) -> int:
        """``token_id`` as an int, or TokenizerError unless it names a token of this vocabulary."""
        try:
            index = operator.index(token_id)
            if not 0 <= index < self.vocab_size:
                raise KeyError(index)
            self.encoding.decode_single_token_bytes(index)  # ids may have gaps below vocab_size
        except (TypeError, KeyError):
            raise TokenizerError(
                f"{what} {token_id!r} is not a token of {self.name!r} "
                f"(vocabulary of {self.vocab_size} ids, 0..{self.vocab_size - 1})"
            ) from None
        return index


class IncrementalDecoder:
    """Turns a stream of token ids into text, holding back bytes of an unfinished character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ("" while a multi-byte character is still open)."""
        return self._utf8.decode(self._tokenizer.generated_bytes(token_id))

    def flush(self) -> str:
        """End of stream: whatever is held back, an unfinished character shown as U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def load_tokenizer(folder: str | Path, eos_token_id: int | None = None) -> Tokenizer:
    """Load the tokenizer of a model folder (tokenizer.tiktoken, else tokenizer.json)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    name = folder.resolve().name
    tiktoken_path, json_path = folder / "tokenizer.tiktoken", folder / "tokenizer.json"
    if tiktoken_path.is_file():
        ranks = read_tiktoken_ranks(tiktoken_path)
        specials = _specials_from_config(config, config_path)
        encoding = _build_encoding(name, GPT2_PATTERN, ranks, specials, tiktoken_path)
        text_tokens, normalization = frozenset(), None
    elif json_path.is_file():
        data = _read_json(json_path)
        try:
            ranks, added, pattern = ranks_from_tokenizer_json(data)
            normalization = _normalization(data.get("normalizer"))
            text_tokens = _text_tokens(data.get("added_tokens", []))
        except TokenizerError as e:
            raise TokenizerError(f"{json_path}: {e}") from e
        encoding = _build_encoding(name, pattern, ranks, added, json_path)
        specials = {text: i for text, i in added.items() if text not in text_tokens}
    else:
        raise TokenizerError(
            f"no tokenizer in {folder}: looked for tokenizer.tiktoken and tokenizer.json"
        )
    if eos_token_id is None:
        eos_token_id = _eos_from_config(config, config_path, encoding, specials)
    return Tokenizer(
        encoding, eos_token_id, name, normalization=normalization, text_tokens=text_tokens
    )


def tiktoken_gpt2() -> Tokenizer:
    """GPT-2's own tokenizer from tiktoken (downloaded once, then read from tiktoken's cache)."""
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:
        raise TokenizerError(
            f"could not load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}). tiktoken "
            "downloads it once and caches it (see TIKTOKEN_CACHE_DIR); without the internet, "
            "load a model folder that has tokenizer.json or tokenizer.tiktoken instead"
        ) from e
    return Tokenizer(encoding, encoding.eot_token, "gpt2")


def write_tiktoken_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    """Store mergeable ranks in tiktoken's format: ``base64(token_bytes) rank`` per line."""
    lines = (
        f"{base64.b64encode(token).decode('ascii')} {rank}\n"
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    )
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
            raise TokenizerError(
                f"{path} line {number} is not 'base64(token) rank': {line[:60]!r}; the file "
                "is corrupt, regenerate it"
            ) from e
        if token in ranks:
            raise TokenizerError(f"{path} line {number}: token {token!r} is listed twice")
        ranks[token] = rank
    _check_ranks(ranks, str(path))
    return ranks


def ranks_from_tokenizer_json(data: dict) -> tuple[dict[bytes, int], dict[str, int], str]:
    """Convert a Hugging Face byte-level BPE tokenizer.json to tiktoken's form.

    Returns mergeable ranks (token bytes -> id), added tokens (text -> id; those marked
    special plus the few a tokenizer matches inside ordinary text) and the pre-tokenizer
    regex. A token's rank is its id, so merge results must have ids in merge order.
    """
    model = _bpe_model(data)
    pattern = _pattern(data.get("pre_tokenizer"))
    added = _added_tokens(data.get("added_tokens", []))
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerError("model.vocab must map token strings to integer ids")
    added_ids = set(added.values())
    byte_of = _byte_level_decoder()
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token_id not in added_ids:
            ranks[_unbyte(token, byte_of)] = token_id
    _check_merge_order(model.get("merges", []), vocab)
    _check_ranks(ranks, "model.vocab")
    return ranks, added, pattern


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: stand-in character -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, soft hyphen)
    are shifted to U+0100 onwards so that every token is a string of visible characters.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {byte: chr(byte) for byte in printable}
    shifted = [byte for byte in range(256) if byte not in char_of]
    char_of.update({byte: chr(0x100 + n) for n, byte in enumerate(shifted)})
    return {char: byte for byte, char in char_of.items()}


def _unbyte(token: str, byte_of: dict[str, int]) -> bytes:
    """Bytes of a vocab entry written in the byte-level alphabet."""
    try:
        return bytes(byte_of[char] for char in token)
    except KeyError as e:
        raise TokenizerError(
            f"vocab entry {token!r} uses {e.args[0]!r}, which is not in the byte-level "
            "alphabet; only byte-level BPE tokenizers are supported"
        ) from None


def _bpe_model(data: Any) -> dict:
    """The model section of a tokenizer.json, checked to be plain byte-level BPE."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise TokenizerError("not a Hugging Face tokenizer.json: it has no 'model' section")
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerError(
            f"unsupported tokenizer model type {kind!r}: tinyinfer reads byte-level BPE "
            "(GPT-2, Qwen2, SmolLM, Llama-3), not WordPiece, WordLevel or Unigram/SentencePiece"
        )
    for option in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(option):
            raise TokenizerError(
                f"BPE with {option}={model[option]!r} is not supported: tinyinfer reads plain "
                "byte-level BPE (SentencePiece-style tokenizers such as Llama 2's are not)"
            )
    return model


def _pattern(pre_tokenizer: Any) -> str:
    """The tiktoken split regex equivalent to a byte-level pre-tokenizer."""
    if isinstance(pre_tokenizer, dict) and pre_tokenizer.get("type") == "Sequence":
        steps = list(pre_tokenizer.get("pretokenizers", []))
    else:
        steps = [pre_tokenizer]
    types = [step.get("type") if isinstance(step, dict) else None for step in steps]
    if not types or types[-1] != "ByteLevel":
        raise TokenizerError(
            f"pre-tokenizer {types} does not end in ByteLevel; only byte-level BPE "
            "tokenizers are supported (SentencePiece-style BPE is not)"
        )
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise TokenizerError("ByteLevel with add_prefix_space=true is not supported")
    use_regex = byte_level.get("use_regex", True)
    if types == ["ByteLevel"] and use_regex:
        return GPT2_PATTERN
    if types == ["Split", "ByteLevel"] and not use_regex:
        return _split_regex(steps[0])
    if types == ["Digits", "ByteLevel"] and use_regex and steps[0].get("individual_digits"):
        return GPT2_DIGITS_PATTERN
    raise TokenizerError(
        f"unsupported pre-tokenizer sequence {types} (use_regex={use_regex}); supported: "
        "ByteLevel, Split(regex)+ByteLevel, Digits(individual)+ByteLevel"
    )


def _split_regex(split: dict) -> str:
    """The regex of a Split pre-tokenizer that keeps every match as its own piece.

    tiktoken keeps only what the regex matches, so the regex must match every character, as
    the Llama-3 and Qwen2 patterns do (their last alternatives catch all that is left).
    """
    pattern = split.get("pattern")
    if not isinstance(pattern, dict) or not isinstance(pattern.get("Regex"), str):
        raise TokenizerError(f"Split pre-tokenizer needs a Regex pattern, got {pattern!r}")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise TokenizerError(
            f"Split pre-tokenizer with behavior={split.get('behavior')!r}, "
            f"invert={split.get('invert')!r} is not supported (only Isolated, not inverted)"
        )
    return pattern["Regex"]


def _added_tokens(entries: Any) -> dict[str, int]:
    """Added tokens of a tokenizer.json: text -> id."""
    if not isinstance(entries, list):
        raise TokenizerError("added_tokens must be a list")
    added: dict[str, int] = {}
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)
                and isinstance(entry.get("id"), int)):
            raise TokenizerError(f"malformed added_tokens entry {entry!r}")
        added[entry["content"]] = entry["id"]
    return added


def _text_tokens(entries: list[dict]) -> frozenset[str]:
    """Added tokens not marked special: Hugging Face matches these inside ordinary text."""
    texts = set()
    for entry in entries:
        if entry.get("special"):
            continue
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
            raise TokenizerError(
                f"added token {entry['content']!r} uses lstrip/rstrip/single_word, "
                "which is not supported"
            )
        texts.add(entry["content"])
    return frozenset(texts)


def _normalization(normalizer: Any) -> str | None:
    """The Unicode normalization form a tokenizer.json applies before splitting, if any."""
    if normalizer is None:
        return None
    kind = normalizer.get("type") if isinstance(normalizer, dict) else None
    if kind not in _NORMALIZERS:
        raise TokenizerError(
            f"unsupported normalizer {kind!r}; supported: none or one of {_NORMALIZERS}"
        )
    return kind


def _check_merge_order(merges: Any, vocab: dict[str, int]) -> None:
    """Check that merge results have increasing ids, so that rank order is merge order."""
    if not isinstance(merges, list):
        raise TokenizerError("model.merges must be a list")
    previous = -1
    for index, merge in enumerate(merges):
        try:
            left, right = merge.split(" ") if isinstance(merge, str) else merge
        except (AttributeError, TypeError, ValueError):
            raise TokenizerError(f"merge {index} is not a pair of tokens: {merge!r}") from None
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise TokenizerError(f"merge {index} ({left!r}, {right!r}) uses a token not in vocab")
        result = vocab[left + right]
        if result <= previous:
            raise TokenizerError(
                f"merge {index} ({left!r}, {right!r}) makes id {result}, not above the "
                f"previous merge's id {previous}: ids do not follow merge order, which "
                "tiktoken needs (it merges by lowest id)"
            )
        previous = result


def _check_ranks(ranks: dict[bytes, int], source: str) -> None:
    """Check what tiktoken assumes and would otherwise crash on: every byte, unique ranks."""
    duplicates = [rank for rank, count in Counter(ranks.values()).items() if count > 1]
    if duplicates:
        raise TokenizerError(f"{source}: rank {duplicates[0]} is given to more than one token")
    if any(rank < 0 for rank in ranks.values()):
        raise TokenizerError(f"{source}: ranks must be non-negative")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{byte:02x}" for byte in missing[:8])
        raise TokenizerError(
            f"{source}: no token for {len(missing)} single byte(s) ({shown}); byte-level BPE "
            "needs all 256 (train with initial_alphabet=ByteLevel.alphabet())"
        )


def _build_encoding(
    name: str, pattern: str, ranks: dict[bytes, int], specials: dict[str, int], source: Path
) -> tiktoken.Encoding:
    """A tiktoken Encoding, with errors naming the file they came from."""
    clashes = set(specials.values()) & set(ranks.values())
    if clashes:
        raise TokenizerError(f"{source}: ids {sorted(clashes)[:8]} are both special and BPE tokens")
    try:
        return tiktoken.Encoding(
            name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
        )
    except ValueError as e:
        raise TokenizerError(f"{source}: tiktoken rejected the tokenizer: {e}") from e


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or a TokenizerError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}; the file is corrupt, re-download it") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _specials_from_config(config: dict, path: Path) -> dict[str, int]:
    """Special tokens from tokenizer_config.json's ``added_tokens_decoder``."""
    decoder = config.get("added_tokens_decoder", {})
    specials: dict[str, int] = {}
    try:
        for token_id, entry in decoder.items():
            if entry.get("special"):
                specials[str(entry["content"])] = int(token_id)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"{path}: malformed added_tokens_decoder ({e!r})") from e
    return specials


def _eos_from_config(
    config: dict, path: Path, encoding: tiktoken.Encoding, specials: dict[str, int]
) -> int | None:
    """EOS id: tokenizer_config.json's eos_token, else <|endoftext|> if special, else None."""
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        return specials.get("<|endoftext|>")
    if not isinstance(eos, str):
        raise TokenizerError(f"{path}: eos_token must be a string, got {eos!r}")
    if eos in specials:
        return specials[eos]
    try:
        return encoding.encode_single_token(eos)
    except KeyError:
        raise TokenizerError(
            f"{path}: eos_token {eos!r} is not a token of this tokenizer; fix eos_token"
        ) from None
