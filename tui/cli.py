"""`tinyinfer tui`: the command line of the TUI (wired into tinyinfer's CLI, also `python -m tui`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinyinfer.cli.args import add_draft_quantize_args, add_kv_cache_dtype_arg, check_draft_quantize
from tinyinfer.cli.common import Parser, add_threads_arg, fail, positive_int
from tinyinfer.errors import TinyInferError
from tui.options import Options
from tui.scenarios import SCENARIOS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `tui` command to a subparsers group and return its parser."""
    scenarios = "; ".join(f"{s.name}: {s.title}" for s in SCENARIOS.values())
    parser = subparsers.add_parser(
        "tui", help="step through a real inference run in the terminal (guided walkthrough)",
        description="Watch a real model run one engine step at a time: tokens, prefill and decode, "
                    "KV pages, sampling and attention, with a narrated walkthrough. Press ? inside.")
    parser.add_argument("--scenario", choices=tuple(SCENARIOS), default="single",
                        help=f"classroom demo to run ({scenarios})")
    parser.add_argument("--model", default="bundled", help="'bundled' or a Hugging Face model folder")
    parser.add_argument("--runner", choices=("numpy", "torch"), default=None,
                        help="numpy = reference (records attention), torch = fast path "
                             "(default: numpy; torch with --tensor-parallel)")
    parser.add_argument("--device", default=None,
                        help="torch device, e.g. cuda (torch runner; with --tensor-parallel: cpu "
                             "unless given)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes and show which rank owns which "
                             "heads and pages (torch runner)")
    parser.add_argument("--speculative", choices=("draft", "lookup"), nargs="?", const="auto",
                        default=None,
                        help="start with speculative decoding on: draft uses --draft-model, lookup "
                             "prompt n-grams; with no value, a draft model if there is one, else "
                             "lookup (d switches it inside) (default: off, unless the scenario has it)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for speculative decoding (default: bundled-draft with the "
                             "bundled model, else prompt lookup, which needs no second model)")
    parser.add_argument("--num-draft", type=positive_int, default=4, metavar="K",
                        help="tokens drafted per step")
    add_draft_quantize_args(parser, default="the draft model as saved")
    parser.add_argument("--quantize", default=None, metavar="FORMAT",
                        help="load the weights quantized: int8, int4, int4-g64, int4-g32-asym, ... "
                             "(shows the Quantization panel; m switches precision inside)")
    add_kv_cache_dtype_arg(parser)
    parser.add_argument("--replay", type=Path, default=None, metavar="FILE",
                        help="replay a recorded trace (JSON lines) without loading a model")
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="write every step's trace to FILE as JSON lines (for --replay)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--free", action="store_true", help="start in free mode, without narration")
    parser.add_argument("--no-timings", action="store_true",
                        help="hide wall-clock times (for identical screens run to run)")
    add_threads_arg(parser)
    return parser


def options_from_args(args: argparse.Namespace) -> Options:
    """The launch settings the parsed command line asks for."""
    return Options(model=args.model, runner=args.runner or ("torch" if args.tensor_parallel > 1 else "numpy"),
                   device=args.device, tensor_parallel=args.tensor_parallel, scenario=args.scenario,
                   speculative=args.speculative is not None,
                   drafter=None if args.speculative == "auto" else args.speculative,
                   draft_model=args.draft_model, num_draft=args.num_draft,
                   draft_quantize=args.draft_quantize, draft_quantize_head=args.draft_quantize_head,
                   quantize=args.quantize,
                   kv_cache_dtype=args.kv_cache_dtype,
                   replay=args.replay, record=args.record,
                   seed=args.seed, walkthrough=not args.free, show_timings=not args.no_timings)


def run(args: argparse.Namespace) -> int:
    """Start the TUI with parsed arguments; returns the exit status."""
    from tinyinfer.display import progress
    from tui.app import TinyInferApp
    from tui.session import load_model

    if args.replay is not None and not args.replay.is_file():
        return fail(f"no trace file {args.replay}: record one with --record FILE")
    options = options_from_args(args)
    options.check()
    model = None
    if options.tensor_parallel > 1:  # worker processes cannot be started once Textual runs
        print(f"tinyinfer tui: starting {options.tensor_parallel} processes for {options.model} …",
              file=sys.stderr)
        model = load_model(options)
    try:
        with progress.hidden():  # Textual owns the terminal: no bars drawn under it
            TinyInferApp(options, model).run()
    finally:  # run() has returned, so no engine step is in flight
        if model is not None:
            model.runner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tui`: the same options as `tinyinfer tui`."""
    parser = Parser(prog="python -m")  # so the command reads `python -m tui`
    tui_parser = add_parser(parser.add_subparsers())
    try:
        return run(tui_parser.parse_args(argv))
    except TinyInferError as exc:
        return fail(str(exc))
