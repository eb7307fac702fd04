"""The `tinyinfer` command: generate, info, bench; the front ends (chat, serve, tui, lesson,
simulate, quantize) register their own subcommands."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tinyinfer.cli import lesson as cli_lesson
from tinyinfer.cli import quantize as cli_quantize
from tinyinfer.cli import serve as cli_serve
from tinyinfer.cli import simulate as cli_simulate
from tinyinfer.cli import chat as cli_chat
from tinyinfer.cli.args import (
    add_async_scheduling_arg,
    add_draft_quantize_args,
    add_model_args,
    add_sampling_args,
    draft_quantization,
    load_model,
    runner_options,
    sampling_params,
)
from tinyinfer.cli.common import (
    Parser,
    add_alias,
    add_json,
    fail,
    positive_int,
    write_json,
)
from tinyinfer.display.tables import human_bytes
from tinyinfer.engine_config import DEFAULTS
from tinyinfer.errors import InvalidLogitsError, TinyInferError, missing_package
from tinyinfer.runners import threads
from tui import cli as tui_cli


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="tinyinfer",
        description="An LLM inference engine you can step through. Runs offline on its bundled model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; `tinyinfer COMMAND --help` tells more")

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed as it is produced",
                         description="Load a model and stream the text it generates after PROMPT "
                                     "to stdout (the prompt first).")
    gen.add_argument("prompt", help="the prompt text")
    add_model_args(gen)
    add_sampling_args(gen, max_tokens=100)
    gen.add_argument("--speculative", choices=("draft", "lookup"), default=None,
                     help="speculative decoding: draft uses --draft-model, lookup prompt n-grams "
                          "(default: off)")
    gen.add_argument("--draft-model", default="bundled-draft", help="draft model for --speculative draft")
    gen.add_argument("--num-draft", type=positive_int, default=4, metavar="K",
                     help="tokens drafted per step")
    add_draft_quantize_args(gen)
    add_async_scheduling_arg(gen)
    gen.add_argument("--stats", action="store_true",
                     help="print time to first token, tokens generated and tokens/s to stderr")

    info = sub.add_parser("info", help="architecture, parameters, weight and KV-cache memory",
                          description="Describe a model from its config: architecture, parameter "
                                      "count, weight memory per format and KV-cache memory.")
    add_model_args(info)
    bench = sub.add_parser("bench", help="measure the engine on reproducible synthetic workloads",
                           description="Run one benchmark workload, print its table and optionally "
                                       "write the results as JSON (docs/benchmarks.md).")
    bench.add_argument("workload", choices=("batching", "prefix", "latency", "throughput",
                                            "speculative"),
                       help="batching: continuous vs static, paged vs contiguous (C8, C9); "
                            "prefix: TTFT with and without a prefix-cache hit (C17); "
                            "latency: batch-1 TTFT/TPOT and %% of the memory roofline (C2); "
                            "throughput: 256 requests of 100-1024 tokens (C13); "
                            "speculative: plain vs speculative greedy decode (C10)")
    add_model_args(bench)
    bench.add_argument("--preset", default=None,
                       help="random weights of a real shape instead of --model (latency, throughput, "
                            "speculative): gpt2, llama-3.2-1b, qwen2.5-0.5b, llama-3-8b (always the torch "
                            "runner; --runner is ignored)")
    bench.add_argument("--peer", choices=("transformers", "llama.cpp"), default=None,
                       help="also run Hugging Face transformers generate on the same weights (latency, "
                            "throughput), or llama.cpp on the same GGUF file and thread count (latency)")
    bench.add_argument("--requests", type=positive_int, default=None, metavar="N",
                       help="requests (default: batching 200, throughput 256)")
    bench.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="N",
                       help=f"concurrent sequences (default: batching {DEFAULTS.max_num_seqs}, throughput 256)")
    bench.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="N",
                       help="prompt length (latency; default 512)")
    bench.add_argument("--max-tokens", type=positive_int, default=None, metavar="N",
                       help="tokens generated per request (latency, speculative; default 128)")
    add_alias(bench, "--decode-tokens", "max_tokens", type=positive_int)
    bench.add_argument("--system-tokens", type=positive_int, default=None, metavar="N",
                       help="shared prefix length (prefix; default 512)")
    bench.add_argument("--speculative", choices=("draft", "lookup", "oracle"), default=None,
                       help="drafter for the speculative workload (default draft); oracle: the draft model runs "
                            "for its cost while the target's own greedy tokens are proposed, "
                            "each kept with chance --acceptance")
    bench.add_argument("--draft-model", default=None,
                       help="draft model (speculative; default bundled-draft, or with --preset "
                            "the llama-3.2-1b shape)")
    bench.add_argument("--acceptance", type=float, default=None, metavar="A",
                       help="per-token acceptance of the oracle drafter, 0..1 (default 0.8)")
    bench.add_argument("--num-draft", type=positive_int, default=None, metavar="K",
                       help="tokens drafted per step (speculative; default 4)")
    bench.add_argument("--task", choices=("continue", "rewrite"), default=None,
                       help="speculative prompts: continue a cue (default), or rewrite a given passage")
    add_draft_quantize_args(bench)
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    add_async_scheduling_arg(bench)
    add_json(bench, "the results")
    for module in FRONT_ENDS.values():
        module.add_parser(sub)
    return parser


# Options that only some bench workloads read: each workload that reads one, and its default there.
SPECULATIVE_DEFAULTS = {"speculative": "draft", "draft_model": None, "num_draft": 4, "task": "continue",
                        "acceptance": None, "draft_quantize": None, "draft_quantize_head": False}
WORKLOAD_OPTIONS: dict[str, dict[str, object]] = {
    "prompt_tokens": {"latency": 512},
    "max_tokens": {"latency": 128, "speculative": 128},
    "system_tokens": {"prefix": 512},
    "requests": {"batching": 200, "throughput": 256},
    "max_num_seqs": {"batching": DEFAULTS.max_num_seqs, "throughput": 256},
    "preset": {"latency": None, "throughput": None, "speculative": None},
    "peer": {"latency": None, "throughput": None},
    **{name: {"speculative": default} for name, default in SPECULATIVE_DEFAULTS.items()},
}
# The drafters that run a draft model (the ones --draft-model and --draft-quantize apply to).
MODEL_DRAFTERS = ("draft", "oracle")


def workload_options(args: argparse.Namespace) -> None:
    """Refuse an option the workload does not read (a reader would think it took effect), then
    fill in each unset option the workload's default."""
    refused: dict[tuple[str, ...], list[str]] = {}
    for name, defaults in WORKLOAD_OPTIONS.items():
        given = getattr(args, name) is not None and getattr(args, name) is not False  # 0.0 is given
        if given and args.workload not in defaults:
            refused.setdefault(tuple(defaults), []).append(f"--{name.replace('_', '-')}")
    if refused:
        said = []
        for workloads, flags in refused.items():
            where = f"{workloads[0]} only" if len(workloads) == 1 else ", ".join(workloads[:-1]) + f" and {workloads[-1]}"
            said.append(f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} to bench {where}")
        them = "it" if sum(map(len, refused.values())) == 1 else "them"
        raise TinyInferError(f"{'; '.join(said)}: drop {them} for bench {args.workload}")
    for name, defaults in WORKLOAD_OPTIONS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults.get(args.workload))


def cmd_bench(args: argparse.Namespace) -> int:
    workload_options(args)
    if args.acceptance is not None and args.speculative != "oracle":
        raise TinyInferError("--acceptance sets the oracle drafter's rate: add --speculative oracle")
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        raise TinyInferError(f"--acceptance must be within 0..1, got {args.acceptance}")
    draft_quantization(args, MODEL_DRAFTERS)  # refuses a bad combination before any model loads
    if args.async_scheduling and args.workload not in ("latency", "throughput", "speculative"):
        raise TinyInferError("--async-scheduling applies to bench latency, throughput and speculative: "
                             f"drop it for bench {args.workload}")
    if args.async_scheduling and args.workload == "speculative" and args.speculative not in MODEL_DRAFTERS:
        raise TinyInferError("--async-scheduling overlaps speculative steps with a draft model only: "
                             f"drop it, or pass --speculative {' or '.join(MODEL_DRAFTERS)}")
    if args.workload in ("latency", "throughput") or args.preset:
        return _bench_shapes(args)
    from tinyinfer.bench import workloads as bench

    model = load_model(args)
    print(f"model {model.name}, runner {model.runner.name}", file=sys.stderr)
    print(threads.describe())
    if args.workload == "speculative":
        results = _bench_speculative(model, args)
    elif args.workload == "batching":
        results = bench.bench_batching(model, args.requests, args.max_num_seqs, seed=args.seed)
        print(bench.batching_table(results))
    else:
        results = bench.bench_prefix(model, system_tokens=args.system_tokens, seed=args.seed)
        print(f"shared prefix {results.system_tokens} tokens: TTFT miss {results.ttft_miss_ms:.1f} ms, "
              f"hit {results.ttft_hit_ms:.1f} ms ({results.cached_tokens} tokens cached), "
              f"{results.speedup:.1f}x faster")
    write_json(args.json, bench.to_json(results, threads=threads.report()))
    return 0


def _bench_shapes(args: argparse.Namespace) -> int:
    """latency / throughput: a preset shape (random weights) or a model folder, plus a peer."""
    import json

    from tinyinfer.bench import shapes as bs
    from tinyinfer.weights.gguf_file import is_gguf

    with_peer = args.peer == "transformers"
    if with_peer:
        bs.require_transformers()
        # "none": a quantized file's weights as floats
        if args.quantize not in (None, "none") or args.quantize_head:
            raise TinyInferError("--peer transformers runs float weights: measure it in a run "
                                 "without --quantize")
    if args.peer and args.tensor_parallel > 1:
        raise TinyInferError(f"--peer {args.peer} runs the whole model on one device: measure it "
                             "in a run without --tensor-parallel")
    if args.peer == "llama.cpp" and (args.preset or args.workload != "latency"):
        raise TinyInferError("--peer llama.cpp measures batch-1 latency of a GGUF file: "
                             "bench latency --model FILE.gguf (or smollm2)")
    if args.preset:
        from tinyinfer.runners.torch_weights import pick_device, pick_dtype

        chosen = pick_device(args.device)  # checks a given device; else CUDA where present
        device = args.device or chosen.type
        dtype = args.dtype or str(pick_dtype(None, chosen.type == "cuda")).removeprefix("torch.")
        if args.tensor_parallel > 1:
            if args.quantize or args.quantize_head:
                raise TinyInferError("tensor parallelism shards float weights: drop --quantize or "
                                     "--tensor-parallel")
            model = bs.shape_tensor_parallel(args.preset, args.tensor_parallel, device, dtype,
                                             kv_cache_dtype=args.kv_cache_dtype,
                                             **runner_options(args, preset=True))
            peer = None
        else:
            model, peer = bs.shape_models(args.preset, device, dtype, with_peer=with_peer,
                                          quantize=args.quantize, quantize_head=args.quantize_head,
                                          kv_cache_dtype=args.kv_cache_dtype,
                                          **runner_options(args, preset=True))
    elif args.tensor_parallel > 1:
        model, peer = load_model(args), None
    else:
        model, peer = bs.folder_models(args.model, args.runner, args.device, args.dtype, with_peer,
                                       quantize=args.quantize, quantize_head=args.quantize_head,
                                       kv_cache_dtype=args.kv_cache_dtype, **runner_options(args))
    print(f"model {model.name}, runner {model.runner.name}", file=sys.stderr)
    if args.peer == "llama.cpp" and not is_gguf(model.path):
        raise TinyInferError(f"--peer llama.cpp runs GGUF files; {model.name} is a model folder")
    counts = threads.report()
    if args.workload == "speculative":
        from tinyinfer.bench import workloads as bench

        print(threads.describe(counts))
        write_json(args.json, bench.to_json(_bench_speculative(model, args), threads=counts))
        return 0
    if args.workload == "latency":
        results = [bs.bench_latency(model, args.prompt_tokens, args.max_tokens,
                                    async_scheduling=args.async_scheduling)]
        if peer is not None:
            results.append(bs.peer_latency(peer, model.config.vocab_size, args.prompt_tokens,
                                           args.max_tokens))
        if args.peer == "llama.cpp":
            from tinyinfer.bench.llama_cpp import llama_cpp_latency

            results.append(llama_cpp_latency(model.path, threads.use(args.threads), model.config.vocab_size,
                                             args.prompt_tokens, args.max_tokens))
        print(bs.latency_table(results, threads.describe(counts)))
    else:
        low, high = bs.offline_lengths(model.config.max_model_len)
        if high < bs.OFFLINE_LENGTHS[1]:
            print(f"note: {model.name} has a {model.config.max_model_len}-token context: prompt and "
                  f"output lengths drawn from {low}..{high} instead of "
                  f"{bs.OFFLINE_LENGTHS[0]}..{bs.OFFLINE_LENGTHS[1]}", file=sys.stderr)
        workload = bs.offline_workload(args.requests, model.config.vocab_size, low, high, seed=args.seed)
        results = [bs.bench_throughput(model, workload, max_num_seqs=args.max_num_seqs,
                                       async_scheduling=args.async_scheduling)]
        if peer is not None:
            results.append(bs.peer_throughput(peer, workload))
        print(bs.throughput_table(results, threads.describe(counts)))
    write_json(args.json, json.dumps([{**bs.as_dict(r), "threads": counts} for r in results], indent=2))
    return 0


def _bench_speculative(model, args: argparse.Namespace):
    """Plain vs speculative greedy decoding on the chosen prompts; prints two lines."""
    from tinyinfer.bench import workloads as bench

    args.runner = model.runner.name
    drafter = make_drafter(args, preset=args.preset, acceptance=args.acceptance)
    result = bench.bench_speculative(model, drafter,
                                     bench.speculative_prompts(model, args.task),
                                     max_tokens=args.max_tokens, num_draft=args.num_draft,
                                     spec_async=args.async_scheduling)
    scheduling = ", asynchronous scheduling" if result.async_scheduling else ""
    print(f"{result.drafter} drafter{scheduling}, k={result.num_draft}, {args.task}: plain "
          f"{result.plain_tokens_per_second:.1f} tok/s (asynchronous scheduling "
          f"{result.plain_async_tokens_per_second:.1f}), speculative "
          f"{result.speculative_tokens_per_second:.1f} tok/s ({result.speedup:.2f}x; "
          f"{result.speedup_vs_async:.2f}x asynchronous plain), acceptance "
          f"{100 * result.acceptance_rate:.0f}% (per examined token "
          f"{100 * result.token_acceptance:.0f}%), {result.mean_accepted:.2f} accepted per verify, "
          f"identical output: {result.identical}")
    print(f"costs: plain step {result.plain_step_ms:.2f} ms, draft step {result.draft_step_ms:.2f} ms, "
          f"verify {result.verify_ms:.2f} ms, rest of a step {result.other_ms:.2f} ms; closed form (simulator's formula) "
          f"{result.closed_form_speedup:.2f}x")
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    import tinyinfer

    if args.async_scheduling and args.speculative and args.speculative != "draft":  # before any model loads
        raise TinyInferError("--async-scheduling overlaps speculative steps with a draft model only: "
                             "drop --async-scheduling, or pass --speculative draft")
    draft_quantization(args, ("draft",))
    params = sampling_params(args)
    model = load_model(args)
    # Asynchronous scheduling keeps no step-by-step trace (detail "none"); generate reads none.
    engine = tinyinfer.Engine(model, drafter=make_drafter(args), num_draft=args.num_draft,
                              async_scheduling=args.async_scheduling,
                              detail="none" if args.async_scheduling else DEFAULTS.detail)
    request_id = engine.add_request(args.prompt, params)  # a bad prompt fails here, before any output
    sys.stdout.write(args.prompt)
    while engine.completion(request_id).finish_reason is None:
        engine.step()
        sys.stdout.write(engine.stream_text(request_id))
        sys.stdout.flush()
    sys.stdout.write(engine.stream_text(request_id) + "\n")  # the tail held back for --stop
    done = engine.release(request_id)
    if done.error is not None:
        raise InvalidLogitsError(done.error)
    if args.stats:
        print(f"[{model.name} on {model.runner.name}] {generation_stats(done)}", file=sys.stderr)
        if engine.drafter is not None:
            s = engine.spec_stats
            print(f"[speculative {engine.drafter.name}] acceptance {100 * s.acceptance_rate:.0f}%, "
                  f"{s.mean_accepted:.2f} accepted per step, {s.forwards_saved} target forwards saved",
                  file=sys.stderr)
    return 0


def generation_stats(done) -> str:
    """Time to first token, tokens generated and the decode rate of a finished completion."""
    m, tokens = done.metrics, len(done.token_ids)
    text = f"time to first token {1e3 * m.ttft:.0f} ms, {tokens} tokens generated"
    if tokens > 1:
        text += f", {(tokens - 1) / (m.finished - m.first_token):.1f} tokens/s after the first"
    return text


def make_drafter(args: argparse.Namespace, preset: str | None = None,
                 acceptance: float | None = None):
    """The drafter --speculative asks for, or None. With a preset (bench), the draft model is a
    preset shape too; acceptance is the oracle drafter's (bench)."""
    from tinyinfer.speculative import DraftModelDrafter, PromptLookupDrafter

    if args.speculative == "lookup":
        return PromptLookupDrafter()
    if args.speculative == "draft":
        return DraftModelDrafter(_draft_model(args, preset))
    if args.speculative == "oracle":
        from tinyinfer.bench.oracle import OracleDrafter

        return OracleDrafter(_draft_model(args, preset), 0.8 if acceptance is None else acceptance,
                             seed=args.seed)
    return None


def _draft_model(args: argparse.Namespace, preset: str | None):
    """--draft-model: a model (bundled-draft by default), or beside a preset a preset shape; its
    weights quantized as --draft-quantize says, else as --quantize."""
    import tinyinfer

    quantize, quantize_head = draft_quantization(args, MODEL_DRAFTERS)
    if preset:
        from tinyinfer.bench import shapes as bs
        from tinyinfer.runners.torch_weights import pick_device, pick_dtype

        chosen = pick_device(args.device)
        dtype = args.dtype or str(pick_dtype(None, chosen.type == "cuda")).removeprefix("torch.")
        name = args.draft_model or "llama-3.2-1b"
        return bs.shape_models(name, args.device or chosen.type, dtype,
                               quantize=None if quantize == "none" else quantize,
                               quantize_head=quantize_head, kv_cache_dtype=args.kv_cache_dtype)[0]
    return tinyinfer.load(args.draft_model or "bundled-draft", runner=args.runner,
                          device=args.device, dtype=args.dtype, quantize=quantize,
                          quantize_head=quantize_head, kv_cache_dtype=args.kv_cache_dtype)


def _stored_as(checkpoint) -> str:
    """What the checkpoint's files hold, by dtype or GGUF block format, read from their headers
    (which also finds a missing, truncated or corrupt file before anything claims the model is
    fine)."""
    from collections import Counter

    from tinyinfer.weights import Bf16Array, read_checkpoint

    if checkpoint.gguf is not None:
        sizes = Counter(checkpoint.gguf.stored_as())
        files = 1
    else:
        tensors, origin = read_checkpoint(checkpoint.path, lazy=True)
        sizes = Counter()
        for tensor in tensors.values():
            if isinstance(tensor, Bf16Array):
                sizes["bfloat16"] += tensor.bits.nbytes
            else:
                sizes[str(tensor.dtype)] += tensor.nbytes
        files = len(set(origin.values()))
    return (", ".join(f"{dtype} {human_bytes(n)}" for dtype, n in sizes.most_common())
            + f" in {files} file{'s' * (files != 1)}")


def cmd_info(args: argparse.Namespace) -> int:
    from tinyinfer.model import open_checkpoint
    from tinyinfer.quant import read_quant_config, weight_memory_table

    checkpoint = open_checkpoint(args.model)
    path, name, c = checkpoint.path, checkpoint.name, checkpoint.config
    saved = read_quant_config(path) if checkpoint.gguf is None else checkpoint.gguf.kept_format()
    stored = _stored_as(checkpoint)
    params = c.num_parameters
    rows = [
        ("model", f"{name} ({path})"),
        ("architecture", f"{c.model_type} (family {c.family})"),
        ("layers", str(c.num_layers)),
        ("hidden size", str(c.hidden_size)),
        ("attention", f"{c.num_heads} query heads, {c.num_kv_heads} KV heads, head dim {c.head_dim}"
                      + (" (GQA)" if 1 < c.num_kv_heads < c.num_heads else
                         " (MQA)" if c.num_kv_heads == 1 < c.num_heads else " (MHA)")),
        ("MLP", f"{c.intermediate_size} wide, " + ("SwiGLU" if c.family == "llama" else "GELU")),
        ("positions", f"RoPE theta {c.rope_theta:g}" if c.uses_rope else "learned"),
        ("vocabulary", str(c.vocab_size)),
        ("context", f"{c.max_model_len} tokens"),
        ("parameters", f"{params:,}"),
        ("stored as", stored),
        *[(f"weights {r.format}", f"{human_bytes(r.total_bytes)} "
                                  f"({r.bits_per_parameter:.2f} bits/param)")
          for r in weight_memory_table(c)],
        ("KV cache per token", f"{human_bytes(c.kv_bytes_per_token(2))} at 16-bit, "
                               f"{human_bytes(c.kv_bytes_per_token(4))} at fp32, "
                               f"{human_bytes(c.kv_bytes_per_token(1, 2))} at int8 (scales included)"),
        ("KV cache, full context", human_bytes(c.kv_bytes_per_token(2) * c.max_model_len) + " at 16-bit, "
                                   + human_bytes(c.kv_bytes_per_token(1, 2) * c.max_model_len) + " at int8"),
    ]
    if saved is not None:
        rows.append(("quantized as", saved.name))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


FRONT_ENDS = {"chat": cli_chat, "serve": cli_serve, "tui": tui_cli, "lesson": cli_lesson, "simulate": cli_simulate,
              "quantize": cli_quantize}
COMMANDS = {"generate": cmd_generate, "info": cmd_info, "bench": cmd_bench,
            **{name: module.run for name, module in FRONT_ENDS.items()}}


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK", "0") != "0":
        # torchrun started this process as a tensor-parallel rank other than 0: it serves rank
        # 0 (which runs the command) and does nothing of its own, not even bind a port
        from tinyinfer.runners.tp.launch import serve_torchrun_rank

        return serve_torchrun_rank()
    args = build_parser().parse_args(argv)
    try:
        _use_threads(args)
        return COMMANDS[args.command](args)
    except TinyInferError as exc:  # bad input: a flag's value, a model folder, a prompt
        return fail(str(exc))
    except OSError as exc:  # a file named on the command line cannot be read or written
        return fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
    except ModuleNotFoundError as exc:  # an optional package this command needs
        missing = missing_package(exc)
        if missing is None:
            raise
        return fail(str(missing))
    except KeyboardInterrupt:
        return 130


def _use_threads(args: argparse.Namespace) -> None:
    """Apply --threads (or the default rule) before any model runs; torch's pool only when the
    command will use torch, so that the NumPy path never imports it."""
    given = vars(args)  # each subcommand has its own options
    if "threads" not in given:
        return
    runs_ranks = given.get("tensor_parallel", 1) > 1 and args.command != "simulate"  # simulate only predicts them
    if (given.get("runner") == "torch" or given.get("preset") or given.get("peer")
            or runs_ranks or given.get("calibrate") == ""):
        import torch  # noqa: F401  (so that threads.use sets its pool as well)
    threads.use(args.threads)


if __name__ == "__main__":
    sys.exit(main())
