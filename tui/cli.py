"""`tinyinfer tui`: the command line of the TUI (wired into tinyinfer's CLI, also `python -m tui`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinyinfer.errors import TinyInferError

from tui.scenarios import SCENARIOS


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `tui` command to a subparsers group and return its parser."""
    from tinyinfer.cli import add_threads_arg, positive_int  # here: tinyinfer.cli imports this module

    scenarios = "; ".join(f"{s.name}: {s.title}" for s in SCENARIOS.values())
    parser = subparsers.add_parser(
        "tui", help="step through a real inference run in the terminal (guided walkthrough)",
        description="Watch a real model run one engine step at a time: tokens, prefill and decode, "
                    "KV pages, sampling and attention, with a narrated walkthrough. Press ? inside.")
    parser.add_argument("--scenario", choices=tuple(SCENARIOS), default="single",
                        help=f"classroom demo to run ({scenarios}); default: single")
    parser.add_argument("--model", default="bundled",
                        help="'bundled' or a Hugging Face model folder (default: bundled)")
    parser.add_argument("--runner", choices=("numpy", "torch"), default=None,
                        help="numpy = reference (records attention), torch = fast path "
                             "(default: numpy; torch with --tensor-parallel)")
    parser.add_argument("--device", default=None,
                        help="torch device, e.g. cuda (torch runner; with --tensor-parallel: cpu "
                             "unless given)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes and show which rank owns which "
                             "heads and pages (torch runner; default: 1)")
    parser.add_argument("--speculative", action="store_true",
                        help="start with speculative decoding on (d switches it inside)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model for speculative decoding (default: bundled-draft with the "
                             "bundled model, else prompt lookup, which needs no second model)")
    parser.add_argument("--num-draft", type=int, default=4, help="tokens drafted per step (default: 4)")
    parser.add_argument("--quantize", default=None, metavar="FORMAT",
                        help="load the weights quantized: int8, int4, int4-g64, int4-g32-asym, ... "
                             "(shows the Quantization panel; m switches precision inside)")
    parser.add_argument("--replay", type=Path, default=None, metavar="FILE",
                        help="replay a recorded trace (JSON lines) without loading a model")
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="write every step's trace to FILE as JSON lines (for --replay)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--free", action="store_true", help="start in free mode, without narration")
    parser.add_argument("--no-timings", action="store_true",
                        help="hide wall-clock times (for identical screens run to run)")
    add_threads_arg(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Start the TUI with parsed arguments; returns the exit status."""
    from tinyinfer import progress
    from tui.app import TinyInferApp
    from tui.options import Options
    from tui.session import load_model

    if args.replay is not None and not args.replay.is_file():
        print(f"tinyinfer tui: error: no trace file {args.replay}: record one with --record FILE",
              file=sys.stderr)
        return 2
    runner = args.runner or ("torch" if args.tensor_parallel > 1 else "numpy")
    options = Options(model=args.model, runner=runner, device=args.device,
                      tensor_parallel=args.tensor_parallel, scenario=args.scenario,
                      speculative=args.speculative, draft_model=args.draft_model,
                      num_draft=args.num_draft, quantize=args.quantize,
                      replay=args.replay, record=args.record,
                      seed=args.seed, walkthrough=not args.free, show_timings=not args.no_timings)
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
    parser = argparse.ArgumentParser(prog="python -m")  # so the command reads `python -m tui`
    tui_parser = add_parser(parser.add_subparsers())
    try:
        return run(tui_parser.parse_args(argv))
    except TinyInferError as exc:
        print(f"python -m tui: error: {exc}", file=sys.stderr)
        return 2
