"""The arguments every model-loading command shares, and the one call that loads what they name."""

from __future__ import annotations

import argparse

from tinyinfer.cli.common import add_threads_arg, positive_int


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that choose a model and how it runs, the same on every command that loads one."""
    parser.add_argument("--model", default="bundled",
                        help="'bundled', 'bundled-draft' or a Hugging Face model folder")
    parser.add_argument("--runner", choices=("numpy", "torch"), default="numpy",
                        help="numpy = readable reference, torch = fast path")
    parser.add_argument("--device", default=None,
                        help="torch device, e.g. cpu or cuda (torch runner; default: cuda if any, "
                             "else cpu)")
    parser.add_argument("--dtype", default=None,
                        help="float32/float64 (numpy); float32/float16/bfloat16 (torch) (default: "
                             "float32; bfloat16 for torch on cuda)")
    parser.add_argument("--quantize", default=None, metavar="FORMAT",
                        help="quantize linear weights as they load: int8, int4, int4-g64, "
                             "int4-g32-asym, ... (default: none, the checkpoint's precision)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes (GPUs with NCCL, CPU with gloo); "
                             "torch runner")
    add_threads_arg(parser)


def load_model(args: argparse.Namespace):
    """The model the command-line arguments name, split over processes if asked."""
    import tinyinfer

    return tinyinfer.load(args.model, runner=args.runner, device=args.device, dtype=args.dtype,
                          quantize=args.quantize, tensor_parallel=args.tensor_parallel)
