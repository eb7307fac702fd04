"""`tinyinfer quantize --model MODEL --bits 8|4 -o OUT`: write a quantized checkpoint that `tinyinfer.load` reads."""

from __future__ import annotations

import argparse
import json
import shutil
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from tinyinfer.errors import TinyInferError
from tinyinfer.quant import (
    CONFIG_FILE,
    LayerError,
    QuantConfig,
    layer_errors,
    quantize_weights,
    read_quant_config,
    save_quantized,
    weights_nbytes,
)

ERRORS_FILE = "layer_errors.json"  # each quantized weight's LayerError, written next to the checkpoint
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `quantize` command."""
    parser = subparsers.add_parser(
        "quantize", help="write an int8 / int4 weight-only quantized copy of a model",
        description="Quantize every linear layer's weight (the embedding and LM head too with "
                    "--quantize-head; norms stay in floating point) and write a checkpoint folder "
                    "that tinyinfer loads like any other.")
    parser.add_argument("--model", default=None,
                        help="'bundled', 'bundled-draft' or a Hugging Face model folder (required)")
    # the model's old place, a positional argument: kept working, hidden from --help
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--bits", type=int, required=True, choices=(8, 4),
                        help="8 = int8 (per output channel, or in groups); 4 = int4 in groups")
    parser.add_argument("--group-size", type=int, default=None,
                        help="inputs sharing one scale, 32, 64 or 128 (default: 128 for int4; "
                             "one scale per output channel for int8)")
    offset = parser.add_mutually_exclusive_group()
    offset.add_argument("--asymmetric", action="store_true",
                        help="int4 only: give each group a zero point as well as a scale")
    offset.add_argument("--minimum", action="store_true",
                        help="int4 only: give each group a float16 minimum as well as a scale "
                             "(GGUF's Q4_1 layout)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="store the token embedding and LM head in the same format (one table "
                             "when they are tied)")
    parser.add_argument("-o", "--output", required=True, metavar="FOLDER",
                        help="folder to write (must not exist or be empty)")
    return parser


def quant_config_from_args(args: argparse.Namespace) -> QuantConfig:
    """The QuantConfig the flags name (int4 defaults to groups of 128)."""
    group = args.group_size if args.group_size is not None or args.bits == 8 else 128
    return QuantConfig(bits=args.bits, group_size=group,
                       symmetric=not (args.asymmetric or args.minimum), minimum=args.minimum,
                       head=args.quantize_head)


def run(args: argparse.Namespace) -> int:
    """Quantize, write, and print sizes and per-layer-type errors."""
    from tinyinfer.model import open_checkpoint
    from tinyinfer.weights import load_weights

    if args.model is None:
        raise TinyInferError("quantize needs --model: 'bundled', 'bundled-draft' or a model folder")
    qconfig = quant_config_from_args(args)
    checkpoint = open_checkpoint(args.model)
    source, name, config = checkpoint.path, checkpoint.name, checkpoint.config
    if checkpoint.gguf is not None:
        raise TinyInferError(f"{source} is a GGUF file, quantized in blocks of its own: load it as it "
                             "is, or quantize it as it loads (--quantize) if its weights are floats")
    out = Path(args.output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TinyInferError(f"{out} already exists and is not an empty folder: choose another -o")
    saved = read_quant_config(source)
    if saved is not None:
        raise TinyInferError(f"{source} is already quantized ({saved.name}): quantize the original checkpoint")
    weights = load_weights(source, config)
    quantized = quantize_weights(weights, qconfig)
    float_dtype = config.dtype if config.dtype in ("float16", "bfloat16") else "float32"
    save_quantized(out, quantized, qconfig, float_dtype=float_dtype)
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_FILES) and path.name != CONFIG_FILE:
            shutil.copy2(path, out / path.name)
    before = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    after = (out / "model.safetensors").stat().st_size
    print(f"{name} -> {out} ({qconfig.name})")
    print(f"on disk: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB ({after / before:.1%}); "
          f"in memory: {weights_nbytes(quantized) / 1e6:.2f} MB")
    errors = layer_errors(weights, quantized)
    (out / ERRORS_FILE).write_text(json.dumps({"model": name, "format": qconfig.name,
                                               "layers": [asdict(e) for e in errors]}, indent=1))
    print(error_summary(errors))
    print(f"per-layer errors: {out / ERRORS_FILE}")
    return 0


def error_summary(errors: list[LayerError]) -> str:
    """Mean relative error and worst element error per kind of layer (q, k, v, o, gate, ...)."""
    kinds: dict[str, list[LayerError]] = defaultdict(list)
    for e in errors:
        parts = e.name.split(".")
        kinds[parts[-2] if len(parts) > 1 else e.name].append(e)  # q, ..., down; embed, lm_head
    lines = [f"{'layer':<8} {'count':>5} {'mean rel. error':>16} {'max |error|':>12}"]
    for kind, group in kinds.items():
        mean = sum(e.relative for e in group) / len(group)
        lines.append(f"{kind:<8} {len(group):>5} {mean:>16.2%} {max(e.max_abs for e in group):>12.3g}")
    return "\n".join(lines)
