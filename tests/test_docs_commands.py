"""Every `tinyinfer` command the README and docs/ show in a code block is one a reader will
paste: each must parse with the real command line, and the cheap ones run here, in document
order, in a scratch folder (a later command may use what an earlier one wrote, as a reader's
would). The rest (GPU, torch compile, long benchmarks, interactive programs) carry the
`by_hand` mark: `python -m pytest -m by_hand tests/test_docs_commands.py` runs them before a
release, on a machine that has what they need."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tinyinfer.cli.commands import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "lessons" / "README.md",
        *sorted((ROOT / "lessons").glob("*/README.md"))]
FENCE = re.compile(r"^```")
COMMAND = re.compile(r"tinyinfer [a-z-]+( |$)")


def code_lines(text: str) -> list[str]:
    """Lines inside fenced (```) or indented (4 spaces, after a blank line) code blocks."""
    lines, fenced, indented, previous_blank = [], False, False, True
    for line in text.splitlines():
        blank = not line.strip()
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif fenced:
            lines.append(line.strip())
        else:
            indented = line.startswith("    ") and (indented or previous_blank) or (indented and blank)
            if indented and not blank:
                lines.append(line.strip())
        previous_blank = blank
    return lines


def commands(path: Path) -> list[list[str]]:
    """The `tinyinfer ...` commands in a document's code blocks, comments stripped."""
    found = []
    for line in code_lines(path.read_text()):
        line = line.removeprefix("$ ")
        if not COMMAND.match(line):  # a screen capture also starts with the program's name
            continue
        argv = shlex.split(line, comments=True)
        assert not any(a.startswith("/tmp") for a in argv), f"{path.name}: `{line}` writes outside the reader's folder"
        found.append(argv)
    return found


ALL = [(path, argv) for path in DOCS for argv in commands(path)]
CHEAP_COMMANDS = {"generate", "info", "simulate", "quantize"}
INTERACTIVE = {"tui", "serve"}


def runs_here(argv: list[str]) -> bool:
    """Cheap on a 2-core CPU with no network: NumPy-runner commands that end on their own."""
    text = " ".join(argv)
    return (argv[1] in CHEAP_COMMANDS and "~" not in text and "cuda" not in text
            and "--tensor-parallel" not in text and "--runner torch" not in text
            and "--tui" not in argv and argv[-1] != "--calibrate")


def ident(case: tuple[Path, list[str]]) -> str:
    return f"{case[0].relative_to(ROOT)}: {' '.join(case[1][1:])}"


def test_the_docs_show_commands():
    assert len(ALL) > 40 and any(runs_here(argv) for _, argv in ALL)


@pytest.mark.parametrize("case", ALL, ids=ident)
def test_every_documented_command_parses(case):
    _, argv = case
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"`{' '.join(argv)}` does not parse: {err.getvalue().strip()}")


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tinyinfer", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if any(runs_here(a) for a in commands(p))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_cheap_documented_commands_run(path, tmp_path):
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # commands name recorded results in docs/
    for argv in filter(runs_here, commands(path)):
        done = run(argv, tmp_path)
        assert done.returncode == 0, f"`{' '.join(argv)}` failed:\n{done.stderr[-2000:]}"


@pytest.mark.by_hand
@pytest.mark.parametrize("case", [c for c in ALL if not runs_here(c[1])], ids=ident)
def test_the_other_documented_commands_run(case, tmp_path):
    path, argv = case
    if argv[1] in INTERACTIVE or "--tui" in argv:
        pytest.skip("interactive: run it in a terminal and look")
    if argv[1] == "lesson" and argv[2] in ("check", "run") and "--solution" not in argv:
        pytest.skip("runs the student's own code; tests/test_lessons.py runs every solution")
    (tmp_path / "docs").symlink_to(ROOT / "docs")
    done = run(argv, tmp_path)
    assert done.returncode == 0, f"`{' '.join(argv)}` failed:\n{done.stderr[-2000:]}"
