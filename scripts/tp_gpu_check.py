"""Tensor parallelism on GPUs: correctness, decode speed and all-reduce cost (2 or 4 GPUs, NCCL).

    PYTHONPATH=. python3 scripts/tp_gpu_check.py --out DIR [STAGE ...]   # default: every stage

Each stage adds its result, or its error, to DIR/tp_gpu_check.json as soon as it ends; run
one stage per invocation (scripts/tp_gpu_check.sh does) so a hung collective cannot stall the rest.

bundled_tp2, gqa_tp2|4_float32|bfloat16: the bundled model at TP=2, and a random GQA Llama
(8 heads, 4 KV heads, a vocabulary of 1001 that TP=4 must pad) at TP=2 and TP=4, each against one GPU in float32 with
the defaults on (torch.compile, CUDA graphs): prompt logits, greedy tokens and the log-prob of
every decoded token (decode steps replay CUDA graphs with NCCL inside); the same in bf16.
all_reduce_tp2 / _tp4: the cost of one NCCL all-reduce by message size, eager and replayed
from a CUDA graph: the simulator's link latency and bandwidth.

llama3_8b_tp1 / _tp2 / _tp4 (/ _tp4_no_graphs, _tp2_untimed, _tp2_no_mixing), llama2_70b_tp4: batch-1 decode
through ``tinyinfer.bench.shapes.bench_latency`` (prompt 512, 128 tokens), the 70B shape at TP=4 only.

profile_8b_tp1 / _tp2: torch.profiler over 20 decode steps on rank 0 — GPU kernel time, NCCL
kernel time and GPU idle time per step, and the kernel table in DIR/profile_tp<N>.txt.

8b_tp<N>[_nccl|_symm_mem|_push][_async][_profile|_batch32|_profile_batch32]: the 8B shape at prompt 128,
256 new tokens (the default all-reduce, or the one named), with a profile (decode steps by region,
the GPU's idle gaps, rank 0's host time by Python function, prefill steps) and/or the decode rate
of 32 sequences; _async: also with asynchronous scheduling (the profile then of its steps); 70b_tp4_symm_mem: the 70B shape the same way, at TP=4; cli_tp<N>[...][_torchrun]: ``tinyinfer bench latency`` as a user runs it
(spawned ranks or torchrun), with how long it took to exit after its table and whether stderr
shows a leaked semaphore, an abort or a traceback; gpt_fast_tp<N>: scripts/peer_gpt_fast.py at
the same shape (torchrun for N > 1; the checkout at $GPT_FAST, default peers/gpt-fast);
all_reduce_tp<N>_small / _LL / _LL128: the sweep over decode-sized messages with NCCL's
protocol as named, each also through torch's symmetric-memory one-shot and two-shot, the push
all-reduce (``all_reduce="push"``, messages up to 64 KB), and after a matrix product. scripts/tp_scaling.sh runs these in one call on a 4-GPU host.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tinyinfer
from tinyinfer.bench import shapes as bs
from tinyinfer.runners.tp.launch import free_port

GREEDY = tinyinfer.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
ALL_REDUCE_BYTES = (2 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)


class Report:
    """All stages' results in one JSON file; each stage process adds its own."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {
            "device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}

    def stage(self, name: str, fn: Callable[[], tuple[Any, Any]]) -> None:
        """Run a stage; write its result before closing its model (a teardown must not lose it)."""
        t = time.perf_counter()
        model = None
        try:
            result, model = fn()
        except Exception:
            result = {"error": traceback.format_exc(limit=8)}
        self.data[name] = result
        self.data[f"{name}_seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(result, indent=1)[:3000], flush=True)
        self.path.write_text(json.dumps(self.data, indent=2))
        if model is not None:
            t = time.perf_counter()
            model.runner.close()
            self.data[f"{name}_close_s"] = round(time.perf_counter() - t, 2)
            self.path.write_text(json.dumps(self.data, indent=2))


# ---------------------------------------------------------------- correctness


def compare(make_one: Callable[[], Any], make_tp: Callable[[], Any], prompts: list[list[int]]) -> tuple[dict, Any]:
    """One GPU against TP: prompt logits, greedy tokens, and log-probs of every decoded token."""
    def run(model: Any) -> tuple[np.ndarray, list]:
        logits = model.logits(prompts[0])
        engine = tinyinfer.Engine(model)
        for prompt in prompts:
            engine.add_request(prompt, GREEDY)
        steps = []
        while engine.has_unfinished():
            steps += [(s.request_id, s.token_id, s.logprob) for s in engine.step().seqs if s.token_id is not None]
        return logits, steps

    one = make_one()
    a, steps_a = run(one)
    del one
    tp = make_tp()
    b, steps_b = run(tp)
    same_tokens = [(r, t) for r, t, _ in steps_a] == [(r, t) for r, t, _ in steps_b]
    logprob_diff = max(abs(x[2] - y[2]) for x, y in zip(steps_a, steps_b)) if same_tokens else None
    return {"prompt_logits_rel_err": float(np.abs(a - b).max() / np.abs(a).max()),
            "greedy_tokens_identical": same_tokens, "decoded_tokens": len(steps_a),
            "decode_logprob_max_abs_diff": logprob_diff, "tp_runner": tp.runner.describe()}, tp


def random_llama_folder(root: Path) -> Path:
    """A transformers Llama with GQA (8 heads, 4 KV heads) and an odd vocabulary, saved to disk."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=1001, hidden_size=512, intermediate_size=1408,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folder = root / "llama-gqa"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def bundled_tp2(**options: Any) -> tuple[dict, Any]:
    tok = tinyinfer.load("bundled").tokenizer
    prompts = [tok.encode(p) for p in ("ROMEO:\nO, she doth teach the torches to burn bright!",
                                       "JULIET:", "HAMLET:")]
    one = {k: v for k, v in options.items() if k == "compile"}
    return compare(lambda: tinyinfer.load("bundled", runner="torch", device="cuda", dtype="float32", **one),
                   lambda: tinyinfer.load("bundled", runner="torch", tensor_parallel=2, device="cuda",
                                          dtype="float32", **options), prompts)


def gqa(world: int, dtype: str, **options: Any) -> tuple[dict, Any]:
    folder = random_llama_folder(Path(tempfile.mkdtemp()))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1001, n).tolist() for n in (37, 5, 120)]
    one = {k: v for k, v in options.items() if k == "compile"}
    return compare(lambda: tinyinfer.load(folder, runner="torch", device="cuda", dtype=dtype, **one),
                   lambda: tinyinfer.load(folder, runner="torch", tensor_parallel=world, device="cuda",
                                          dtype=dtype, **options), prompts)


def fused_decode_check(world: int, all_reduce: str = "symm_mem") -> tuple[dict, None]:
    """Batch-1 decode logits of the fused products under TP against one GPU: a random GQA Llama
    (8 heads, 4 KV heads, V = 1001, tinyinfer's ``random_llama_folder``), a 40-token prompt, then
    24 decode steps fed the same tokens on every runner (CUDA graphs on, compile off). Each bf16
    runner's error against one GPU in float32: one GPU's own (fused products) and TP's (fused
    products, the all-reduce named: torch's symmetric-memory one-shot by default). A wrong fused shard (a missing residual, a rank's share
    dropped) is off by the logits' own size; rounding by bf16's. One TP model per stage: a second
    symmetric-memory TP model loaded in the same process hung in its rendezvous."""
    from tinyinfer.runners.runner import make_batch

    folder = random_llama_folder(Path(tempfile.mkdtemp()))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1001, 40).tolist()
    fed = rng.integers(0, 1001, 24).tolist()

    def decode_logits(model: Any) -> tuple[np.ndarray, dict]:
        runner = model.runner
        kv = runner.new_kv_cache(16, 16)
        table = list(range(8))
        runner.forward(make_batch([(prompt, 0, table, False)], 16), kv)
        rows = [runner.forward(make_batch([([t], len(prompt) + i, table, False)], 16), kv)
                for i, t in enumerate(fed)]
        described = runner.describe()
        del kv
        if model.runner.info.tensor_parallel > 1:
            model.runner.close()
        return np.concatenate(rows), described

    def error(got: np.ndarray, described: dict) -> dict:
        return {"max_abs_err_over_max": float(np.abs(got - ref).max() / np.abs(ref).max()),
                "rel_l2_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                "argmax_agree": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
                "decode_products": described.get("decode_products"),
                "all_reduce": described.get("all_reduce")}

    ref, _ = decode_logits(tinyinfer.load(folder, runner="torch", device="cuda", dtype="float32", compile=False))
    result: dict[str, Any] = {"steps": len(fed), "card": torch.cuda.get_device_name()}
    result["one_gpu_bf16"] = error(*decode_logits(tinyinfer.load(
        folder, runner="torch", device="cuda", dtype="bfloat16", compile=False)))
    result[f"tp{world}_fused"] = error(*decode_logits(tinyinfer.load(
        folder, runner="torch", device="cuda", dtype="bfloat16", compile=False,
        tensor_parallel=world, all_reduce=all_reduce)))
    return result, None


# ---------------------------------------------------------------- all-reduce sweep


def _symm_buffers(numel: int) -> tuple[list[torch.Tensor], str]:
    """Two symmetric-memory bf16 buffers every rank can read (torch's one-shot all-reduce)."""
    from torch.distributed import _symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buffers = []
    for _ in range(2):
        buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group_name)
        buffers.append(buffer)
    return buffers, group_name


def _graph_us(fn: Callable[[], Any], reps: int) -> float:
    """Microseconds per call of ``fn`` replayed ``reps`` times from one CUDA graph (median of 5)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return 1e3 * statistics.median(times)


def _all_reduce_rank(rank: int, world: int, port: int, results: Any, sizes: tuple[int, ...]) -> None:
    """Time one bf16 all-reduce per message size: NCCL eager and in a CUDA graph; torch's
    symmetric-memory one-shot and two-shot, and the push all-reduce (messages up to its limit),
    in a graph (checked against NCCL's sum); and each after a matrix product, as between a
    model's layers."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    small = [n for n in sizes if n <= 1 << 20]
    buffers, group = _symm_buffers(max(small) // 2)
    turn = [0]
    rows = []
    from tinyinfer.runners.tp.push_all_reduce import PUSH_MAX_BYTES, PushAllReduce

    push = PushAllReduce.in_symmetric_memory(group, rank, world, torch.bfloat16, torch.device("cuda", rank))

    def one_shot(x: torch.Tensor, out: torch.Tensor) -> None:
        view = buffers[turn[0]][:x.numel()].view(x.shape)
        turn[0] ^= 1
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", group, out)

    def two_shot(x: torch.Tensor, out: torch.Tensor) -> None:
        view = buffers[turn[0]][:x.numel()].view(x.shape)
        turn[0] ^= 1
        view.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(view, "sum", group, out)

    for nbytes in sizes:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(nbytes // 2, generator=gen, device="cuda").to(torch.bfloat16)
        reference = x.clone()
        dist.all_reduce(reference)
        row: dict[str, Any] = {"bytes": nbytes}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        eager = []
        for _ in range(5):
            start.record()
            for _ in range(50):
                dist.all_reduce(x)
            end.record()
            torch.cuda.synchronize()
            eager.append(start.elapsed_time(end) / 50)
        row["eager_us"] = 1e3 * statistics.median(eager)
        row["graph_us"] = _graph_us(lambda: dist.all_reduce(x), 50)
        if nbytes in small:
            x = torch.randn(nbytes // 2, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty_like(x)
            kinds = (("one_shot", one_shot), ("two_shot", two_shot)) + ((("push", push),) if nbytes <= PUSH_MAX_BYTES else ())
            for name, fn in kinds:
                want = x.clone()
                dist.all_reduce(want)
                fn(x, out)
                torch.cuda.synchronize()
                row[f"{name}_rel_err"] = float((out.float() - want.float()).norm() / want.float().norm())
                row[f"{name}_graph_us"] = _graph_us(lambda fn=fn: fn(x, out), 50)
        rows.append(row)
    # Between layers: a [1, 4096] x [4096, 4096] product, then the all-reduce of its 8 KB
    # result, 64 times in one graph; minus the products alone = what each all-reduce adds.
    a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    h = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(h)
    mm_only = _graph_us(lambda: torch.mm(a, w, out=h), 64)
    inter = {"matmul_us": mm_only}
    for name, reduce in (("nccl", lambda: dist.all_reduce(h)), ("one_shot", lambda: one_shot(h, out)),
                         ("two_shot", lambda: two_shot(h, out)), ("push", lambda: push(h, out))):
        inter[f"{name}_added_us"] = _graph_us(lambda reduce=reduce: (torch.mm(a, w, out=h), reduce()), 64) - mm_only
    if rank == 0:
        results.put({"sizes": rows, "after_matmul_8kb": inter,
                     "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}})
    dist.barrier()
    buffers.clear()
    del push
    dist.destroy_process_group()


def all_reduce_sweep(world: int, sizes: tuple[int, ...] = ALL_REDUCE_BYTES) -> tuple[dict, None]:
    """Per message size: microseconds per all-reduce and the bus bandwidth 2 (N-1)/N bytes / time."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_all_reduce_rank, args=(r, world, port, results, sizes))
             for r in range(world)]
    for p in procs:
        p.start()
    result = results.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    for row in result["sizes"]:
        row["graph_bus_GBps"] = 2 * (world - 1) / world * row["bytes"] / (row["graph_us"] * 1e-6) / 1e9
    return result, None


# ---------------------------------------------------------------- speed


def latency(model: Any) -> tuple[dict, Any]:
    result = bs.as_dict(bs.bench_latency(model, prompt_tokens=512, decode_tokens=128))
    result["runner"] = model.runner.describe()
    return result, model


def scaling(world: int, out: Path, profile_steps: int = 0, batch: int = 0, shape: str = "llama-3-8b",
            async_too: bool = False, **options: Any) -> tuple[dict, Any]:
    """A preset shape (the 8B by default) at batch 1 (prompt 128, 256 new tokens, as ``bench
    latency`` defaults to for this comparison), optionally a profile and a batch-``batch`` decode
    rate; ``async_too``: the same latency with asynchronous scheduling (key "async", same model
    and process), and the profile of its decode steps."""
    if world == 1:
        model = bs.shape_models(shape, "cuda", "bfloat16")[0]
    else:
        model = bs.shape_tensor_parallel(shape, world, "cuda", "bfloat16", **options)
    result = bs.as_dict(bs.bench_latency(model, prompt_tokens=128, decode_tokens=256))
    result["runner"] = model.runner.describe()
    result["card"] = torch.cuda.get_device_name()
    extras = {"async": (lambda: bs.as_dict(bs.bench_latency(model, prompt_tokens=128, decode_tokens=256,
                                                            async_scheduling=True))) if async_too else None,
              "profile": (lambda: profile(model, out, profile_steps, async_scheduling=async_too)[0])
              if profile_steps else None,
              f"batch{batch}": (lambda: batch_decode(model, batch)) if batch else None}
    for key, extra in extras.items():
        if extra is not None:
            try:  # a failed extra must not lose the latency measured above
                result[key] = extra()
            except Exception:
                result[key] = {"error": traceback.format_exc(limit=8)}
    return result, model


def batch_decode(model: Any, batch: int, prompt_tokens: int = 128, decode_tokens: int = 64) -> dict:
    """Median time of decode steps in which all ``batch`` sequences decode (a warm-up run first)."""
    rng = np.random.default_rng(1)
    params = tinyinfer.SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    times = []
    # pages enough for every sequence at once: the default pool (256 MB of the whole model's
    # K/V, whatever the split) holds 2,048 tokens of an 8B model, so 32 sequences would preempt
    # each other and never all decode in one step
    pages = batch * -(-(prompt_tokens + decode_tokens) // 16)
    for run in range(2):
        engine = tinyinfer.Engine(model, max_num_seqs=batch, detail="none", num_pages=pages, page_size=16)
        for _ in range(batch):
            engine.add_request(rng.integers(0, model.config.vocab_size, prompt_tokens).tolist(), params)
        while engine.has_unfinished():
            t = time.perf_counter()
            trace = engine.step()
            if run and trace.num_batched_tokens == batch and trace.num_running == batch:  # all decoding
                times.append(time.perf_counter() - t)
    step = statistics.median(times)
    return {"batch": batch, "step_ms": 1e3 * step, "tokens_per_s": batch / step, "steps": len(times)}


# Kernel-name patterns of a decode step's regions, first match wins (cuBLAS's nvjet / split-K
# reduce are the projections; the LM head is the projection that runs once a step).
REGIONS = (("all_reduce", r"all_reduce|allreduce"), ("gather", r"allgather"),
           ("attention", r"paged_decode|merge_splits|flash|attention|sdpa|fmha"),
           ("norm", r"rms_norm|layer_norm"),
           ("matmul", r"nvjet|gemm|gemv|cutlass|splitkreduce|xmma|sm90_"),  # gemv: the fused products
           ("sampling", r"topk|bitonic|sort|scan|reduce_kernel|cub::"))


def _region(name: str) -> str:
    import re

    low = name.lower()
    return next((region for region, pattern in REGIONS if re.search(pattern, low)), "other")


def _kernel_events(prof: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel or copy the profiler saw, in start order."""
    events = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events)


def _gaps(kernels: list[tuple[float, float, str]], steps: int, big_us: float = 20.0) -> dict:
    """GPU idle time per step between kernels: short gaps (inside a replayed graph) and long
    ones (the GPU waiting for the host), from the union of kernel intervals."""
    small = large = 0.0
    end = None
    for s, e, _ in kernels:
        if end is not None and s > end:
            gap = s - end
            if gap < big_us:
                small += gap
            else:
                large += gap
        end = e if end is None else max(end, e)
    return {"idle_short_gaps_ms_per_step": small / steps / 1e3,
            "idle_long_gaps_ms_per_step": large / steps / 1e3}


def _regions(prof: Any, steps: int) -> dict:
    """GPU ms per step by region (kernel-name patterns above; LM head = a projection run once a step)."""
    regions: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        region = _region(e.key)
        if region == "matmul" and e.count <= steps:
            region = "lm_head"
        regions[region] = regions.get(region, 0.0) + e.self_device_time_total / steps / 1e3
    return regions


def _step_start_wait(kernels: list[tuple[float, float, str]], per_step: int) -> dict:
    """The first all-reduce of each step (the embedding's) against the median one: its excess is
    how long rank 0 waited for the last worker to start its replay."""
    spans = [e - s for s, e, name in kernels if _region(name) == "all_reduce"]
    if per_step < 2 or len(spans) < per_step:
        return {}
    firsts = spans[::per_step]
    return {"first_all_reduce_us": statistics.median(firsts),
            "median_all_reduce_us": statistics.median(spans),
            "all_reduces_seen": len(spans)}


def profile(model: Any, out: Path, steps: int = 20, prefills: int = 3,
            async_scheduling: bool = False) -> tuple[dict, Any]:
    """Rank 0's host and GPU time over decode steps (after warm-up), and over ``prefills`` prompts
    of 128 tokens, from torch.profiler.

    Writes the kernel tables to OUT/profile_tp<N>.txt (decode steps, then prefills);
    returns per decode step the wall time, the GPU time by region (projections, LM head,
    all-reduces, gather, attention, norms, sampling, other), the idle time in short gaps (between
    a graph's kernels) and long ones (waiting for the host), the first all-reduce's wait for the
    workers, rank 0's host time by Python function; and per prefill its wall time, kernels and
    all-reduces.
    """
    engine = tinyinfer.Engine(model, max_num_seqs=1, detail="none", async_scheduling=async_scheduling)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, 128).tolist()
    engine.add_request(prompt, tinyinfer.SamplingParams(temperature=0, max_tokens=2 * steps + 16, ignore_eos=True))
    for _ in range(8):  # prefill, compile, graph capture
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / steps / 1e3  # ms per step
    nccl = sum(e.self_device_time_total for e in kernels if "nccl" in e.key.lower()) / steps / 1e3
    tp = int(model.runner.info.tensor_parallel)
    (out / f"profile_tp{tp}.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=40))
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    comm = sum(e.self_device_time_total for e in kernels
               if any(k in e.key.lower() for k in ("nccl", "all_reduce", "allreduce"))) / steps / 1e3
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:12]
    timeline = _kernel_events(prof)
    result = {"top_kernels": [{"name": e.key[:90], "ms_per_step": e.self_device_time_total / steps / 1e3,
                               "calls_per_step": e.count / steps} for e in top],
              "top_host_ops": [{"name": e.key[:90], "ms_per_step": e.self_cpu_time_total / steps / 1e3,
                                "calls_per_step": e.count / steps} for e in host],
              "collective_kernel_ms_per_step": comm,
              "wall_ms_per_step": 1e3 * wall, "gpu_kernel_ms_per_step": gpu, "nccl_kernel_ms_per_step": nccl,
              "gpu_idle_ms_per_step": 1e3 * wall - gpu, "regions_ms_per_step": _regions(prof, steps),
              **_gaps(timeline, steps),
              **_step_start_wait(timeline, 2 * model.config.num_layers + 1 if tp > 1 else 0),
              "timings_of_last_step": {**(last := engine.step()).timings, **last.rank_timings}}
    result["host_python_us_per_step"] = host_functions(engine, steps)
    del engine
    gc.collect()
    result["prefill"] = profile_prefill(model, out, prefills)
    return result, model


def host_functions(engine: Any, steps: int, top: int = 25) -> dict[str, float]:
    """Rank 0's host time per decode step by Python function (self time, microseconds): what
    fills the GPU's idle time between two replays (pickling, pipe writes and reads, the engine)."""
    import re

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(steps):
            engine.step()
    self_us: dict[str, float] = {}
    for e in prof.events():
        if (".py(" in e.name or e.name.startswith("<built-in")) and "profiler" not in e.name:
            name = re.sub(r" at 0x[0-9a-f]+", "", e.name)[:100]
            self_us[name] = self_us.get(name, 0.0) + e.self_cpu_time_total / steps
    return dict(sorted(self_us.items(), key=lambda kv: -kv[1])[:top])


def profile_prefill(model: Any, out: Path, prompts: int, tokens: int = 128) -> dict:
    """Rank 0's view of prefill steps (a fresh 128-token prompt each, one new token): wall time,
    GPU kernel time, kernels and all-reduces per prefill, and the top host ops."""
    engine = tinyinfer.Engine(model, max_num_seqs=1, detail="none")
    rng = np.random.default_rng(2)
    one = tinyinfer.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def prefill(engine: Any = engine) -> float:
        engine.add_request(rng.integers(0, model.config.vocab_size, tokens).tolist(), one)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    prefill()  # warm-up: this length's kernels and heuristics
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        walls = [prefill() for _ in range(prompts)]
    unprofiled = [prefill() for _ in range(prompts)]
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    tp = int(model.runner.info.tensor_parallel)
    with open(out / f"profile_tp{tp}.txt", "a") as table:  # after the decode steps' table
        table.write(f"\n\nprefill, {prompts} prompts of {tokens} tokens:\n")
        table.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                  key=lambda e: -e.self_cpu_time_total)[:12]
    reduces = [e for e in kernels if _region(e.key) == "all_reduce"]
    del engine
    gc.collect()
    return {"tokens": tokens, "wall_ms_profiled": 1e3 * statistics.median(walls),
            "wall_ms": 1e3 * statistics.median(unprofiled),
            "gpu_kernel_ms": sum(e.self_device_time_total for e in kernels) / prompts / 1e3,
            "kernels": sum(e.count for e in kernels) / prompts,
            "all_reduce_kernel_ms": sum(e.self_device_time_total for e in reduces) / prompts / 1e3,
            "all_reduces": sum(e.count for e in reduces) / prompts,
            "regions_ms": {k: v for k, v in _regions(prof, prompts).items()},
            "top_host_ops": [{"name": e.key[:90], "ms": e.self_cpu_time_total / prompts / 1e3,
                              "calls": e.count / prompts} for e in host]}


def command_exit(command: list[str], out: Path, name: str, timeout: float = 240) -> dict:
    """Run a command; how long after its last line of output it took to exit, and whether its
    stderr shows a leak, an abort or a traceback. Its output goes to OUT/NAME.log and
    OUT/NAME.stderr.log."""
    import signal
    import subprocess
    import threading

    # Both streams go to disk as they come (stdout with the seconds since the start), so a run
    # cut short at its time limit still shows how far it got. The command runs in a session of
    # its own (torchrun and its ranks with it), so a timer kills that whole group at the deadline,
    # silent or not, before the stage's own limit (STAGE_LIMIT) ends this process and would leave
    # it running on the GPUs beside the next stage.
    if os.environ.get("STAGE_LIMIT"):
        timeout = min(timeout, float(os.environ["STAGE_LIMIT"]) - 10)
    log, err_log = out / f"{name}.log", out / f"{name}.stderr.log"
    with open(err_log, "w") as err_file:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)
    killed = []

    def kill() -> None:
        # torchrun's ranks leave its process group: kill every descendant too, or one that hangs
        # holds the pipe open (this process then waits on it until its own limit) and its GPU
        # memory (the next stage's out of memory)
        if proc.poll() is None:
            killed.append(True)
            family = _descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    deadline = threading.Timer(timeout, kill)
    deadline.start()
    lines, last = [], time.monotonic()
    start = last
    assert proc.stdout is not None
    with open(log, "w") as out_file:
        for line in proc.stdout:
            out_file.write(f"{time.monotonic() - start:7.1f} s  {line}")
            out_file.flush()
            lines.append(line)
            last = time.monotonic()
            if last - start > timeout:
                break
    try:
        code = proc.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        kill()
        code = None
    deadline.cancel()
    code = None if killed else code
    exited = time.monotonic()
    err = err_log.read_text(errors="replace")
    return {"command": " ".join(command), "returncode": code, "seconds": round(exited - start, 1),
            "exit_after_output_s": round(exited - last, 2), "stdout_tail": "".join(lines[-6:]),
            "leaked_semaphores": "leaked semaphore" in err, "fatal": "Fatal Python error" in err,
            "traceback": "Traceback" in err}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or one that just ended
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cli_latency(world: int, out: Path, *flags: str, torchrun: bool = False) -> tuple[dict, None]:
    """``tinyinfer bench latency --preset llama-3-8b`` as a user runs it (and how it exits)."""
    import sys

    json_path = out / f"cli_tp{world}{'_torchrun' if torchrun else ''}.json"
    tail = ["bench", "latency", "--preset", "llama-3-8b", "--runner", "torch", "--prompt-tokens", "128",
            "--max-tokens", "256", "--json", str(json_path), *flags]
    if world > 1:
        tail += ["--tensor-parallel", str(world)]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                 "-m", "tinyinfer"] if torchrun else [sys.executable, "-m", "tinyinfer"])
    result = command_exit(launcher + tail, out, json_path.stem)
    if json_path.exists():
        result["latency"] = json.loads(json_path.read_text())[0]
    return result, None


def peer_gpt_fast(world: int, out: Path, checkout: Path) -> tuple[dict, None]:
    """gpt-fast at the same shape and lengths (scripts/peer_gpt_fast.py), torchrun for TP."""
    import sys

    json_path = out / f"gpt_fast_tp{world}.json"
    script = [str(Path(__file__).parent / "peer_gpt_fast.py"), "--gpt-fast", str(checkout),
              "--preset", "llama-3-8b", "--prompt-tokens", "128", "--max-tokens", "256", "--json", str(json_path)]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
                if world > 1 else [sys.executable])
    result = command_exit(launcher + script, out, json_path.stem, timeout=400)
    if json_path.exists():
        result["peer"] = json.loads(json_path.read_text())
    return result, None


def with_env(name: str, value: str, make: Callable[[], Any]) -> Any:
    """Build a model with one environment variable set (spawned workers inherit it)."""
    os.environ[name] = value
    return make()


def stages(out: Path) -> dict[str, Callable[[], tuple[Any, Any]]]:
    table: dict[str, Callable[[], tuple[Any, Any]]] = {
        "bundled_tp2": bundled_tp2,
        "llama3_8b_tp1": lambda: latency(bs.shape_models("llama-3-8b", "cuda", "bfloat16")[0]),
        "llama3_8b_tp4_no_graphs": lambda: latency(bs.shape_tensor_parallel(
            "llama-3-8b", 4, "cuda", "bfloat16", cuda_graphs=False)),
        "llama2_70b_tp4": lambda: latency(bs.shape_tensor_parallel("llama-2-70b", 4, "cuda", "bfloat16")),
        "llama3_8b_tp2_untimed": lambda: latency(bs.shape_tensor_parallel(
            "llama-3-8b", 2, "cuda", "bfloat16", time_collectives=False)),
        # NCCL's support for graph-captured collectives mixed with eager ones (the logits gather)
        # adds synchronisation to each captured collective; the steps here never overlap, so it
        # can be off (set before the workers spawn: they inherit the environment).
        "llama3_8b_tp2_no_mixing": lambda: latency(with_env(
            "NCCL_GRAPH_MIXING_SUPPORT", "0", lambda: bs.shape_tensor_parallel("llama-3-8b", 2, "cuda", "bfloat16"))),
        "profile_8b_tp1": lambda: profile(bs.shape_models("llama-3-8b", "cuda", "bfloat16")[0], out),
        "profile_8b_tp2": lambda: profile(bs.shape_tensor_parallel("llama-3-8b", 2, "cuda", "bfloat16"), out),
    }
    peers = Path(os.environ.get("GPT_FAST", "peers/gpt-fast"))
    for world in (1, 2, 4):
        for kind in ("nccl", "symm_mem", "push"):
            table[f"8b_tp{world}_{kind}"] = lambda world=world, kind=kind: scaling(
                world, out, **({} if world == 1 else {"all_reduce": kind}))
            table[f"8b_tp{world}_{kind}_profile"] = lambda world=world, kind=kind: scaling(
                world, out, profile_steps=20, **({} if world == 1 else {"all_reduce": kind}))
            table[f"8b_tp{world}_{kind}_batch32"] = lambda world=world, kind=kind: scaling(
                world, out, batch=32, **({} if world == 1 else {"all_reduce": kind}))
            table[f"8b_tp{world}_{kind}_async_profile"] = lambda world=world, kind=kind: scaling(
                world, out, profile_steps=20, async_too=True, **({} if world == 1 else {"all_reduce": kind}))
            table[f"8b_tp{world}_{kind}_async"] = lambda world=world, kind=kind: scaling(
                world, out, async_too=True, **({} if world == 1 else {"all_reduce": kind}))
            table[f"8b_tp{world}_{kind}_profile_batch32"] = lambda world=world, kind=kind: scaling(
                world, out, profile_steps=20, batch=32, **({} if world == 1 else {"all_reduce": kind}))
            table[f"cli_tp{world}_{kind}"] = lambda world=world, kind=kind: cli_latency(
                world, out, *(() if world == 1 else ("--all-reduce", kind)))
            table[f"cli_tp{world}_{kind}_torchrun"] = lambda world=world, kind=kind: cli_latency(
                world, out, "--all-reduce", kind, torchrun=True)
        table[f"gpt_fast_tp{world}"] = lambda world=world: peer_gpt_fast(world, out, peers)
        table[f"cli_tp{world}"] = lambda world=world: cli_latency(world, out)  # the defaults
        table[f"8b_tp{world}_batch32"] = lambda world=world: scaling(world, out, batch=32)
    table["8b_tp2_nccl_timed"] = lambda: scaling(2, out, time_collectives=True)
    table["70b_tp4_symm_mem"] = lambda: scaling(4, out, shape="llama-2-70b", all_reduce="symm_mem")
    table["bundled_tp2_symm_mem"] = lambda: bundled_tp2(compile=False, all_reduce="symm_mem")
    for world in (2, 4):
        table[f"fused_check_tp{world}"] = lambda world=world: fused_decode_check(world)
        table[f"fused_check_tp{world}_push"] = lambda world=world: fused_decode_check(world, "push")
        table[f"gqa_tp{world}_push_float32"] = lambda world=world: gqa(
            world, "float32", compile=False, all_reduce="push")
    table["8b_tp4_symm_mem_async_profile_batch32"] = lambda: scaling(
        4, out, profile_steps=20, batch=32, async_too=True, all_reduce="symm_mem")
    table["70b_tp4_symm_mem_async"] = lambda: scaling(4, out, shape="llama-2-70b", async_too=True,
                                                      all_reduce="symm_mem")
    for world in (2, 4):
        table[f"gqa_tp{world}_symm_mem_float32"] = lambda world=world: gqa(
            world, "float32", compile=False, all_reduce="symm_mem")
        table[f"all_reduce_tp{world}_small"] = lambda world=world: all_reduce_sweep(
            world, (8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20))
        for proto in ("LL", "LL128"):
            table[f"all_reduce_tp{world}_{proto}"] = lambda world=world, proto=proto: with_env(
                "NCCL_PROTO", proto, lambda: all_reduce_sweep(world, (8 << 10, 64 << 10)))
        table[f"all_reduce_tp{world}"] = lambda world=world: all_reduce_sweep(world)
        table[f"llama3_8b_tp{world}"] = lambda world=world: latency(
            bs.shape_tensor_parallel("llama-3-8b", world, "cuda", "bfloat16"))
        for dtype in ("float32", "bfloat16"):
            table[f"gqa_tp{world}_{dtype}"] = lambda world=world, dtype=dtype: gqa(world, dtype)
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("stage", nargs="*", help="stages to run (default: all, each in this process)")
    args = parser.parse_args()
    table = stages(Path(args.out))
    report = Report(Path(args.out) / "tp_gpu_check.json")
    for name in args.stage or list(table):
        report.stage(name, table[name])
    report.data["llama2_70b_bf16_gb"] = bs.shape_config("llama-2-70b", 2048)[0].num_parameters * 2 / 1e9
    report.path.write_text(json.dumps(report.data, indent=2))


if __name__ == "__main__":
    main()
