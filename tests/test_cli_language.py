"""The command line speaks one language: every command described, every option explained with its
default, one flag per concept, one error line, old spellings still understood."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

import tinyinfer
from tinyinfer.cli.commands import build_parser


def parsers(parser: argparse.ArgumentParser, path: str = "tinyinfer"):
    """Every parser of the command tree with its command line, the top one first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def shown(action: argparse.Action) -> bool:
    """Whether --help lists the action (hidden aliases and the subcommand list aside)."""
    return action.help != argparse.SUPPRESS and not isinstance(action, argparse._SubParsersAction)


def rendered_help(parser: argparse.ArgumentParser, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: each option's help stays whole
    return parser.format_help()


def help_of(parser: argparse.ArgumentParser, text: str, action: argparse.Action) -> str:
    """The rendered help entry of one option: the line naming it and the line under it, if its
    help went there."""
    invocation = "  " + parser._get_formatter()._format_action_invocation(action)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line == invocation or line.startswith(invocation + "  "):
            under = lines[i + 1] if i + 1 < len(lines) else ""
            return line + (under if under.startswith(" " * 8) else "")
    raise AssertionError(f"{action.option_strings} is not in the help")


PATHS = [path for path, _ in parsers(build_parser())]


@pytest.mark.parametrize("path", PATHS)
def test_every_command_has_a_description(path):
    parser = dict(parsers(build_parser()))[path]
    assert parser.description, f"`{path} --help` has no description"


@pytest.mark.parametrize("path", PATHS)
def test_every_option_has_help_and_shows_its_default(path, monkeypatch):
    parser = dict(parsers(build_parser()))[path]
    text = rendered_help(parser, monkeypatch)
    for action in filter(shown, parser._actions):
        assert action.help, f"{path}: {action.option_strings or action.dest} has no help"
        default = action.default
        if not action.option_strings or default is None or default is False or default == []:
            continue
        if action.default == argparse.SUPPRESS:
            continue
        assert f"(default: {default})" in help_of(parser, text, action), \
            f"{path} --help does not show the default of {action.option_strings[-1]}"


# The flags the commands once spelled differently, and the one spelling each concept has now.
BANNED = {
    r"--gpus\b": "--tensor-parallel",
    r"--spec-k\b": "--num-draft",
    r"--batch\b(?!-)": "--max-num-seqs",
    r"--prompt\b(?!-)": "--prompt-tokens",
    r"--decode-tokens\b": "--max-tokens",
    r"--output (?!FOLDER)": "--max-tokens (--output is the folder quantize writes)",
}


@pytest.mark.parametrize("path", PATHS)
def test_one_flag_per_concept(path, monkeypatch):
    parser = dict(parsers(build_parser()))[path]
    text = rendered_help(parser, monkeypatch)
    for banned, instead in BANNED.items():
        assert not re.search(banned, text), f"`{path} --help` says {banned}: say {instead}"
    for action in parser._actions:
        if "--speculative" in action.option_strings:  # bench alone adds its oracle drafter
            oracle = ("oracle",) if path == "tinyinfer bench" else ()
            assert tuple(action.choices) == ("draft", "lookup", *oracle), path
        if "--json" in action.option_strings:
            assert action.metavar == "FILE" and "- for stdout" in action.help, path
    if path.split()[-1] in ("generate", "info", "bench", "serve", "tui", "simulate", "quantize"):
        assert "--model" in parser._option_string_actions, f"{path} takes no --model"


@pytest.mark.parametrize("old, new", [
    (["bench", "latency", "--decode-tokens", "7"], ["bench", "latency", "--max-tokens", "7"]),
    (["simulate", "--batch", "3", "--prompt", "5", "--output", "6", "--gpus", "2", "--spec-k", "3",
      "--json"],
     ["simulate", "--max-num-seqs", "3", "--prompt-tokens", "5", "--max-tokens", "6",
      "--tensor-parallel", "2", "--num-draft", "3", "--json", "-"]),
    (["quantize", "bundled", "--bits", "8", "-o", "out"],
     ["quantize", "--model", "bundled", "--bits", "8", "-o", "out"]),
])
def test_old_spellings_still_parse_the_same(old, new):
    parser = build_parser()
    assert parser.parse_args(old) == parser.parse_args(new)


def tinyinfer_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyinfer", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, says", [
    (["bench", "batching", "--requests", "0"], "--requests must be at least 1 (got 0)"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1 (got 0)"),
    (["simulate", "--weights", "int3"], "invalid choice int3"),
    (["simulate", "--model", "no-such-model"], "no-such-model"),
    (["simulate", "--async-scheduling"], "--async-scheduling picks runs of a recording"),
    (["lesson", "run", "nope"], "there is no lesson nope;"),
    (["quantize", "--bits", "8", "-o", "out"], "quantize needs --model"),
    (["lesson", "start"], "the following arguments are required: lesson"),
    (["nope"], "invalid choice nope"),
    (["generate", "hi", "--model", "missing/model.gguf"], "model 'missing/model.gguf': no such file or folder"),
    (["generate", "hi", "--stop", ""], "--stop must be a non-empty string (got '')"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be"),
    (["generate", "hi", "--top-p", "2"], "--top-p must be"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be"),
    (["generate", "hi", "--seed", "-1"], "--seed must be an integer >= 0 or unset (got -1)"),
    (["simulate", "--calibrate", "missing.json"],
     "cannot read recorded tensor-parallel runs from missing.json: No such file or directory"),
])
def test_a_usage_error_is_one_line_and_exit_status_2(argv, says):
    done = tinyinfer_cli(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinyinfer: error: "), done.stderr
    assert says in lines[0]


def test_stats_report_time_to_first_token_tokens_and_rate():
    done = tinyinfer_cli("generate", "ROMEO:", "--temperature", "0", "--max-tokens", "6", "--stats")
    assert done.returncode == 0, done.stderr
    expected = tinyinfer.Engine(tinyinfer.load("bundled")).generate(
        "ROMEO:", tinyinfer.SamplingParams(temperature=0, max_tokens=6))[0]
    stats = re.search(r"time to first token \d+ ms, (\d+) tokens generated, [\d.]+ tokens/s", done.stderr)
    assert stats, done.stderr
    assert int(stats.group(1)) == len(expected.token_ids)
