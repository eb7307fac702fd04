"""gpt-fast, the GPU peer, timed at a tinyinfer preset's shape with random weights.

gpt-fast (pytorch-labs/gpt-fast) is not a package and is never copied into this project: this
script imports its modules from a checkout whose path you give, builds its ``Transformer`` at
the shape of a tinyinfer bench preset, fills it with random weights, optionally quantizes it
with gpt-fast's own handlers, and times gpt-fast's own ``generate`` the way its README does
(``decode_one_token`` compiled with mode="reduce-overhead", one compiling run first, then
timed runs: new tokens / wall time of ``generate``, prefill included).

One GPU:

    python scripts/peer_gpt_fast.py --gpt-fast peers/gpt-fast --preset llama-3-8b --quantize int4

Tensor parallel, through gpt-fast's own ``tp.py`` (it reads torchrun's environment):

    torchrun --standalone --nproc-per-node 2 scripts/peer_gpt_fast.py --gpt-fast peers/gpt-fast --preset llama-3-8b

gpt-fast's int8 and int4 handlers quantize every ``nn.Linear``, the LM head included.
``quantize.py`` imports gpt-fast's tokenizer module, so sentencepiece and tiktoken must be
importable (no tokenizer is loaded: the prompt is random token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def model_args(preset: str, max_len: int, model_args_cls: type) -> object:
    """gpt-fast's ModelArgs at the shape of a tinyinfer bench preset."""
    from tinyinfer.bench.shapes import shape_config

    config, raw = shape_config(preset, max_len)
    if config.family != "llama":
        sys.exit(f"peer_gpt_fast: gpt-fast runs Llama-family shapes; {preset} is {config.family}")
    scaling = raw.get("rope_scaling")
    if scaling:
        scaling = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")}
    return model_args_cls(
        block_size=max_len, vocab_size=config.vocab_size, n_layer=config.num_layers,
        n_head=config.num_heads, n_local_heads=config.num_kv_heads, dim=config.hidden_size,
        intermediate_size=config.intermediate_size, rope_base=float(raw.get("rope_theta", 10000.0)),
        norm_eps=config.norm_eps, rope_scaling=scaling or None)


def build(args: argparse.Namespace, rank: int | None):
    import torch
    import model as gf_model  # gpt-fast's model.py

    torch.set_default_dtype(torch.bfloat16)
    max_len = args.prompt_tokens + args.max_tokens + 8
    with torch.device("cuda"):
        torch.manual_seed(args.seed)  # every rank the same weights before sharding
        model = gf_model.Transformer(model_args(args.preset, max_len, gf_model.ModelArgs))
        for p in model.parameters():  # random weights of a trained model's scale
            torch.nn.init.normal_(p, std=0.02)
    if args.quantize != "none":
        import quantize as gf_quant  # gpt-fast's quantize.py

        if args.quantize == "int8":
            handler = gf_quant.WeightOnlyInt8QuantHandler(model)
        else:
            gf_quant.prepare_int4_weight_and_scales_and_zeros = _int4_pack_for_this_torch(gf_quant)
            handler = gf_quant.WeightOnlyInt4QuantHandler(model, groupsize=args.group_size)
        state = handler.create_quantized_state_dict()
        with torch.device("cuda"):
            model = handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    if rank is not None:
        from tp import apply_tp  # gpt-fast's tp.py

        apply_tp(model)
    return model.to("cuda").eval()


def _int4_pack_for_this_torch(gf_quant):
    """gpt-fast's int4 preparation, for torch 2.5 and later.

    gpt-fast hands ``_convert_weight_to_int4pack`` int32 codes, one per element; since torch 2.5
    that operator takes uint8 with two codes per byte, the even column in the high nibble. This
    packs gpt-fast's own codes that way and calls the same operator; its quantization (group
    scales and zeros) and its matmul kernel are unchanged."""
    import torch

    def prepare(weight_bf16, groupsize, inner_k_tiles):
        codes, scales_and_zeros = gf_quant.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
        packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles), scales_and_zeros

    return prepare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt-fast", required=True, type=Path, help="a gpt-fast checkout")
    parser.add_argument("--preset", default="llama-3-8b", help="a tinyinfer bench preset")
    parser.add_argument("--quantize", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="timed runs after the compiling one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the result here (rank 0)")
    args = parser.parse_args()
    if not (args.gpt_fast / "generate.py").is_file():
        sys.exit(f"peer_gpt_fast: no gpt-fast checkout at {args.gpt_fast} (generate.py missing)")
    sys.path.insert(0, str(args.gpt_fast.resolve()))

    import torch
    import generate as gf  # gpt-fast's generate.py: sets its inductor options on import
    from tp import maybe_init_dist

    began = time.perf_counter()
    rank = maybe_init_dist()
    torch.cuda.set_device(rank or 0)
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if rank is not None else 1

    def say(what: str) -> None:  # progress, so that a run cut short shows how far it got
        if rank in (None, 0):
            print(f"gpt-fast [{time.perf_counter() - began:6.1f} s] {what}", flush=True)

    say(f"TP={world}: building the model")
    model = build(args, rank)
    # gpt-fast's own count of a step's bytes (every parameter and buffer outside the embedding),
    # taken before generate() adds its KV cache
    size, _ = gf._get_model_size(model)
    gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, 1024, (args.prompt_tokens,), device="cuda", dtype=torch.int64)

    decoded = [0]

    def first_steps(_token: object) -> None:  # the first run's first decode steps: when each came
        decoded[0] += 1
        if decoded[0] in (1, 2, 3):
            say(f"first generate: decode step {decoded[0]} queued")

    def once(callback: Any = lambda _token: None) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out, _ = gf.generate(model, prompt, args.max_tokens, batch_size=1, interactive=False,
                             draft_model=None, temperature=0.8, top_k=200, callback=callback)
        torch.cuda.synchronize()
        return (out.size(-1) - args.prompt_tokens) / (time.perf_counter() - start)

    say("first generate: compiling decode_one_token and capturing its graphs")
    start = time.perf_counter()
    once(first_steps)  # compiles and captures
    compile_s = time.perf_counter() - start
    # where the compile went (Dynamo's and Inductor's phases, summed over the run) and how many
    # graphs it compiled (a recompile shows as more than one)
    from torch._dynamo.utils import compile_times, counters

    try:
        phases = compile_times(repr="str", aggregate=True)
    except ImportError as missing:  # it tabulates with the tabulate package
        phases = f"(no table: {missing})"
    graphs = dict(counters["stats"])
    say(f"compiled and captured in {compile_s:.1f} s; Dynamo stats {graphs}\n{phases}")
    rates = []
    for run in range(args.runs):  # a line a run, so that a run cut short shows where it stopped
        rates.append(once())
        say(f"timed run {run + 1} of {args.runs}: {rates[-1]:.1f} tok/s")
    if rank not in (None, 0):
        _leave(rank)
        return
    rate = statistics.median(rates)
    result = {
        "peer": "gpt-fast", "commit": _commit(args.gpt_fast), "preset": args.preset,
        "weights": "bf16" if args.quantize == "none" else
                   f"{args.quantize}" + (f"-g{args.group_size}" if args.quantize == "int4" else ""),
        "tensor_parallel": world, "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens, "tok_s": rate, "tok_s_runs": rates,
        "compile_s": compile_s, "compile_phases": phases, "dynamo_stats": graphs,
        "inductor_settings": {k: getattr(torch._inductor.config, k) for k in (
            "coordinate_descent_tuning", "fx_graph_cache", "compile_threads")},
        "bytes_per_step_per_rank": size,
        "achieved_bytes_s_per_rank": size * rate,
        "card": torch.cuda.get_device_name(), "torch": torch.__version__,
    }
    print(f"gpt-fast {args.preset} {result['weights']} TP={world}: {rate:.1f} tok/s "
          f"(median of {args.runs}; compile {compile_s:.1f} s; {size / 1e9:.2f} GB per step per rank, "
          f"{size * rate / 1e12:.2f} TB/s) on {result['card']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    _leave(rank)


def _leave(rank: int | None) -> None:
    """Leave gpt-fast's process group, after the result is out: on 4 x H100 its ranks did not
    return from destroy_process_group within 75 s of their last timed run (2026-11-27)."""
    import torch

    if rank is not None:
        torch.distributed.destroy_process_group()


def _commit(checkout: Path) -> str | None:
    """The checkout's commit, where whoever fetched it wrote it down in a COMMIT file."""
    marker = checkout / "COMMIT"
    return marker.read_text().strip() if marker.is_file() else None


if __name__ == "__main__":
    main()
