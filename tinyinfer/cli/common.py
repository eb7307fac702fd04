"""What every tinyinfer command line shares: one help layout, one error line, the same argument types."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn

from tinyinfer.runners import threads

PREFIX = "tinyinfer: error:"


def fail(message: str, status: int = 2) -> int:
    """Print `tinyinfer: error: MESSAGE` as one line on stderr; return the exit status to use."""
    print(f"{PREFIX} {' '.join(str(message).split())}", file=sys.stderr)
    return status


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, with "(default: X)" after every option that has a default to show and
    whose help does not already speak of its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default == argparse.SUPPRESS or default == [])
        if shown and "default" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser (and the subparsers it makes) with the shared help layout, whose usage
    errors are the one line `tinyinfer: error: ...` and exit status 2."""

    def __init__(self, *args: Any, formatter_class: type = HelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse says "argument --max-tokens: must be ..."; say "--max-tokens must be ..."
        message = re.sub(r"^argument (\S+): must ", r"\1 must ", message).removeprefix("argument ")
        fail(f"{message}; see {self.prog} --help")
        sys.exit(2)

    def _get_value(self, action: argparse.Action, text: str) -> Any:
        try:
            return super()._get_value(action, text)
        except argparse.ArgumentError as exc:  # argparse's own message quotes by repr: value: 'x'
            raise argparse.ArgumentError(action, exc.message.replace(f": {text!r}", f" (got {text})")) from None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own message quotes by repr: 'x' (choose from 'a', 'b'); a const (the value
        # of an optional-valued flag given bare) is the program's, not the user's, to choose
        if action.choices is not None and value not in action.choices and value is not action.const:
            choices = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice {value} (choose from {choices})")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def add_alias(parser: argparse.ArgumentParser, old: str, dest: str, **kwargs: Any) -> None:
    """Keep an old spelling of an option working, hidden from --help (it fills the same dest)."""
    parser.add_argument(old, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)


def add_json(parser: argparse.ArgumentParser, what: str, **kwargs: Any) -> None:
    """`--json FILE`: write WHAT as JSON to FILE, `-` meaning stdout."""
    parser.add_argument("--json", default=None, metavar="FILE",
                        help=f"write {what} as JSON to FILE (- for stdout)", **kwargs)


def write_json(path: str | None, text: str) -> None:
    """Write JSON text where --json asked: nowhere (None), stdout (-) or a file."""
    if path == "-":
        print(text)
    elif path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N",
                        help="CPU threads for NumPy's BLAS and torch (default: OMP_NUM_THREADS if "
                             f"set, else physical cores, at most {threads.DEFAULT_CAP})")
