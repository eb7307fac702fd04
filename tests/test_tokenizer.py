"""Tokenizer tests: tinyinfer must give the same ids as Hugging Face `tokenizers` itself.

Small byte-level BPEs are trained here, in each pre-tokenizer style real checkpoints use,
saved as tokenizer.json and loaded back through tinyinfer's tiktoken conversion.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

import tinyinfer
from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer import (
    GPT2_PATTERN,
    HuggingFaceTokenizer,
    IncrementalDecoder,
    TiktokenTokenizer,
    Tokenizer,
    load_tokenizer,
    ranks_from_tokenizer_json,
    read_tiktoken_ranks,
    tiktoken_gpt2,
    write_tiktoken_ranks,
)

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EOT = "<|endoftext|>"
TOOL = "<tool_call>"  # Qwen2.5 style: an added token that is not special

WORDS = (
    "the a of and to in is was it that for on with as at by from this be are or have not "
    "model token cache page batch decode prefill attention layer head query key value "
    "running ran runs quickly slowly happily Tokyo Paris Zürich naïve café résumé façade "
    "über Straße élève niño jalapeño 東京 日本語 中文 한국어 русский ελληνικά العربية "
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

EXAMPLES = [
    "",
    " ",
    "   ",
    "\n",
    "\n\n\n",
    "\t\t x",
    "hello world",
    " hello  world ",
    "Hello, World! It's 2024.",
    "I'M HERE and YOU'RE THERE, they'll see",
    "don't can't won't shouldn't",
    "numbers: 1 12 123 1234 12345 3.14159 -7 1e10",
    "x 12 y  345   z",
    "café naïve résumé Zürich",
    "cafe\u0301 and re\u0301sume\u0301",  # decomposed accents: NFC normalizers compose them
    "東京は日本の首都です。",
    "emoji 🙂👍🏽🎉 and a crab 🦀 and a flag 🇫🇷",
    "mixed\twhitespace \r\n and\u00a0nbsp\u3000ideographic",
    "trailing spaces   ",
    "code: def f(x):\n    return x ** 2  # square\n",
    "a<tool_call>b <tool_call> c",
    "العربية русский ελληνικά",
    "\x00\x01\x7f control \x1c\x1d\x1e\x1f\x85 chars",
    *CORPUS[:20],
]

STYLES = ("gpt2", "llama3", "qwen2", "smollm")

# Characters that stress pre-tokenizer regexes: contractions, digits, whitespace of all kinds.
TRICKY = list(" \t\n\r\x0b\x0c\x1c\x1f\x85\u00a0\u2028\u3000'sStTdDlLvVmMrReE0123456789٣½")
TRICKY += ["é", "e\u0301", "日", "🙂", "🦀", "👍🏽", "-", ".", "?", "'", "_", "$"]
CHARS = st.characters(exclude_categories=("Cs",))  # lone surrogates are not valid text
TEXTS = st.lists(st.one_of(CHARS, st.sampled_from(TRICKY)), max_size=40).map("".join)


def _train(style: str, initial_alphabet: bool = True) -> HFTokenizer:
    """A small byte-level BPE in the given style, trained on CORPUS."""
    ignore_merges = style == "llama3"
    hf = HFTokenizer(models.BPE(ignore_merges=ignore_merges))
    if style == "gpt2":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif style == "smollm":
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    else:
        pattern = LLAMA3_PATTERN if style == "llama3" else QWEN2_PATTERN
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if style == "qwen2":
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if initial_alphabet else [],
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS, trainer)
    if style == "qwen2":
        hf.add_tokens([TOOL])
        hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return hf


@pytest.fixture(scope="module", params=STYLES)
def pair(request, tmp_path_factory) -> tuple[str, HFTokenizer, Tokenizer]:
    """(style, Hugging Face tokenizer, tinyinfer tokenizer loaded from its tokenizer.json)."""
    hf = _train(request.param)
    folder = tmp_path_factory.mktemp(request.param, numbered=False)
    hf.save(str(folder / "tokenizer.json"))
    return request.param, hf, load_tokenizer(folder)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> tuple[HFTokenizer, Tokenizer]:
    """The qwen2-style pair alone: NFC normalizer and a non-special added token."""
    hf = _train("qwen2")
    folder = tmp_path_factory.mktemp("qwen2-only")
    hf.save(str(folder / "tokenizer.json"))
    return hf, load_tokenizer(folder)


def _expected_text(style: str, text: str) -> str:
    """What decoding the ids of ``text`` gives back: the text after the normalizer."""
    return unicodedata.normalize("NFC", text) if style == "qwen2" else text


def test_same_ids_as_hugging_face_on_examples(pair) -> None:
    style, hf, tok = pair
    for text in EXAMPLES + CORPUS:
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids, text
        assert tok.decode(ids) == _expected_text(style, text)


@settings(max_examples=80, deadline=None)
@given(text=TEXTS)
def test_same_ids_as_hugging_face_on_any_text(pair, text: str) -> None:
    style, hf, tok = pair
    ids = tok.encode(text)
    assert ids == hf.encode(text).ids
    assert tok.decode(ids) == _expected_text(style, text)


def test_loaded_tokenizer_describes_its_vocabulary(pair) -> None:
    style, hf, tok = pair
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.eos_token_id == hf.token_to_id(EOT) == tok.special_tokens[EOT]
    expected_specials = {EOT, "<|im_start|>", "<|im_end|>"} if style == "qwen2" else {EOT}
    assert set(tok.special_tokens) == expected_specials
    assert tok.name == style  # the folder's name
    text = "per-token bytes: café 🦀"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_special_token_text_is_encoded_as_plain_text(pair) -> None:
    style, hf, tok = pair
    text = f"a{EOT}b <|im_end|>"
    ids = tok.encode(text)
    assert not set(ids) & set(tok.special_tokens.values())
    assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id]) == EOT


def test_non_special_added_tokens_are_matched_in_text(qwen2) -> None:
    hf, tok = qwen2
    ids = tok.encode(f"x{TOOL}y")
    assert hf.token_to_id(TOOL) in ids
    assert TOOL not in tok.special_tokens


def test_decomposed_accents_are_normalized_like_hugging_face(qwen2) -> None:
    hf, tok = qwen2
    assert isinstance(tok, HuggingFaceTokenizer)  # tiktoken has no normalizers
    assert tok.encode("cafe\u0301") == tok.encode("café") == hf.encode("cafe\u0301").ids


def test_tiktoken_file_round_trip_gives_same_ids(tmp_path: Path) -> None:
    hf = _train("gpt2")
    ranks, specials, pattern = ranks_from_tokenizer_json(json.loads(hf.to_str()))
    assert pattern == GPT2_PATTERN
    assert specials == {EOT: 0}
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken", ranks)
    assert read_tiktoken_ranks(tmp_path / "tokenizer.tiktoken") == ranks
    config = {
        "added_tokens_decoder": {"0": {"content": EOT, "special": True}},
        "eos_token": {"content": EOT},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_id == 0
    assert tok.special_tokens == {EOT: 0}
    for text in EXAMPLES:
        assert tok.encode(text) == hf.encode(text).ids, text


def test_tiktoken_file_without_config_has_no_specials(tmp_path: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256}
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken", ranks)
    tok = load_tokenizer(tmp_path)
    assert tok.special_tokens == {}
    assert tok.eos_token_id is None
    assert tok.vocab_size == 257
    assert tok.encode("abc ab") == [256, ord("c"), ord(" "), 256]


def _gpt2_folder(tmp_path: Path, config: dict | None = None) -> Path:
    """A folder holding a gpt2-style tokenizer.json (and a tokenizer_config.json if given)."""
    _train("gpt2").save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_eos_from_config_string_and_argument_override(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path, {"eos_token": "!"})
    assert load_tokenizer(folder).eos_token_id == load_tokenizer(folder).encode("!")[0]
    assert load_tokenizer(folder, eos_token_id=5).eos_token_id == 5


def test_eos_is_none_without_config_or_endoftext(tmp_path: Path) -> None:
    data = json.loads(_train("gpt2").to_str())
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


def test_incremental_decoder_streams_emoji_split_across_tokens(pair) -> None:
    style, hf, tok = pair
    crab = tok.encode("🦀")  # not in the training corpus: split into byte-level pieces
    assert len(crab) >= 2
    stream = IncrementalDecoder(tok)
    assert [stream.push(i) for i in crab] == [""] * (len(crab) - 1) + ["🦀"]
    text = _expected_text(style, "streamed: café 🦀👍🏽 東京 done")
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)


def test_incremental_decoder_flushes_an_unfinished_character(pair) -> None:
    style, hf, tok = pair
    stream = IncrementalDecoder(tok)
    first_byte_of_crab = tok.encode("🦀")[0]
    assert stream.push(first_byte_of_crab) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(tok.encode("a")[0]) == "a"
    assert stream.flush() == ""


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_incremental_decoder_agrees_with_decode(pair, data) -> None:
    style, hf, tok = pair
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    stream = IncrementalDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


def test_missing_folder_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="tokenizer.tiktoken and tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read .*tokenizer.json"),
        ("[1, 2]", "must hold a JSON object"),
        ("{}", "tokenizer.json: not a Hugging Face tokenizer.json"),
    ],
)
def test_corrupt_tokenizer_json(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_config(tmp_path: Path) -> None:
    folder = _gpt2_folder(tmp_path)
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(folder)


def test_merges_out_of_id_order_are_rejected() -> None:
    data = json.loads(_train("gpt2").to_str())
    data["model"]["merges"].reverse()
    with pytest.raises(TokenizerError, match="merge order"):
        ranks_from_tokenizer_json(data)


def test_bpe_trained_without_every_byte_runs_on_tokenizers(tmp_path: Path) -> None:
    hf = _train("gpt2", initial_alphabet=False)
    with pytest.raises(TokenizerError, match="no token for .* single byte.*0x00"):
        ranks_from_tokenizer_json(json.loads(hf.to_str()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HuggingFaceTokenizer)
    for text in EXAMPLES:
        assert tok.encode(text) == hf.encode(text).ids, text


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


def test_wordpiece_and_unigram_tokenizers_are_rejected() -> None:
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(TokenizerError, match="'WordPiece'"):
        ranks_from_tokenizer_json(json.loads(wordpiece.to_str()))
    unigram = HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))
    with pytest.raises(TokenizerError, match="'Unigram'"):
        ranks_from_tokenizer_json(json.loads(unigram.to_str()))


def test_sentencepiece_style_bpe_is_rejected() -> None:
    data = json.loads(_train("gpt2").to_str())
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
    with pytest.raises(TokenizerError, match="does not end in ByteLevel"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("gpt2").to_str())
    data["model"]["byte_fallback"] = True
    with pytest.raises(TokenizerError, match="byte_fallback"):
        ranks_from_tokenizer_json(data)


def test_unsupported_pre_tokenizer_options_are_rejected() -> None:
    data = json.loads(_train("llama3").to_str())
    data["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"
    with pytest.raises(TokenizerError, match="behavior='Removed'"):
        ranks_from_tokenizer_json(data)
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"String": " "}
    with pytest.raises(TokenizerError, match="needs a Regex pattern"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("smollm").to_str())
    data["pre_tokenizer"]["pretokenizers"][0]["individual_digits"] = False
    with pytest.raises(TokenizerError, match=r"pre-tokenizer sequence \['Digits'.*no tiktoken twin"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("gpt2").to_str())
    data["pre_tokenizer"]["add_prefix_space"] = True
    with pytest.raises(TokenizerError, match="add_prefix_space"):
        ranks_from_tokenizer_json(data)


def test_other_unsupported_tokenizer_json_features_are_rejected(tmp_path: Path) -> None:
    data = json.loads(_train("qwen2").to_str())
    data["normalizer"] = {"type": "Lowercase"}
    with pytest.raises(TokenizerError, match="normalizer 'Lowercase'"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("gpt2").to_str())
    data["added_tokens"][0]["lstrip"] = True
    with pytest.raises(TokenizerError, match="lstrip/rstrip/single_word"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("gpt2").to_str())
    data["model"]["vocab"]["▁the"] = len(data["model"]["vocab"])
    with pytest.raises(TokenizerError, match="not written in the byte-level alphabet"):
        ranks_from_tokenizer_json(data)
    data = json.loads(_train("gpt2").to_str())
    data["model"]["merges"].append(["t", "h", "e"])
    with pytest.raises(TokenizerError, match="is not a pair of tokens"):
        ranks_from_tokenizer_json(data)


def test_decode_rejects_ids_outside_the_vocabulary(pair) -> None:
    style, hf, tok = pair
    for bad in (tok.vocab_size, -1, 2**40, "7"):
        with pytest.raises(TokenizerError, match="is not a token of"):
            tok.decode([1, bad])
        with pytest.raises(TokenizerError, match="is not a token of"):
            tok.token_bytes(bad)
        if isinstance(bad, int) and bad >= 0:
            assert IncrementalDecoder(tok).push(bad) == ""  # a padding id the model generated
        else:
            with pytest.raises(TokenizerError, match="is not a token of"):
                IncrementalDecoder(tok).push(bad)


def test_decode_rejects_ids_in_a_gap_of_the_vocabulary() -> None:
    ranks = {bytes([b]): b for b in range(256)}
    encoding = tiktoken.Encoding(
        "gappy", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|end|>": 300}
    )
    tok = TiktokenTokenizer(encoding, 300, "gappy")
    assert tok.vocab_size == 301
    assert tok.decode([104, 105, 300]) == "hi<|end|>"
    with pytest.raises(TokenizerError, match="token id 280"):
        tok.decode([280])


def test_encode_rejects_non_text(pair) -> None:
    style, hf, tok = pair
    with pytest.raises(TokenizerError, match="can only encode str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


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


def test_tiktoken_gpt2_failure_is_a_tokenizer_error(gpt2_or_error) -> None:
    if not isinstance(gpt2_or_error, TokenizerError):
        pytest.skip("tiktoken loaded gpt2 here, so there is no failure to check")
    assert "gpt2" in str(gpt2_or_error)
    assert "tokenizer.json" in str(gpt2_or_error)


@pytest.fixture
def model_with_broken_tokenizer(oracle_model, tmp_path: Path) -> Path:
    """A saved model whose tokenizer.json names a model type no library reads."""
    src, _ = oracle_model("llama-gqa-untied")
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    data = json.loads(_train("gpt2").to_str())
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
