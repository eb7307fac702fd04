"""Which tokenizer runs: a model folder's files (or an in-memory Hugging Face tokenizer) → Tokenizer.

tokenizer.tiktoken, and any tokenizer.json that tiktoken represents exactly (byte-level BPE
with all 256 bytes, no normalizer, a known split regex: GPT-2, Llama-3 style), run on
tiktoken, the fast path lesson 01 teaches. Every other tokenizer.json runs on the `tokenizers`
library that wrote it, so its ids are the ones transformers gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import tokenizers

from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer.base import Tokenizer
from tinyinfer.tokenizer.convert import GPT2_PATTERN, ranks_from_tokenizer_json, text_tokens
from tinyinfer.tokenizer.hf_backed import HuggingFaceTokenizer
from tinyinfer.tokenizer.tiktoken_backed import (TiktokenTokenizer, build_encoding,
                                                 read_tiktoken_ranks)

MODEL_TYPES = ("BPE", "Unigram", "WordPiece", "WordLevel")  # what the tokenizers library reads

# Tokenizer files tinyinfer does not read, and how to get a tokenizer.json from them.
_CONVERT = "write tokenizer.json with transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
OTHER_FILES = {"tokenizer.model": f"a SentencePiece tokenizer.model; {_CONVERT}",
               "vocab.json": f"vocab.json (and merges.txt); {_CONVERT}"}
TOKENIZER_FILES = ("tokenizer.tiktoken", "tokenizer.json", *OTHER_FILES)


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether a model folder ships a tokenizer at all (random-weight folders do not)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(folder: str | Path, eos_token_id: int | None = None) -> Tokenizer:
    """Load the tokenizer of a model folder (tokenizer.tiktoken, else tokenizer.json).

    The EOS id is ``eos_token_id`` if given, else tokenizer_config.json's ``eos_token``, else
    ``<|endoftext|>`` where that is a special token.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise TokenizerError(f"tokenizer folder {folder} does not exist")
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    name = folder.resolve().name
    tiktoken_path, json_path = folder / "tokenizer.tiktoken", folder / "tokenizer.json"
    tokenizer: Tokenizer
    if tiktoken_path.is_file():
        ranks = read_tiktoken_ranks(tiktoken_path)
        specials = _specials_from_config(config, config_path)
        encoding = build_encoding(name, GPT2_PATTERN, ranks, specials, tiktoken_path)
        tokenizer = TiktokenTokenizer(encoding, eos_token_id, name)
    elif json_path.is_file():
        data = _read_json(json_path)
        _check_model_type(data, json_path)
        tokenizer = _from_tokenizer_json(
            data, name, json_path, lambda: _parse(json_path), eos_token_id)
    else:
        for other, what in OTHER_FILES.items():
            if (folder / other).is_file():
                raise TokenizerError(f"{folder} has {what}")
        raise TokenizerError(
            f"no tokenizer in {folder}: looked for tokenizer.tiktoken and tokenizer.json")
    if eos_token_id is None:
        tokenizer.eos_token_id = _eos_from_config(config, config_path, tokenizer)
    return tokenizer


def from_hf_tokenizer(tokenizer: tokenizers.Tokenizer, name: str,
                      eos_token_id: int | None = None) -> Tokenizer:
    """The Tokenizer of an in-memory Hugging Face tokenizer (one built from GGUF metadata, say).

    tiktoken runs it where it represents it exactly, as for a tokenizer.json; otherwise the
    object itself does (the Tokenizer keeps copies: later changes to it do not reach them).
    ``eos_token_id`` is the id that ends a generation, if any.
    """
    data = json.loads(tokenizer.to_str())
    return _from_tokenizer_json(data, name, name, lambda: tokenizer, eos_token_id)


def _from_tokenizer_json(data: dict, name: str, source: Path | str,
                         backend: Callable[[], tokenizers.Tokenizer],
                         eos_token_id: int | None) -> Tokenizer:
    """tiktoken where the tokenizer converts exactly, else the tokenizers library's object."""
    try:
        ranks, added, pattern = ranks_from_tokenizer_json(data)
    except TokenizerError:  # no exact tiktoken twin: the library that wrote the file runs it
        return HuggingFaceTokenizer(backend(), eos_token_id, name)
    encoding = build_encoding(name, pattern, ranks, added, source)
    return TiktokenTokenizer(encoding, eos_token_id, name, text_tokens=text_tokens(data))


def _check_model_type(data: dict, path: Path) -> None:
    """A clear error for a tokenizer.json without a model the tokenizers library reads."""
    model = data.get("model")
    if not isinstance(model, dict):
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json: it has no 'model' section")
    kind = model.get("type")
    if kind is not None and kind not in MODEL_TYPES:
        raise TokenizerError(f"{path}: unsupported tokenizer model type {kind!r}; the tokenizers "
                             f"library reads {', '.join(MODEL_TYPES)}")


def _parse(path: Path) -> tokenizers.Tokenizer:
    """The tokenizers library's reading of a tokenizer.json, or one line saying why it failed."""
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception for every parse error
        reason = " ".join(str(e).split())
        raise TokenizerError(f"{path}: the tokenizers library cannot read it ({reason}); the "
                             "file is corrupt or needs a newer tokenizers") from None


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


def _eos_from_config(config: dict[str, Any], path: Path, tokenizer: Tokenizer) -> int | None:
    """EOS id: tokenizer_config.json's eos_token, else <|endoftext|> if special, else None."""
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if eos is None:
        return tokenizer.special_tokens.get("<|endoftext|>")
    if not isinstance(eos, str):
        raise TokenizerError(f"{path}: eos_token must be a string, got {eos!r}")
    if eos in tokenizer.special_tokens:
        return tokenizer.special_tokens[eos]
    ids = tokenizer.encode(eos, allow_special=True)
    if len(ids) != 1 or tokenizer.decode(ids) != eos:
        raise TokenizerError(f"{path}: eos_token {eos!r} is not a token of this tokenizer; "
                             "fix eos_token")
    return ids[0]
