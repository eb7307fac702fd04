"""Lesson 01 experiment: your tokenizer on the model's own vocabulary, and characters per token (C19)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import ModuleType

from lessons.support import claim, heading, heldout_text, load_model, table
from tinyinfer.errors import TokenizerError
from tinyinfer.tokenizer import GPT2_PATTERN, ranks_from_tokenizer_json, read_tiktoken_ranks, tiktoken_gpt2

LINE = "MACBETH:\nIs this a dagger which I see before me,\n"


def model_ranks(folder: Path) -> tuple[dict[bytes, int], str]:
    """The ranks table and pre-tokenizer regex of a model folder's tokenizer files."""
    if (folder / "tokenizer.json").is_file():
        try:
            ranks, _, pattern = ranks_from_tokenizer_json(json.loads((folder / "tokenizer.json").read_text("utf-8")))
        except TokenizerError as e:
            raise TokenizerError(f"this lesson's BPE is byte-level BPE as tiktoken runs it, and {folder.name}'s "
                                 f"tokenizer is not ({e}); run it on the bundled model") from None
        return ranks, pattern
    return read_tiktoken_ranks(folder / "tokenizer.tiktoken"), GPT2_PATTERN


def modern_prose() -> str:
    """Modern English: the prose paragraphs of this lesson's text (no code, tables or headings)."""
    lines = (Path(__file__).parent / "README.md").read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if line and not line.startswith(("    ", "|", "#", "`")))


def run(impl: ModuleType, quick: bool, model: str) -> None:
    """Encode held-out text with the student's BPE, compare with the engine, measure chars/token."""
    m = load_model(model)
    ranks, pattern = model_ranks(m.path)
    text = heldout_text(4000 if quick else None)

    heading("your encode vs the engine's tokenizer, on held-out Shakespeare")
    start = time.perf_counter()
    mine = impl.encode(text, ranks, pattern)
    yours_s = time.perf_counter() - start
    start = time.perf_counter()
    engine = m.tokenizer.encode(text)
    engine_s = time.perf_counter() - start
    same = mine == engine
    others = m.config.vocab_size - len(ranks)  # e.g. <|endoftext|>: no bytes, so no merge makes it
    print(f"{len(text):,} characters -> {len(engine):,} tokens (a vocabulary of {len(ranks):,} byte-pair "
          f"tokens" + (f"; the model's {m.config.vocab_size:,} ids hold {others} more, special" if others > 0 else "")
          + ")")
    print(f"your ids {'match' if same else 'DO NOT match'} the engine's"
          + ("" if same else f" (first difference at token {_first_difference(mine, engine)})"))
    print(f"time: yours {yours_s * 1e3:.0f} ms in Python, tiktoken {engine_s * 1e3:.1f} ms in Rust")
    print(f"round trip: decode(encode(text)) == text is {impl.decode(mine, ranks) == text}")

    heading("one line, token by token")
    pieces = [impl.decode([i], ranks) for i in impl.encode(LINE, ranks, pattern)]
    print("|" + "|".join(p.replace("\n", "\\n") for p in pieces) + "|")
    print(f"{len(LINE)} characters, {len(pieces)} tokens")

    heading("characters per token")
    texts = {"held-out Shakespeare": text, "modern English prose": modern_prose(),
             "Python source": Path(__file__).read_text(encoding="utf-8")}
    rows, measured = [], {}
    gpt2 = _gpt2()
    for name, sample in texts.items():
        measured[name] = impl.chars_per_token(sample, impl.encode(sample, ranks, pattern))
        gpt2_cpt = len(sample) / len(gpt2.encode(sample)) if gpt2 else None
        rows.append((name, len(sample), measured[name], "n/a" if gpt2_cpt is None else gpt2_cpt))
    print(table(("text", "characters", f"{m.name} tokenizer", "GPT-2 tokenizer"), rows))
    if gpt2 is None:
        print("(GPT-2's tokenizer is not available offline: tiktoken downloads it once. With the "
              "internet, this column fills in.)")

    shakespeare, prose = measured["held-out Shakespeare"], measured["modern English prose"]
    inside = 3.0 <= shakespeare <= 4.0
    why = (f"this vocabulary has {len(ranks):,} tokens; the rule of thumb comes from 50-100K-token "
           "vocabularies trained on web text, which hold more whole words" if shakespeare < 3.0 else
           "this tokenizer was trained on this kind of text, so its merges cover whole words well")
    claim("C19", f"{shakespeare:.2f} chars/token on held-out Shakespeare, {prose:.2f} on modern prose "
          f"({m.name} tokenizer)", inside, why)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _gpt2():
    """GPT-2's tokenizer if tiktoken has it cached, else None."""
    try:
        return tiktoken_gpt2()
    except TokenizerError:
        return None


if __name__ == "__main__":
    from lessons.course import experiment_main

    raise SystemExit(experiment_main(__file__))
