"""Tokenizer tests: tinyinfer must give the same ids and text as Hugging Face `tokenizers` itself.

Small tokenizers are trained here with the `tokenizers` library, in each pipeline style real
checkpoints ship (byte-level BPE as GPT-2, Llama-3, SmolLM, Qwen2 and SmolLM2 with bytes missing;
SentencePiece-style BPE with `▁` and byte fallback as Llama-2 and Mistral; Unigram; WordPiece),
saved as tokenizer.json and loaded back through tinyinfer, which runs each on tiktoken where that
is exact and on the library otherwise. The library is the oracle for every id and every text.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

import tinyinfer
from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer import (
    GPT2_PATTERN,
    HuggingFaceTokenizer,
    IncrementalDecoder,
    TiktokenTokenizer,
    Tokenizer,
    from_hf_tokenizer,
    load_tokenizer,
    ranks_from_tokenizer_json,
    read_tiktoken_ranks,
    tiktoken_gpt2,
    write_tiktoken_ranks,
)
from tinyinfer.tokenizer.convert import LLAMA3_PATTERN, QWEN2_PATTERN

ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
CHATML = ["<|im_start|>", "<|im_end|>"]
TOOL = "<tool_call>"  # Qwen2.5 style: an added token that is not special

# ---------------------------------------------------------------- text to train and test on

WORDS = (
    "the a of and to in is was it that for on with as at by from this be are or have not "
    "model token cache page batch decode prefill attention layer head query key value "
    "running ran runs quickly slowly happily Tokyo Paris Zürich naïve café résumé façade "
    "über Straße élève niño jalapeño 東京 日本語 中文 한국어 русский ελληνικά العربية עברית "
    "hello HELLO Hello world WORLD don't can't I'm you're we've they'll she'd it's O'Neil"
).split()
NUMBERS = ("0", "7", "42", "365", "2024", "3.14159", "1,000,000", "12345678", "٣٤", "½")
PUNCT = (".", ",", "!", "?", ";", ":", "...", "—", "(x)", "[y]", "{z}", '"q"', "#", "$5", "@me")
EMOJI = ("🙂", "👍🏽", "🎉", "❤️", "👩‍💻", "🇫🇷")
SPACES = (" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "\u00a0", "\u3000")


def _corpus(seed: int = 0, lines: int = 120) -> list[str]:
    """A few KB of varied text: words, numbers, punctuation, emoji and whitespace runs."""
    rng = random.Random(seed)
    pools = [WORDS] * 6 + [NUMBERS, PUNCT, EMOJI]
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 16)):
            parts.append(rng.choice(rng.choice(pools)))
            parts.append(rng.choice(SPACES))
        out.append("".join(parts))
    return out


CORPUS = _corpus()
SHAKESPEARE = (ROOT / "lessons" / "data" / "heldout.txt").read_text(encoding="utf-8").split("\n\n")
TRAINING = CORPUS + SHAKESPEARE[:200]  # no ASCII control character: real vocabularies lack most

EXAMPLES = [
    "", " ", "   ", "\n", "\n\n\n", "\t\t x", "hello world", " hello  world ",
    "Hello, World! It's 2024.", "I'M HERE and YOU'RE THERE, they'll see",
    "don't can't won't shouldn't", "numbers: 1 12 123 1234 12345 3.14159 -7 1e10",
    "x 12 y  345   z", "café naïve résumé Zürich",
    "cafe\u0301 and re\u0301sume\u0301",  # decomposed accents: NFC normalizers compose them
    "Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307l\u036e\u0312\u036b",  # stacked marks
    "東京は日本の首都です。", "한국어 텍스트와 中文混合", "ภาษาไทย हिन्दी বাংলা",
    "emoji 🙂👍🏽🎉 and a crab 🦀 and a flag 🇫🇷 and 👩‍💻", "mixed\twhitespace \r\n and\u00a0nbsp\u3000ideographic",
    "trailing spaces   ", "code: def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\n\t\treturn sum;",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}', "SELECT * FROM t WHERE id = 42;",
    "a<tool_call>b <tool_call> c", "العربية русский ελληνικά", "שלום עולם, מה שלומך?",
    "مرحبا بالعالم 123 (نص)", "RTL\u200fmark and LTR\u200emark, zero\u200bwidth, \ufeffBOM",
    "\x00\x01\x7f control \x1c\x1d\x1e\x1f\x85 chars", "end of transmission\x04 here \x06\x13",
    "\x1b[31mred\x1b[0m", "▁already▁has▁meta▁spaces", "<0x41> is not a byte token in text",
    f"special {EOT} inside and {CHATML[0]}user\nhi{CHATML[1]}", "<s>[INST] hi [/INST]</s>",
    "\u2028line\u2029para", "ﬁ ligature, Ⅻ numeral, ① circled, ｆｕｌｌｗｉｄｔｈ",
    *CORPUS[:20], *SHAKESPEARE[200:210],
]


def _varied(seed: int = 1, count: int = 240) -> list[str]:
    """Strings drawn from many scripts, symbols, controls and whitespace runs, mixed."""
    rng = random.Random(seed)
    pieces = [*WORDS, *NUMBERS, *PUNCT, *EMOJI, *SPACES, "\x04", "\x06", "\x13", "\x7f", "\x00",
              "e\u0301", "\u05e9\u05c1", "ب\u064e", "▁", "<0xE6>", EOT, *CHATML, TOOL, "<s>", "</s>",
              "    ", "\t\t", "\n\n\n", "def", "():", "=>", "//", "0x1F", "%d", "\\n"]
    out = []
    for _ in range(count):
        text = "".join(rng.choice(pieces) + rng.choice(["", "", " ", "\n"])
                       for _ in range(rng.randint(1, 12)))
        out.append(text)
    return out


STRINGS = EXAMPLES + _varied()

# Characters that stress pre-tokenizer regexes and normalizers.
TRICKY = list(" \t\n\r\x0b\x0c\x1c\x1f\x85\u00a0\u2028\u3000'sStTdDlLvVmMrReE0123456789٣½")
TRICKY += ["é", "e\u0301", "日", "🙂", "🦀", "👍🏽", "-", ".", "?", "'", "_", "$", "\x04", "▁",
           "<0x41>", "ﬁ", EOT, "<s>", "</s>", *CHATML, TOOL]
CHARS = st.characters(exclude_categories=("Cs",))  # lone surrogates are not valid text
TEXTS = st.lists(st.one_of(CHARS, st.sampled_from(TRICKY)), max_size=40).map("".join)

# ---------------------------------------------------------------- the pipeline styles


def _byte_level(style: str, initial_alphabet: bool = True) -> HFTokenizer:
    """A small byte-level BPE in the style of GPT-2, Llama-3, Qwen2 or SmolLM(2)."""
    hf = HFTokenizer(models.BPE(ignore_merges=style == "llama3"))
    if style == "gpt2":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style in ("smollm", "smollm2"):
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        pattern = LLAMA3_PATTERN if style == "llama3" else QWEN2_PATTERN
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if initial_alphabet else []
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=[EOT], initial_alphabet=alphabet,
                                  show_progress=False)
    hf.train_from_iterator(TRAINING, trainer)
    if style == "qwen2":
        hf.add_tokens([TOOL])
    if style in ("qwen2", "smollm2"):
        hf.add_special_tokens(CHATML)
    return hf


def _sentencepiece(style: str) -> HFTokenizer:
    """A Llama-2 (legacy: Prepend normalizer) or Mistral (Metaspace pre-tokenizer) style BPE.

    Laid out as converted SentencePiece models are: <unk>, <s>, </s>, then the 256 byte
    tokens <0x00>..<0xFF> that byte fallback uses for characters the vocabulary lacks.
    """
    base = HFTokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    base.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))
    if style == "llama2":
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                              normalizers.Replace(" ", "▁")])
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<unk>", "<s>", "</s>")])
    if style == "mistral":
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t in ("[INST]", "[/INST]")])
    # The BOS the library adds when asked (add_special_tokens=True); tinyinfer's encode does not.
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return hf


def _unigram() -> HFTokenizer:
    """A T5-style Unigram with Metaspace and an NFKC normalizer."""
    hf = HFTokenizer(models.Unigram())
    hf.normalizer = normalizers.NFKC()
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    hf.train_from_iterator(TRAINING, trainer)
    return hf


def _wordpiece() -> HFTokenizer:
    """A BERT-style WordPiece: lower-casing normalizer, ## continuation pieces."""
    hf = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=True)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", "[SEP]"],
                                        show_progress=False)
    hf.train_from_iterator(TRAINING, trainer)
    return hf


@dataclass(frozen=True)
class Style:
    """One pipeline style: how to build it, which backend must run it, what it promises."""

    build: Callable[[], HFTokenizer]
    backend: type[Tokenizer]
    eos: str | None  # the EOS text a tokenizer_config.json of this style names
    lossless: bool = False  # decode(encode(text)) == text (for text without a literal ▁)
    space_prefix: bool = False  # the decoder strips the space a word-start token begins with
    keeps_leading_space: bool = True  # Metaspace adds no ▁ before a text that begins with one


STYLES = {
    "gpt2": Style(lambda: _byte_level("gpt2"), TiktokenTokenizer, EOT, lossless=True),
    "llama3": Style(lambda: _byte_level("llama3"), TiktokenTokenizer, EOT, lossless=True),
    "smollm": Style(lambda: _byte_level("smollm"), TiktokenTokenizer, EOT, lossless=True),
    "qwen2": Style(lambda: _byte_level("qwen2"), HuggingFaceTokenizer, EOT),
    "smollm2": Style(lambda: _byte_level("smollm2", initial_alphabet=False), HuggingFaceTokenizer,
                     CHATML[1]),
    "llama2": Style(lambda: _sentencepiece("llama2"), HuggingFaceTokenizer, "</s>",
                    lossless=True, space_prefix=True),
    "mistral": Style(lambda: _sentencepiece("mistral"), HuggingFaceTokenizer, "</s>",
                     lossless=True, space_prefix=True, keeps_leading_space=False),
    "unigram": Style(_unigram, HuggingFaceTokenizer, "</s>"),
    "wordpiece": Style(_wordpiece, HuggingFaceTokenizer, "[SEP]"),
}


@dataclass(frozen=True)
class Pair:
    name: str
    style: Style
    hf: HFTokenizer  # the oracle
    tok: Tokenizer  # tinyinfer's, loaded from the saved tokenizer.json

    def hf_encode(self, text: str, allow_special: bool = False) -> list[int]:
        """The library's ids: special-token text parsed only when allowed (split otherwise, as
        transformers' split_special_tokens=True), no BOS."""
        self.hf.encode_special_tokens = not allow_special
        return self.hf.encode(text, add_special_tokens=False).ids

    def hf_decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Callable[[str], Pair]:
    """Factory: style name -> its Hugging Face tokenizer and tinyinfer's, loaded from a folder
    laid out as a checkpoint's (built once per module)."""
    built: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in built:
            style = STYLES[name]
            folder = tmp_path_factory.mktemp(name, numbered=False)
            style.build().save(str(folder / "tokenizer.json"))
            (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": style.eos}))
            # The oracle reads the saved file, as transformers does: a freshly trained Unigram
            # object can break ties between equal-score splits unlike its own saved copy.
            hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            built[name] = Pair(name, style, hf, load_tokenizer(folder))
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(STYLES))
def pair(request, pairs) -> Pair:
    """Each style in turn."""
    return pairs(request.param)


LOSSLESS = [name for name, style in STYLES.items() if style.lossless]
SENTENCEPIECE = [name for name, style in STYLES.items() if style.space_prefix]


def test_each_style_runs_where_it_is_exact(pair: Pair) -> None:
    assert type(pair.tok) is pair.style.backend


def test_same_ids_as_hugging_face_on_varied_strings(pair: Pair) -> None:
    assert len(STRINGS) >= 300
    for text in STRINGS:
        assert pair.tok.encode(text) == pair.hf_encode(text), text
        assert pair.tok.encode(text, allow_special=True) == pair.hf_encode(text, True), text


@settings(max_examples=60, deadline=None)
@given(text=TEXTS)
def test_same_ids_and_text_as_hugging_face_on_any_text(pair: Pair, text: str) -> None:
    ids = pair.tok.encode(text)
    assert ids == pair.hf_encode(text)
    assert pair.tok.encode(text, allow_special=True) == pair.hf_encode(text, True)
    assert pair.tok.decode(ids) == pair.hf_decode(ids)


def test_decode_equals_hugging_face_and_round_trips(pair: Pair) -> None:
    for text in STRINGS:
        ids = pair.tok.encode(text)
        assert pair.tok.decode(ids) == pair.hf_decode(ids), text
        if pair.style.lossless and "▁" not in text and (
                pair.style.keeps_leading_space or not text.startswith(" ")):
            assert pair.tok.decode(ids) == text


def test_bytes_missing_from_the_vocabulary_are_dropped_as_hugging_face_drops_them(
        pairs) -> None:
    pair = pairs("smollm2")  # trained without every byte, as SmolLM2's real tokenizer is
    assert pair.hf.token_to_id("\u0104") is None  # byte 0x04's stand-in: not in the vocabulary
    ids = pair.tok.encode("a\x04b")
    assert ids == pair.hf_encode("a\x04b")
    assert pair.tok.decode(ids) == "ab"


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_byte_fallback_spells_unknown_characters_in_bytes(pairs, name: str) -> None:
    pair = pairs(name)
    ids = pair.tok.encode("\x04🦀")
    assert [pair.hf.id_to_token(i) for i in ids[-5:]] == [
        "<0x04>", "<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    assert pair.tok.decode(ids) == "\x04🦀"


def test_vocabulary_specials_and_eos(pair: Pair) -> None:
    tok, hf = pair.tok, pair.hf
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.name == pair.name  # the folder's name
    assert tok.eos_token_id == hf.token_to_id(pair.style.eos)
    specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    assert set(tok.special_tokens) == specials
    assert all(hf.token_to_id(text) == i for text, i in tok.special_tokens.items())
    assert TOOL not in tok.special_tokens


def test_special_token_text_is_plain_text_unless_allowed(pair: Pair) -> None:
    tok = pair.tok
    for text in tok.special_tokens:
        spelled = f"a{text}b"
        if pair.name != "unigram":  # a Unigram vocabulary has the pieces <pad>, </s>, <unk> too
            assert tok.special_tokens[text] not in tok.encode(spelled)
        assert tok.special_tokens[text] in tok.encode(spelled, allow_special=True)
        assert tok.decode([tok.special_tokens[text]]) == pair.hf_decode([tok.special_tokens[text]])


def test_non_special_added_tokens_are_matched_in_plain_text(pairs) -> None:
    pair = pairs("qwen2")
    assert pair.hf.token_to_id(TOOL) in pair.tok.encode(f"x{TOOL}y")


@pytest.mark.parametrize("name", LOSSLESS)
def test_token_bytes_spell_the_text(pairs, name: str) -> None:
    pair = pairs(name)
    tok = pair.tok
    for text in ("per-token bytes: café 🦀", "two  spaces\tand a tab\n東京", "x\x04y"):
        spelled = b"".join(tok.token_bytes(i) for i in tok.encode(text))
        assert spelled == (" " if pair.style.space_prefix else "").encode() + text.encode()


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_token_bytes_of_a_word_start_piece_keep_its_space(pairs, name: str) -> None:
    pair = pairs(name)
    the = pair.hf.token_to_id("▁the")
    assert pair.tok.token_bytes(the) == b" the"
    assert pair.tok.decode([the]) == "the"  # the decoder strips it at the start of a text
    assert pair.tok.token_bytes(pair.hf.token_to_id("<0x0A>")) == b"\n"


# ---------------------------------------------------------------- streaming


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tok)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_streamed_pieces_add_up_to_decode(pair: Pair) -> None:
    for text in STRINGS:
        ids = pair.tok.encode(text)
        pieces = _stream(pair.tok, ids)
        assert "".join(pieces) == pair.hf_decode(ids), text
        if "\ufffd" not in pair.hf_decode(ids):
            assert "\ufffd" not in "".join(pieces)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streaming_any_ids_gives_what_hugging_face_decodes(pair: Pair, data) -> None:
    tok = pair.tok
    special = sorted(tok.special_tokens.values())
    # Any ids, with extra weight on those that build characters: raw bytes and specials.
    bytes_ids = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1][:64]
    ids = data.draw(st.lists(st.one_of(st.integers(0, tok.vocab_size - 1),
                                       st.sampled_from(bytes_ids + special)), max_size=30))
    assert "".join(_stream(tok, ids)) == pair.hf_decode(ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_stream_continuing_a_prompt_adds_what_decoding_the_whole_adds(pair: Pair, data) -> None:
    tok = pair.tok
    ids = st.integers(0, tok.vocab_size - 1)
    context = data.draw(st.lists(ids, min_size=1, max_size=8))
    stream = data.draw(st.lists(ids, max_size=20))
    decoder = IncrementalDecoder(tok, context)
    text = "".join(decoder.push(i) for i in stream) + decoder.flush()
    last = context[-1]
    if tok.holds_back(last) or tok.decode([last]).endswith("\ufffd"):
        assert text == pair.hf_decode(stream)  # no settled context: the stream starts afresh
    else:
        before = pair.hf_decode(context)
        whole = pair.hf_decode(context + stream)
        assert whole.startswith(before)
        assert text == whole[len(before):]


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_a_generation_after_a_prompt_keeps_its_first_space(pairs, name: str) -> None:
    tok = pairs(name).tok
    prompt, generated = tok.encode("ROMEO:"), tok.encode("the cat")  # ▁the ▁cat: two words
    decoder = IncrementalDecoder(tok, prompt)
    assert "".join(decoder.push(i) for i in generated) + decoder.flush() == " the cat"
    assert tok.decode(prompt + generated) == "ROMEO: the cat"


@pytest.mark.parametrize("name", LOSSLESS)
def test_a_character_split_over_tokens_streams_once_complete(pairs, name: str) -> None:
    pair = pairs(name)
    tok = pair.tok
    crab = tok.encode("x🦀")[-4:] if pair.style.space_prefix else tok.encode("🦀")
    assert len(crab) >= 2  # not in the training text: split into byte tokens
    decoder = IncrementalDecoder(tok)
    decoder.push(tok.encode("x")[0])
    pieces = [decoder.push(i) for i in crab]
    assert pieces[:-1] == [""] * (len(crab) - 1)
    assert "".join(pieces) + decoder.flush() in ("🦀", "x🦀")  # byte runs wait for their end


@pytest.mark.parametrize("name", LOSSLESS)
def test_flush_ends_an_unfinished_character(pairs, name: str) -> None:
    tok = pairs(name).tok
    decoder = IncrementalDecoder(tok)
    crab_start = next(i for i in tok.encode("🦀") if tok.token_bytes(i).startswith(b"\xf0"))
    assert decoder.push(crab_start) == ""
    assert decoder.flush() == "\ufffd"
    a = tok.encode("a")[-1]
    assert decoder.push(a) + decoder.flush() == "a"  # a new stream starts clean


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_sentencepiece_streams_strip_only_the_first_space(pairs, name: str) -> None:
    tok = pairs(name).tok
    ids = tok.encode("the cat sat on the mat")
    pieces = _stream(tok, ids)
    assert pieces[0] == "the" and "".join(pieces) == "the cat sat on the mat"
    assert pieces[1].startswith(" ")


def test_padding_ids_stream_no_text_and_bad_ids_are_refused(pair: Pair) -> None:
    tok = pair.tok
    for bad in (tok.vocab_size, -1, 2**40, "7"):
        with pytest.raises(TokenizerError, match="is not a token of"):
            tok.decode([1, bad])
        with pytest.raises(TokenizerError, match="is not a token of"):
            tok.token_bytes(bad)
        if isinstance(bad, int) and bad >= 0:  # a padding row of the embedding the model sampled
            assert IncrementalDecoder(tok).push(bad) == ""
            assert tok.generated_bytes(bad) == b""
        else:
            with pytest.raises(TokenizerError, match="is not a token of"):
                IncrementalDecoder(tok).push(bad)


def test_encode_rejects_non_text(pair: Pair) -> None:
    with pytest.raises(TokenizerError, match="can only encode str"):
        pair.tok.encode(b"bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- in-memory tokenizers


def test_from_hf_tokenizer_picks_the_backend_and_keeps_its_own_copy() -> None:
    gpt2, llama2 = STYLES["gpt2"].build(), STYLES["llama2"].build()
    fast = from_hf_tokenizer(gpt2, "gpt2-like", eos_token_id=gpt2.token_to_id(EOT))
    exact = from_hf_tokenizer(llama2, "llama2-like", eos_token_id=2)
    assert isinstance(fast, TiktokenTokenizer) and isinstance(exact, HuggingFaceTokenizer)
    assert (fast.name, fast.eos_token_id, exact.eos_token_id) == ("gpt2-like", 0, 2)
    text = "the cat 🦀 </s>"
    expected = llama2.encode(text, add_special_tokens=False).ids
    llama2.encode_special_tokens = True  # the caller's object is not the one tinyinfer runs
    llama2.add_special_tokens(["cat"])
    assert exact.encode(text, allow_special=True) == expected
    assert fast.encode(text) == gpt2.encode(text).ids
    with pytest.raises(TokenizerError, match="eos_token_id 5000"):
        from_hf_tokenizer(llama2, "x", eos_token_id=5000)


def test_truncation_and_padding_in_tokenizer_json_are_not_applied(tmp_path: Path) -> None:
    hf = STYLES["llama2"].build()
    hf.enable_truncation(max_length=4)
    hf.enable_padding(length=64)
    hf.save(str(tmp_path / "tokenizer.json"))
    hf.no_truncation()
    hf.no_padding()
    text = " ".join(SHAKESPEARE[:3])
    assert load_tokenizer(tmp_path).encode(text) == hf.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- tiktoken's own files


def test_tiktoken_file_round_trip_gives_same_ids(tmp_path: Path) -> None:
    hf = STYLES["gpt2"].build()
    ranks, specials, pattern = ranks_from_tokenizer_json(json.loads(hf.to_str()))
    assert pattern == GPT2_PATTERN
    assert specials == {EOT: 0}
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken", ranks)
    assert read_tiktoken_ranks(tmp_path / "tokenizer.tiktoken") == ranks
    config = {"added_tokens_decoder": {"0": {"content": EOT, "special": True}},
              "eos_token": {"content": EOT}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.eos_token_id == 0
    assert tok.special_tokens == {EOT: 0}
    for text in STRINGS:
        assert tok.encode(text, allow_special=True) == hf.encode(text).ids, text
    hf.encode_special_tokens = True
    for text in STRINGS:
        assert tok.encode(text) == hf.encode(text).ids, text


def test_tiktoken_file_without_config_has_no_specials(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256}
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken", ranks)
    tok = load_tokenizer(tmp_path)
    assert tok.special_tokens == {}
    assert tok.eos_token_id is None
    assert tok.vocab_size == 257
    assert tok.encode("abc ab") == [256, ord("c"), ord(" "), 256]


def test_tiktoken_file_missing_a_byte(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256) if b != ord("a")}
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken", ranks)
    with pytest.raises(TokenizerError, match=r"tokenizer.tiktoken: no token for 1 .*0x61"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["YQ== 0", "not-base64! 1"], "line 2 is not 'base64"),
        (["YQ== 0", "Yg== x"], "line 2 is not 'base64"),
        (["YQ== 0", "YQ== 1"], "listed twice"),
        (["YQ== 0", "Yg== 0"], "rank 0 is given to more than one token"),
    ],
)
def test_corrupt_tiktoken_file(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "tokenizer.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerError, match=message):
        read_tiktoken_ranks(path)


def test_decode_rejects_ids_in_a_gap_of_the_vocabulary() -> None:
    ranks = {bytes([b]): b for b in range(256)}
    encoding = tiktoken.Encoding(
        "gappy", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|end|>": 300})
    tok = TiktokenTokenizer(encoding, 300, "gappy")
    assert tok.vocab_size == 301
    assert tok.decode([104, 105, 300]) == "hi<|end|>"
    with pytest.raises(TokenizerError, match="token id 280"):
        tok.decode([280])
    assert tok.generated_bytes(280) == b""


# ---------------------------------------------------------------- what tiktoken cannot run


def _data(style: str) -> dict:
    return json.loads(STYLES[style].build().to_str())


def _set(path: str, value) -> Callable[[dict], None]:
    """A change to one field of a tokenizer.json, by a dotted path (list indexes as numbers)."""
    def change(data: dict) -> None:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value
    return change


NOT_TIKTOKEN = [
    ("gpt2", _set("normalizer", {"type": "Lowercase"}), "normalizer 'Lowercase'"),
    ("gpt2", _set("model.byte_fallback", True), "byte_fallback=True"),
    ("gpt2", _set("pre_tokenizer", {"type": "Metaspace", "replacement": "▁",
                                    "prepend_scheme": "first", "split": False}),
     "does not end in ByteLevel"),
    ("gpt2", _set("pre_tokenizer.add_prefix_space", True), "add_prefix_space"),
    ("gpt2", _set("decoder", None), "decoder None is not ByteLevel"),
    ("gpt2", _set("added_tokens.0.lstrip", True), "lstrip/rstrip/single_word"),
    ("gpt2", _set("added_tokens.0.content", "<|énde|>"), "not ASCII"),
    ("gpt2", lambda d: d["model"]["merges"].reverse(), "merge order"),
    ("gpt2", lambda d: d["model"]["merges"].append(["t", "h", "e"]), "is not a pair of tokens"),
    ("gpt2", lambda d: d["model"]["vocab"].update({"▁the": 10_000}),
     "not written in the byte-level alphabet"),
    ("llama3", _set("pre_tokenizer.pretokenizers.0.behavior", "Removed"), "behavior='Removed'"),
    ("llama3", _set("pre_tokenizer.pretokenizers.0.pattern", {"String": " "}),
     "needs a Regex pattern"),
    ("llama3", _set("pre_tokenizer.pretokenizers.0.pattern", {"Regex": r"\w+"}),
     "not one known to match every character"),
    ("smollm", _set("pre_tokenizer.pretokenizers.0.individual_digits", False),
     r"pre-tokenizer sequence \['Digits', 'ByteLevel'\].*no tiktoken twin"),
]


@pytest.mark.parametrize(("style", "change", "reason"), NOT_TIKTOKEN)
def test_what_tiktoken_cannot_run_exactly_runs_on_tokenizers(
        tmp_path: Path, style: str, change, reason: str) -> None:
    data = _data(style)
    change(data)
    with pytest.raises(TokenizerError, match=reason):
        ranks_from_tokenizer_json(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    try:
        hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    except Exception:  # a change the library refuses too: tinyinfer refuses it in one line
        with pytest.raises(TokenizerError, match="the tokenizers library cannot read it"):
            load_tokenizer(tmp_path)
        return
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HuggingFaceTokenizer)
    for text in EXAMPLES:
        ids = tok.encode(text)
        hf.encode_special_tokens = True
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), text


def test_several_merges_making_one_token_still_run_on_tiktoken(tmp_path: Path) -> None:
    # Llama-3's merges do this (ĠĠ+ĠĠ and Ġ+ĠĠĠ both make ĠĠĠĠ): ids still follow merge order.
    data = _data("gpt2")
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    index, extra = next((i, [word[:k], word[k:]]) for i, (left, right) in enumerate(merges)
                        for word in [left + right] for k in range(1, len(word))
                        if word[:k] in vocab and word[k:] in vocab and k != len(left))
    merges.insert(index + 1, extra)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    for text in STRINGS:
        assert tok.encode(text, allow_special=True) == hf.encode(text).ids, text


def test_an_added_token_that_begins_another_runs_on_tokenizers(tmp_path: Path) -> None:
    hf = STYLES["gpt2"].build()
    hf.add_special_tokens(["<|end", "<|endoftext|>x"])
    with pytest.raises(TokenizerError, match="begins another added token"):
        ranks_from_tokenizer_json(json.loads(hf.to_str()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    text = "a<|endoftext|>x<|end|>"
    assert tok.encode(text, allow_special=True) == hf.encode(text).ids


# ---------------------------------------------------------------- eos and bad files


def _gpt2_folder(tmp_path: Path, config: dict | None = None) -> Path:
    """A folder holding a gpt2-style tokenizer.json (and a tokenizer_config.json if given)."""
    STYLES["gpt2"].build().save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_eos_from_config_string_and_argument_override(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path, {"eos_token": "!"})
    assert load_tokenizer(folder).eos_token_id == load_tokenizer(folder).encode("!")[0]
    assert load_tokenizer(folder, eos_token_id=5).eos_token_id == 5


def test_eos_is_none_without_config_or_endoftext(tmp_path: Path) -> None:
    data = _data("gpt2")
    data["added_tokens"][0]["content"] = "<|end|>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_id is None
    assert tok.special_tokens == {"<|end|>": 0}


def test_eos_errors(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path, {"eos_token": "<|no such token|>"})
    with pytest.raises(TokenizerError, match="eos_token '<|no such token|>'"):
        load_tokenizer(folder)
    with pytest.raises(TokenizerError, match="eos_token_id 100000"):
        load_tokenizer(folder, eos_token_id=100_000)


def test_missing_folder_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="tokenizer.tiktoken and tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.model", "vocab.json"])
def test_tokenizer_files_tinyinfer_does_not_read_say_how_to_convert(tmp_path: Path,
                                                                   name: str) -> None:
    (tmp_path / name).write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match=f"has .*{name}.*save_pretrained"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read .*tokenizer.json"),
        ("[1, 2]", "must hold a JSON object"),
        ("{}", "tokenizer.json: not a Hugging Face tokenizer.json"),
        ('{"model": {"type": "Foobar"}}', "unsupported tokenizer model type 'Foobar'"),
        ('{"model": {"type": "BPE", "vocab": "none"}}', "the tokenizers library cannot read it"),
    ],
)
def test_corrupt_tokenizer_json(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=message) as caught:
        load_tokenizer(tmp_path)
    assert "\n" not in str(caught.value)


def test_corrupt_tokenizer_config(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(folder)


@pytest.fixture
def model_with_broken_tokenizer(oracle_model, tmp_path: Path) -> Path:
    """A saved model whose tokenizer.json names a model type no library reads."""
    src, _ = oracle_model("llama-gqa-untied")
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    data = _data("gpt2")
    data["model"]["type"] = "Foobar"
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_broken_tokenizer_fails_the_load(model_with_broken_tokenizer: Path) -> None:
    with pytest.raises(TokenizerError, match="unsupported tokenizer model type 'Foobar'"):
        tinyinfer.load(model_with_broken_tokenizer)


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "To be"]])
def test_the_cli_refuses_a_broken_tokenizer_in_one_line(model_with_broken_tokenizer: Path,
                                                        command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "tinyinfer", *command, "--model",
                           str(model_with_broken_tokenizer)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback, and serve never says it is serving
    assert "unsupported tokenizer model type 'Foobar'" in lines[0]


# ---------------------------------------------------------------- GPT-2 from tiktoken's cache


@pytest.fixture(scope="module")
def gpt2_or_error() -> Tokenizer | TokenizerError:
    """tiktoken's gpt2 tokenizer where it can be loaded here, else the TokenizerError raised."""
    try:
        return tiktoken_gpt2()
    except TokenizerError as e:
        return e


def test_tiktoken_gpt2(gpt2_or_error) -> None:
    if isinstance(gpt2_or_error, TokenizerError):
        pytest.skip("tiktoken cannot load gpt2 here (offline and not in its cache)")
    tok = gpt2_or_error
    assert tok.vocab_size == 50257
    assert tok.eos_token_id == 50256
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's published ids
    assert tok.encode(EOT) != [50256]
    assert tok.encode(EOT, allow_special=True) == [50256]


def test_tiktoken_gpt2_failure_is_a_tokenizer_error(gpt2_or_error) -> None:
    if not isinstance(gpt2_or_error, TokenizerError):
        pytest.skip("tiktoken loaded gpt2 here, so there is no failure to check")
    assert "gpt2" in str(gpt2_or_error)
    assert "tokenizer.json" in str(gpt2_or_error)
