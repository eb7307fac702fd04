"""Byte-level BPE for the bundled model: trained with `tokenizers`, shipped in two formats.

Token ids are laid out the tiktoken way: ids 0-255 are the single bytes in byte order,
id 256 + i is the token made by merge i, and `<|endoftext|>` comes last. The HF
`tokenizer.json` and the tiktoken ranks file therefore give the same ids for the same text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from bundled_corpus import EOT
from tinyinfer.tokenizer import ranks_from_tokenizer_json, write_tiktoken_ranks


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def train_merges(texts: list[str], vocab_size: int) -> list[tuple[str, str]]:
    """Learn `vocab_size - 257` merges (256 bytes and `<|endoftext|>` fill the rest)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def build_tokenizer(merges: list[tuple[str, str]]) -> Tokenizer:
    """The HF fast tokenizer with ids equal to tiktoken ranks and `<|endoftext|>` last."""
    to_char = byte_to_char()
    vocab = {to_char[b]: b for b in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab[EOT] = len(vocab)
    # ignore_merges: a pre-token that is itself in the vocabulary is one token, as in tiktoken.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    return tokenizer


def write_tokenizer_files(folder: Path, merges: list[tuple[str, str]], max_length: int) -> None:
    """Write tokenizer.json, tokenizer.tiktoken and tokenizer_config.json into a model folder."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(merges)
    tokenizer.save(str(folder / "tokenizer.json"))
    ranks, _, _ = ranks_from_tokenizer_json(json.loads(tokenizer.to_str()))
    write_tiktoken_ranks(folder / "tokenizer.tiktoken", ranks)
    eot_id = tokenizer.token_to_id(EOT)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": {
            str(eot_id): {
                "content": EOT,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def encode_works(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each work (no special tokens added)."""
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
