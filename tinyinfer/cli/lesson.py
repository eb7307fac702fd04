"""`tinyinfer lesson`: the classroom course — list, start, check and run lessons (see lessons/README.md)."""

from __future__ import annotations

import argparse
from typing import Any

from tinyinfer.cli.common import fail


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `lesson` command and its actions on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "lesson", help="the course: build each stage yourself, check it, measure a claim with it",
        description="Lessons where you implement one stage of inference, check it against the "
                    "engine's reference, and run an experiment with your code inside the engine.")
    try:
        from lessons.course import add_arguments
    except ImportError as exc:
        parser.set_defaults(lesson_missing=str(exc))
        return parser
    add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Carry out `tinyinfer lesson ACTION ...`; returns the exit status."""
    missing = getattr(args, "lesson_missing", None)
    if missing is not None:  # not the user's input: the installation lacks the course
        return fail(f"the course is not installed with this tinyinfer ({missing}); install "
                    "tinyinfer from a checkout with `pip install -e .`", status=1)
    from lessons.course import run_command

    return run_command(args)
