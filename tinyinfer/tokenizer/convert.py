"""A Hugging Face tokenizer.json in tiktoken's form, where tiktoken runs it exactly.

Byte-level BPE (GPT-2, Llama-3, SmolLM-style) is what tiktoken runs: split the text with a
regex, turn each piece into bytes, then merge adjacent pairs, lowest rank first. A
tokenizer.json describes the same algorithm with other bookkeeping (a vocabulary of printable
stand-in characters and an ordered merge list), so it converts, when every step has a tiktoken
twin. Anything else (a normalizer, a byte missing from the vocabulary, SentencePiece-style
pieces, a split regex not known to be equal) raises TokenizerError naming the step, and the
loader hands the file to the `tokenizers` library instead.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tinyinfer.errors import TokenizerError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GPT-2's regex run after Digits(individual_digits=True) (SmolLM, StarCoder): each digit is a
# piece of its own, and a whitespace run stops before a digit as it would at a piece's end.
GPT2_DIGITS_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
)

# Split regexes of real checkpoints that match every character (tiktoken keeps only what its
# regex matches; the tokenizers library also keeps what lies between matches).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
KNOWN_SPLIT_PATTERNS = (LLAMA3_PATTERN, QWEN2_PATTERN)


def ranks_from_tokenizer_json(data: Any) -> tuple[dict[bytes, int], dict[str, int], str]:
    """Convert a byte-level BPE tokenizer.json to tiktoken's form, or say why it does not fit.

    Returns mergeable ranks (token bytes -> id), added tokens (text -> id; those marked
    special plus the few a tokenizer matches inside ordinary text) and the pre-tokenizer
    regex. A token's rank is its id, so merge results must have ids in merge order.
    """
    model = _bpe_model(data)
    if data.get("normalizer") is not None:
        kind = data["normalizer"].get("type") if isinstance(data["normalizer"], dict) else None
        raise TokenizerError(f"normalizer {kind!r}: tiktoken has no normalizers")
    pattern = _pattern(data.get("pre_tokenizer"))
    decoder = data.get("decoder")
    if not (isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"):
        raise TokenizerError(f"decoder {decoder!r} is not ByteLevel")
    added = _added_tokens(data.get("added_tokens", []))
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerError("model.vocab must map token strings to integer ids")
    added_ids = set(added.values())
    ranks: dict[bytes, int] = {}
    for token, token_id in vocab.items():
        if token_id not in added_ids:
            raw = unbyte(token)
            if raw is None:
                raise TokenizerError(f"vocab entry {token!r} is not written in the byte-level "
                                     "alphabet, so this is not byte-level BPE")
            ranks[raw] = token_id
    _check_merge_order(model.get("merges", []), vocab)
    check_ranks(ranks, "model.vocab")
    return ranks, added, pattern


def text_tokens(data: dict) -> frozenset[str]:
    """Added tokens not marked special: Hugging Face matches these inside ordinary text."""
    return frozenset(entry["content"] for entry in data.get("added_tokens", [])
                     if not entry.get("special"))


def _stand_ins() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: stand-in character -> byte.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, soft hyphen)
    are shifted to U+0100 onwards so that every token is a string of visible characters.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of = {byte: chr(byte) for byte in printable}
    shifted = [byte for byte in range(256) if byte not in char_of]
    char_of.update({byte: chr(0x100 + n) for n, byte in enumerate(shifted)})
    return {char: byte for byte, char in char_of.items()}


BYTE_OF = _stand_ins()


def unbyte(token: str) -> bytes | None:
    """The bytes of a token written in the byte-level alphabet; None if it is not."""
    try:
        return bytes(BYTE_OF[char] for char in token)
    except KeyError:
        return None


def _bpe_model(data: Any) -> dict:
    """The model section of a tokenizer.json, checked to be plain BPE."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise TokenizerError("not a Hugging Face tokenizer.json: it has no 'model' section")
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind != "BPE":
        raise TokenizerError(f"model type {kind!r} is not BPE")
    for option in ("byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(option):
            raise TokenizerError(f"BPE with {option}={model[option]!r} is not plain byte-level BPE")
    return model


def _pattern(pre_tokenizer: Any) -> str:
    """The tiktoken split regex equal to a byte-level pre-tokenizer."""
    if isinstance(pre_tokenizer, dict) and pre_tokenizer.get("type") == "Sequence":
        steps = list(pre_tokenizer.get("pretokenizers", []))
    else:
        steps = [pre_tokenizer]
    types = [step.get("type") if isinstance(step, dict) else None for step in steps]
    if not types or types[-1] != "ByteLevel":
        raise TokenizerError(f"pre-tokenizer {types} does not end in ByteLevel")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise TokenizerError("ByteLevel with add_prefix_space=true has no tiktoken twin")
    use_regex = byte_level.get("use_regex", True)
    if types == ["ByteLevel"] and use_regex:
        return GPT2_PATTERN
    if types == ["Split", "ByteLevel"] and not use_regex:
        return _split_regex(steps[0])
    if types == ["Digits", "ByteLevel"] and use_regex and steps[0].get("individual_digits"):
        return GPT2_DIGITS_PATTERN
    raise TokenizerError(f"pre-tokenizer sequence {types} (use_regex={use_regex}) has no "
                         "tiktoken twin; known: ByteLevel, Split(regex)+ByteLevel, "
                         "Digits(individual)+ByteLevel")


def _split_regex(split: dict) -> str:
    """The regex of a Split pre-tokenizer known to match every character, kept piece by piece."""
    pattern = split.get("pattern")
    if not isinstance(pattern, dict) or not isinstance(pattern.get("Regex"), str):
        raise TokenizerError(f"Split pre-tokenizer needs a Regex pattern, got {pattern!r}")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise TokenizerError(f"Split pre-tokenizer with behavior={split.get('behavior')!r}, "
                             f"invert={split.get('invert')!r} has no tiktoken twin")
    if pattern["Regex"] not in KNOWN_SPLIT_PATTERNS:
        raise TokenizerError("Split pre-tokenizer regex is not one known to match every "
                             "character (Llama-3's or Qwen2's)")
    return pattern["Regex"]


def _added_tokens(entries: Any) -> dict[str, int]:
    """Added tokens of a tokenizer.json (text -> id), checked to be plain literal matches.

    tiktoken matches them by a regex alternation, first listed first: equal to the tokenizers
    library's longest match only where no token begins another. Its decode gives their text
    back as is: the ByteLevel decoder does too for ASCII text.
    """
    if not isinstance(entries, list):
        raise TokenizerError("added_tokens must be a list")
    added: dict[str, int] = {}
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("content"), str)
                and isinstance(entry.get("id"), int)):
            raise TokenizerError(f"malformed added_tokens entry {entry!r}")
        content = entry["content"]
        if entry.get("lstrip") or entry.get("rstrip") or entry.get("single_word"):
            raise TokenizerError(f"added token {content!r} uses lstrip/rstrip/single_word")
        if not content.isascii() or not content:
            raise TokenizerError(f"added token {content!r} is not ASCII text")
        added[content] = entry["id"]
    for text in added:
        if any(other != text and other.startswith(text) for other in added):
            raise TokenizerError(f"added token {text!r} begins another added token")
    return added


def _check_merge_order(merges: Any, vocab: dict[str, int]) -> None:
    """Check that merge results have increasing ids, so that rank order is merge order.

    Several merges may make one token (Llama-3: ĠĠ+ĠĠ and Ġ+ĠĠĠ both make ĠĠĠĠ)."""
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
        if result < previous:
            raise TokenizerError(
                f"merge {index} ({left!r}, {right!r}) makes id {result}, below the previous "
                f"merge's id {previous}: ids do not follow merge order, which tiktoken needs "
                "(it merges by lowest id)")
        previous = result


def check_ranks(ranks: dict[bytes, int], source: str) -> None:
    """Check what tiktoken assumes and would otherwise crash on: every byte, unique ranks."""
    duplicates = [rank for rank, count in Counter(ranks.values()).items() if count > 1]
    if duplicates:
        raise TokenizerError(f"{source}: rank {duplicates[0]} is given to more than one token")
    if any(rank < 0 for rank in ranks.values()):
        raise TokenizerError(f"{source}: ranks must be non-negative")
    missing = [byte for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{byte:02x}" for byte in missing[:8])
        raise TokenizerError(f"{source}: no token for {len(missing)} single byte(s) ({shown}); "
                             "tiktoken needs all 256")
