"""The batched prefill attention on one GPU: correctness, then offline throughput with it off
and on, and transformers on the same requests.

    PYTHONPATH=. python3 scripts/gpu_prefill_check.py --out $OUT [--requests 256] [--only checks,bench]

(--device cpu --dtype float32 --preset gpt2 --requests 2 --max-num-seqs 2 --skip-peer --only bench
runs the bench section's code on a CPU as a dry run.)

Sections (each writes its results to OUT/gpu_prefill_check.json as soon as it finishes):

* checks  the Triton prefill kernel against the torch version (per-sequence
          scaled_dot_product_attention) in bf16 and int8 K/V, random packed sequences — whole
          prompts, chunks after cached prefixes, chunks starting inside pages — on four head
          shapes, both against the same attention in float32; the K/V written, bit for bit;
          per-layer attention time of both on a throughput-like step
* bench   the llama-3.2-1b shape (random bf16 weights), nano-vllm's offline workload through
          continuous batching as ``tinyinfer bench throughput`` runs it, with
          prefill_attention "torch" (before) and "triton" (after): seconds, tokens/s, warm-up
          (untimed), TTFT, the prefill phase's prompt tokens/s, and a prefill-only run
          (max_tokens=1); then transformers ``generate`` on the same requests
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import median_ms  # noqa: E402

from tinyinfer.bench import shapes as bs  # noqa: E402
from tinyinfer.engine import Engine  # noqa: E402
from tinyinfer.runners import torch_layers  # noqa: E402
from tinyinfer.sampling import SamplingParams  # noqa: E402

SECTIONS = ("checks", "bench")


def log(text: str) -> None:
    print(text, flush=True)


def packed_case(plan, heads, kv_heads, hd, page, int8, gen, device):
    """Random packed sequences: plan = [(cached tokens, new tokens)] -> qkv, chunks, cache, cos, sin."""
    num_pages = sum(-(-(c + n) // page) for c, n in plan) + 1
    if int8:
        codes = torch.randint(-127, 128, (2, num_pages, page, kv_heads, hd), generator=gen,
                              device=device, dtype=torch.int8)
        scales = (torch.rand((2, num_pages, page, kv_heads), generator=gen, device=device) * 0.03).half()
        cache = (*codes.unbind(0), *scales.unbind(0))
    else:
        cache = tuple(torch.randn((2, num_pages, page, kv_heads, hd), generator=gen, device=device,
                                  dtype=torch.bfloat16).unbind(0))
    width = max(-(-(c + n) // page) for c, n in plan)
    order = torch.randperm(num_pages - 1, generator=gen, device=device)
    tables, used = torch.zeros((len(plan), width), dtype=torch.int64, device=device), 0
    for b, (c, n) in enumerate(plan):
        count = -(-(c + n) // page)
        tables[b, :count] = order[used:used + count]
        used += count
    positions = torch.cat([torch.arange(c, c + n, device=device) for c, n in plan])
    seqs = torch.cat([torch.full((n,), b, device=device) for b, (_, n) in enumerate(plan)])
    slots = tables[seqs, positions // page] * page + positions % page
    starts = [0]
    for _, n in plan:
        starts.append(starts[-1] + n)
    qkv = torch.randn((starts[-1], (heads + 2 * kv_heads) * hd), generator=gen, device=device,
                      dtype=torch.bfloat16)
    angles = torch.arange(4096.0, dtype=torch.float64)[:, None] * torch.rand(hd // 2, dtype=torch.float64) * 0.1
    cos, sin = angles.cos().float().to(device), angles.sin().float().to(device)
    from tinyinfer.runners.torch_triton_prefill import query_tiles

    chunks = torch_layers.PrefillChunks(
        starts=tuple(starts), context_lens=tuple(c + n for c, n in plan), positions=positions,
        slots=slots, page_tables=tables,
        tiles=torch.from_numpy(query_tiles(starts)).to(device))
    return qkv, chunks, cache, cos, sin


def named(cache: tuple) -> dict:
    """An int8 cache's scales as keyword arguments (none for a bf16 cache)."""
    return dict(zip(("k_scale", "v_scale"), cache[2:]))


def check_kernel(results: dict) -> None:
    from tinyinfer.runners import torch_triton_prefill

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(5)
    rng = np.random.default_rng(5)
    out = results["kernel"] = []
    for heads, kv_heads, hd in ((32, 8, 64), (32, 8, 128), (12, 12, 64), (14, 2, 64)):
        for int8 in (False, True):
            plan = [(0, int(rng.integers(1, 1100)))]  # a whole prompt
            plan += [(int(rng.integers(0, 1500)), int(rng.integers(1, 700))) for _ in range(9)]
            plan += [(16 * 30, 512), (16 * 30 + 5, 1)]  # a chunk on a page boundary; one token
            qkv, chunks, cache, cos, sin = packed_case(plan, heads, kv_heads, hd, 16, int8, gen, device)
            ref_cache = tuple(c.clone() for c in cache)
            ref = torch_layers.packed_prefill_attention(qkv, chunks, *ref_cache[:2], cos, sin, heads,
                                                        **named(ref_cache))
            got_cache = tuple(c.clone() for c in cache)
            got = torch_triton_prefill.paged_prefill_attention(qkv, chunks, *got_cache[:2], cos, sin,
                                                               heads, **named(got_cache))
            f32_cache = tuple(c.float() if c.dtype == torch.bfloat16 else c.clone() for c in cache)
            exact = torch_layers.packed_prefill_attention(qkv.float(), chunks, *f32_cache[:2], cos,
                                                          sin, heads, **named(f32_cache))
            scale = exact.abs().max().item()
            row = {"shape": [heads, kv_heads, hd], "kv": "int8" if int8 else "bf16",
                   "rows": qkv.shape[0], "sequences": len(plan),
                   "triton_vs_fp32": (got.float() - exact).abs().max().item() / scale,
                   "torch_vs_fp32": (ref.float() - exact).abs().max().item() / scale,
                   "triton_vs_torch": (got.float() - ref.float()).abs().max().item() / scale,
                   "kv_written_identical": all(torch.equal(a, b) for a, b in zip(got_cache, ref_cache)),
                   # rotated k may round differently in its last bit (fused multiply-adds)
                   "kv_written_max_diff": max((a.float() - b.float()).abs().max().item()
                                              for a, b in zip(got_cache, ref_cache)),
                   "kv_written_elements_differing": sum(int((a != b).sum()) for a, b in zip(got_cache, ref_cache))}
            row["ok"] = row["triton_vs_fp32"] <= 2e-2
            out.append(row)
            log(json.dumps(row))
    # Per-layer attention time on a throughput-like step: 15 fresh prompts of ~546 tokens, and
    # 8 chunks of 1024 after prefixes of 0..1500 tokens (llama-3.2-1b heads).
    times = results["attention_ms"] = {}
    for name, plan in (("15 prompts x 546", [(0, 546)] * 15),
                       ("8 chunks of 1024 after 0-1500", [(int(c), 1024) for c in np.linspace(0, 1500, 8)])):
        qkv, chunks, cache, cos, sin = packed_case(plan, 32, 8, 64, 16, False, gen, device)
        args = (qkv, chunks, *cache, cos, sin, 32)
        times[name] = {
            "torch (SDPA per sequence)": median_ms(partial(torch_layers.packed_prefill_attention, *args), 20, device),
            "triton (one launch)": median_ms(partial(torch_triton_prefill.paged_prefill_attention, *args), 20, device),
        }
        log(f"{name}: {times[name]}")


def use_prefill(model, kind: str) -> None:
    """Switch the runner's prefill attention between its two implementations."""
    from tinyinfer.runners import torch_fast

    runner = model.runner
    runner.prefill_attention_kind = kind
    runner.prefill_attention = (torch_fast._triton_prefill_attention() if kind == "triton"
                                else torch_layers.packed_prefill_attention)


def check_model(model, results: dict) -> None:
    """One mixed step (prefill chunks after cached prefixes, and decodes) both ways."""
    from tinyinfer.runners.runner import make_batch

    rng = np.random.default_rng(3)
    vocab, page = model.config.vocab_size, 16
    ids = [rng.integers(0, vocab, n).tolist() for n in (700, 300, 40, 1000, 200)]
    tables, first = [], 0
    for seq in ids:
        count = -(-len(seq) // page)
        tables.append(list(range(first, first + count)))
        first += count
    logits = {}
    for kind in ("torch", "triton"):
        use_prefill(model, kind)
        kv = model.runner.new_kv_cache(first, page)
        model.runner.forward(make_batch([(s[:len(s) // 2], 0, t, False) for s, t in zip(ids, tables)], page), kv)
        step = [(s[len(s) // 2:], len(s) // 2, t, True) for s, t in zip(ids[:3], tables)]
        step += [(s[len(s) // 2:len(s) // 2 + 1], len(s) // 2, t, False) for s, t in zip(ids[3:], tables[3:])]
        logits[kind] = model.runner.forward(make_batch(step, page), kv)
    a, b = logits["torch"], logits["triton"]
    results["model_step"] = {"rows": int(a.shape[0]),
                             "max_rel_diff": float(np.abs(a - b).max() / np.abs(a).max()),
                             "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean())}
    log(json.dumps(results["model_step"]))


def free_memory() -> None:
    """Drop a finished engine's pages before the next engine sizes its pool by free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def throughput(model, workload, max_num_seqs: int = 256) -> dict:
    """bench_throughput's run (same engine options, same warm-up), timing every step to give
    TTFT and the prefill phase, then a prefill-only run (max_tokens=1)."""
    pages = bs._pages_for(model, workload, max_num_seqs, 0.5)
    options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, num_pages=pages,
                   detail="none")
    warm = Engine(model, **options)
    for i, r in enumerate(workload):
        warm.add_request(list(r.prompt_ids[:16]), SamplingParams(temperature=0, max_tokens=1 + i % max_num_seqs,
                                                                  ignore_eos=True))
    t0 = time.perf_counter()
    while warm.has_unfinished():
        warm.step()
    warmup_s = time.perf_counter() - t0
    del warm
    free_memory()
    engine = Engine(model, **options)
    start = time.perf_counter()
    ids = [engine.add_request(list(r.prompt_ids), SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                                 ignore_eos=True))
           for r in workload]
    first_token: dict[str, float] = {}
    prefill_steps = 0
    while engine.has_unfinished():
        trace = engine.step()
        now = time.perf_counter() - start
        prefill_steps += trace.prefill_tokens > 0
        for s in trace.seqs:
            if s.kind == "prefill" and s.token_id is not None:
                first_token.setdefault(s.request_id, now)
    seconds = time.perf_counter() - start
    tokens = sum(len(engine.release(i).token_ids) for i in ids)
    ttft = sorted(first_token.values())
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    # prefill only: every prompt, one token each
    del engine
    free_memory()
    engine = Engine(model, **options)
    t0 = time.perf_counter()
    for r in workload:
        engine.add_request(list(r.prompt_ids), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    prefill_only = time.perf_counter() - t0
    del engine
    free_memory()
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "warmup_s": warmup_s, "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1],
            "prompt_tokens": prompt_tokens, "steps_with_prefill": int(prefill_steps),
            "prefill_phase_tokens_per_s": prompt_tokens / ttft[-1],
            "prefill_only_s": prefill_only, "prefill_only_tokens_per_s": prompt_tokens / prefill_only}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--skip-peer", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "torch": torch.__version__}
    if args.device == "cuda":
        results["card"] = torch.cuda.get_device_name()

    def save() -> None:
        (args.out / "gpu_prefill_check.json").write_text(json.dumps(results, indent=2))

    only = args.only.split(",")
    if "checks" in only:
        try:
            check_kernel(results)
        except Exception:  # noqa: BLE001  (recorded; the timings still run)
            results["kernel_error"] = traceback.format_exc()
            log(results["kernel_error"])
        save()
    if "bench" in only:
        try:
            model, peer = bs.shape_models(args.preset, args.device, args.dtype,
                                          with_peer=not args.skip_peer)
        except ImportError:  # a broken transformers install: still measure our two runs
            results["peer_error"] = traceback.format_exc()
            log(results["peer_error"])
            model, peer = bs.shape_models(args.preset, args.device, args.dtype)
        log(f"runner: {model.runner.describe()}")
        if "checks" in only:
            try:
                check_model(model, results)
            except Exception:  # noqa: BLE001  (recorded; the timings still run)
                results["model_step_error"] = traceback.format_exc()
                log(results["model_step_error"])
            save()
        low, high = bs.offline_lengths(model.config.max_model_len)
        workload = bs.offline_workload(args.requests, model.config.vocab_size, low, high, seed=0)
        runs = results["throughput"] = {"requests": args.requests}
        for kind in ("torch", "triton") if args.device == "cuda" else ("torch",):
            use_prefill(model, kind)
            runs[f"prefill_attention={kind}"] = throughput(model, workload, args.max_num_seqs)
            log(f"{kind}: {json.dumps(runs[f'prefill_attention={kind}'])}")
            save()
        if peer is not None:
            result = bs.peer_throughput(peer, workload)
            runs["transformers"] = dataclasses.asdict(result)
            for kind in ("torch", "triton"):
                ours = runs.get(f"prefill_attention={kind}")
                if ours:
                    runs[f"ratio {kind}"] = ours["tokens_per_s"] / result.tokens_per_second
            log(f"transformers: {json.dumps(runs['transformers'])}")
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
