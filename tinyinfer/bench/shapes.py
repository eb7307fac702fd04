"""Latency and throughput of real model shapes, against the memory roofline and transformers.

Presets are published configs with random weights (a shape costs the same to run whatever
its weights), so a GPU can be measured without downloading a checkpoint. The same weights
can be handed to Hugging Face ``transformers`` for a side-by-side peer in the same process.

* latency: batch 1 — time to first token for a prompt, then time per output token; the
  decode roofline is bytes read per step (weights + KV) over the measured copy bandwidth.
* throughput: many requests at once (nano-vllm's offline workload: prompt and output
  lengths uniform in 100..1024), output tokens per second of wall-clock time.

Both take quantized weights: a folder quantized as it loads (or saved quantized), or a preset
whose linear layers are drawn as random codes and scales of the format (``random_quantized``).
Each row names the weights it ran: the format, or the float dtype.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tinyinfer.bench.measure import measure_copy_bandwidth, sync
from tinyinfer.bench.workloads import Request
from tinyinfer.config import ModelConfig
from tinyinfer.display import progress
from tinyinfer.display.tables import table
from tinyinfer.engine import Engine
from tinyinfer.engine_config import DEFAULTS
from tinyinfer.errors import TinyInferError
from tinyinfer.model import Model, load
from tinyinfer.quant import QuantConfig, QuantizedWeight
from tinyinfer.weights.gguf_file import is_gguf
from tinyinfer.sampling import SamplingParams
from tinyinfer.simulate.presets import MODEL_CONFIGS

BENCH_SHAPES = ("gpt2", "llama-3.2-1b", "qwen2.5-0.5b", "llama-3-8b")


def shape_config(name: str, max_len: int) -> tuple[ModelConfig, dict[str, Any]]:
    """A preset's config with its context cut to max_len (the benchmark never goes further)."""
    from tinyinfer.config import config_from_dict

    if name not in MODEL_CONFIGS:
        raise TinyInferError(f"unknown shape {name}: use one of {', '.join(BENCH_SHAPES)}")
    raw = dict(MODEL_CONFIGS[name][2])
    key = "n_positions" if raw["model_type"] == "gpt2" else "max_position_embeddings"
    raw[key] = min(int(raw[key]), max_len)
    return config_from_dict(raw, source=name), raw


def hf_model_for(raw: dict[str, Any], device: str, dtype: Any) -> Any:
    """A randomly initialised transformers model of a preset's shape, on the device."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**raw)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_quantized(shape: tuple[int, int], qconfig: QuantConfig, rng: np.random.Generator) -> QuantizedWeight:
    """A weight of this shape and format with random codes, and scales (zero points, minimums)
    that give weights of about a trained model's spread (std ~0.02)."""
    out, n = shape
    groups = math.ceil(n / (qconfig.group_size or n))
    if qconfig.bits == 8:
        data = rng.integers(-127, 128, (out, n), dtype=np.int8)
    else:
        data = rng.integers(0, 256, (out, math.ceil(n / 2)), dtype=np.uint8)
    steps = 2 ** qconfig.bits / 2
    scales = (rng.uniform(0.5, 1.5, (out, groups)) * 0.04 / steps).astype(np.float16)
    zeros = mins = None
    if qconfig.minimum:
        mins = (-8.0 * scales.astype(np.float32)).astype(np.float16)
    elif not qconfig.symmetric:
        zeros = rng.integers(0, 256, (out, math.ceil(groups / 2)), dtype=np.uint8)
    return QuantizedWeight(data, scales, zeros, n, qconfig, mins)


def quantize_randomly(weights: dict[str, Any], qconfig: QuantConfig) -> None:
    """Replace the weights the format applies to by random codes of the same shapes, drawn once
    per shape (every layer of a shape shares them: timings do not depend on the values, and
    drawing 7 GB of int8 codes for an 8B shape took ~30 s)."""
    rng = np.random.default_rng(0)
    drawn: dict[tuple[int, ...], QuantizedWeight] = {}
    for key in [k for k in weights if qconfig.applies_to(k)]:
        shape = tuple(weights[key].shape)
        if shape not in drawn:
            drawn[shape] = random_quantized(shape, qconfig, rng)  # type: ignore[arg-type]
        weights[key] = drawn[shape]


def shape_models(name: str, device: str, dtype: str, max_len: int = 2048,
                 with_peer: bool = False, quantize: str | None = None,
                 quantize_head: bool = False, kv_cache_dtype: str = "auto",
                 **runner_options: Any) -> tuple[Model, Any]:
    """Our torch model of a preset shape, and (if asked) a transformers model with the same weights.

    ``quantize`` draws the linear layers (with ``quantize_head`` the embedding and LM head too)
    as random codes of that format (one draw per matrix shape, each layer its own copy on the
    device), the rest of the weights random floats. ``kv_cache_dtype`` is the runner's K/V
    storage ("auto" or "int8"); ``runner_options`` go to the TorchRunner (batch_invariant).
    """
    import torch

    from tinyinfer.runners.torch_fast import TorchRunner
    from tinyinfer.runners.torch_weights import random_weights
    from tinyinfer.weights import map_weights

    if quantize_head and not quantize:
        raise TinyInferError("--quantize-head stores the embedding and LM head in the blocks' "
                             "format: name one with --quantize (e.g. int8 or int4)")
    config, raw = shape_config(name, max_len)
    # Weights are built once and fused once (q|k|v, gate|up): about two copies at the peak.
    _check_memory(name, config.num_parameters * (4 if dtype == "float32" else 2) * (3 if with_peer else 2),
                  device)
    peer = None
    if with_peer:
        peer = hf_model_for(raw, device, getattr(torch, dtype))
        state = {k: v.detach() for k, v in peer.state_dict().items()}
        weights = map_weights(config, state, {k: name for k in state})
    else:
        weights = random_weights(config, device, dtype)
    qconfig = None
    if quantize:
        qconfig = QuantConfig.parse(quantize)
        qconfig = dataclasses.replace(qconfig, head=qconfig.head or quantize_head)
        quantize_randomly(weights, qconfig)
    runner = TorchRunner(config, weights, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                         **runner_options)
    return Model(config=config, runner=runner, path=Path(name), name=name, quantization=qconfig), peer


def shape_tensor_parallel(name: str, tensor_parallel: int, device: str, dtype: str,
                          max_len: int = 2048, **runner_options: Any) -> Model:
    """A preset shape with random weights split over ``tensor_parallel`` ranks (each draws its shard)."""
    from tinyinfer.runners.tp.launch import start_ranks

    config, _ = shape_config(name, max_len)
    per_rank = config.num_parameters * (4 if dtype == "float32" else 2) // tensor_parallel
    if device.startswith("cuda"):  # each rank on its own GPU
        _check_memory(f"{name} (one rank's shard at tensor_parallel={tensor_parallel})", per_rank, device)
    else:  # every rank in the same host memory
        _check_memory(f"{name} (all {tensor_parallel} ranks' shards)", per_rank * tensor_parallel, device)
    runner = start_ranks(config, None, tensor_parallel, device, dtype, **runner_options)
    return Model(config=config, runner=runner, path=Path(name), name=name)


def _check_memory(name: str, needed: int, device: str) -> None:
    """Refuse a preset that cannot fit, before allocating anything."""
    import os

    import torch

    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > 0.9 * free:
        raise TinyInferError(
            f"the {name} preset needs about {needed / 1e9:.1f} GB on {device} while building its "
            f"weights, but {free / 1e9:.1f} GB are free: pick a smaller preset or another device")


def require_transformers() -> None:
    """Fail in one line, before any model loads, where the peer's package is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise TinyInferError("--peer transformers needs the transformers package "
                             "(pip install 'tinyinfer[test]' or transformers)") from None


def folder_models(source: str, runner: str, device: str | None, dtype: str | None,
                  with_peer: bool, quantize: str | None = None,
                  quantize_head: bool = False, kv_cache_dtype: str = "auto",
                  **runner_options: Any) -> tuple[Model, Any]:
    """A checkpoint (folder, GGUF file or name) for our runner, quantized as it loads if asked
    (``none``: a quantized file's weights as floats), and transformers on the same files."""
    model = load(source, runner=runner, device=device, dtype=dtype, quantize=quantize,
                 quantize_head=quantize_head, kv_cache_dtype=kv_cache_dtype, **runner_options)
    peer = None
    if with_peer:
        import torch
        import transformers

        path = model.path  # a folder, or a GGUF file transformers dequantizes as it loads
        where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if is_gguf(path) \
            else dict(pretrained_model_name_or_path=path)
        peer = transformers.AutoModelForCausalLM.from_pretrained(
            **where, dtype=getattr(torch, dtype or "float32")).to(device or "cpu").eval()
    return model, peer


def weights_name(model: Model) -> str:
    """What the weights are: the quantization format, or the float dtype the runner computes in."""
    return model.quantization.name if model.quantization is not None else model.runner.info.dtype


def runner_label(model: Model) -> str:
    """A result's row name: the model and runner, and the K/V storage unless it is the default."""
    kv = model.runner.info.kv_cache_dtype
    return f"{model.name} / {model.runner.name}" + (f", {kv} KV" if kv != "auto" else "")


def weight_bytes(model: Model) -> int:
    """Bytes of weights one decode step streams (on one rank: rank 0's shard under tensor parallelism)."""
    return model.runner.info.weight_bytes


@dataclass(frozen=True)
class LatencyResult:
    label: str
    prompt_tokens: int
    decode_tokens: int
    ttft_ms: float
    tpot_p50_ms: float
    tpot_p95_ms: float | None  # None: not measured (transformers' generate gives no per-step times)
    decode_tokens_per_s: float
    bytes_per_step: int
    bandwidth: float
    roofline_pct: float | None  # None: no byte count for the peer's steps
    peak_memory: int
    tensor_parallel: int = 1
    all_reduce_ms: float = 0.0  # per decode step, mean over ranks (inside the step's time)
    rank_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # median per decode step of
    # each rank's timings ("rank1_forward", "rank1_all_reduce", ...)
    weights: str = ""  # the weights' format (int8, int4-g128, ...) or float dtype
    kv_bytes_per_step: int = 0  # of bytes_per_step: K/V read at the mean context; the rest is weights
    request_tokens_per_s: float | None = None  # new tokens / whole request time (TTFT included)
    warmup_s: float | None = None  # the untimed first request: compilation, CUDA graphs, caches
    # Share of a request's wall time the device spent idle between steps: 1 - the steps' device
    # time (CUDA events) / their wall time; None where the runner does not time its steps.
    device_idle_pct: float | None = None
    async_scheduling: bool = False


def bench_latency(model: Model, prompt_tokens: int = 512, decode_tokens: int = 128,
                  bandwidth: float | None = None, repeats: int = 3,
                  async_scheduling: bool = False) -> LatencyResult:
    """Batch-1 TTFT and per-token decode time through the engine (warm: one run first).

    Under tensor parallelism the roofline is one rank's: its shard of the weights and of the
    KV heads, over one device's bandwidth (every rank streams its own shard at once).
    ``async_scheduling`` runs the engine with the next step prepared while one runs.
    """
    info = model.runner.info
    bandwidth = bandwidth or measure_copy_bandwidth(info.device)
    ranks = info.tensor_parallel
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    ttfts, tpots, ranked, requests, idle = [], [], [], [], []
    with progress.task(f"latency: steps ({repeats} runs + warm-up)",
                       total=(repeats + 1) * decode_tokens) as advance:
        # One engine for every run: CUDA graphs belong to its KV cache, so they are captured in
        # the warm-up run only. Each run's prompt is new random tokens: no prefix-cache hit.
        engine = Engine(model, max_num_seqs=1, max_num_batched_tokens=max(prompt_tokens, 512),
                        detail="none", async_scheduling=async_scheduling)
        for run in range(repeats + 1):
            engine.add_request(rng.integers(0, model.config.vocab_size, prompt_tokens).tolist(), params)
            step_times, step_ranks, device = [], [], []
            while engine.has_unfinished():
                t = time.perf_counter()
                trace = engine.step()
                step_times.append(time.perf_counter() - t)
                step_ranks.append(trace.rank_timings)
                device.append(trace.device_seconds)
                advance()
            if run:  # the first run warms up compilation, graphs and caches
                ttfts.append(step_times[0])
                tpots += step_times[1:]
                ranked += step_ranks[1:]
                requests.append(sum(step_times))
                if None not in device:
                    idle.append(100 * max(0.0, 1 - sum(device) / sum(step_times)))
            else:
                warmup_s = sum(step_times)
    kv_read = info.kv_bytes_per_token(model.config) * (prompt_tokens + decode_tokens // 2) // ranks
    bytes_per_step = weight_bytes(model) + kv_read
    tpot = statistics.median(tpots)
    return LatencyResult(
        label=runner_label(model), prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens, ttft_ms=1e3 * statistics.median(ttfts),
        tpot_p50_ms=1e3 * tpot, tpot_p95_ms=1e3 * float(np.percentile(tpots, 95)),
        decode_tokens_per_s=1 / tpot, bytes_per_step=bytes_per_step, bandwidth=bandwidth,
        roofline_pct=100 * bytes_per_step / bandwidth / tpot, peak_memory=_peak_memory(info.device),
        tensor_parallel=ranks,
        all_reduce_ms=1e3 * statistics.median(
            sum(t.get(f"rank{r}_all_reduce", 0.0) for r in range(ranks)) / ranks for t in ranked),
        rank_ms={key: 1e3 * statistics.median(t[key] for t in ranked) for key in sorted(ranked[0])},
        weights=weights_name(model), kv_bytes_per_step=kv_read,
        request_tokens_per_s=decode_tokens / statistics.median(requests), warmup_s=warmup_s,
        device_idle_pct=statistics.median(idle) if len(idle) == repeats else None,
        async_scheduling=async_scheduling,
    )


def peer_latency(peer: Any, vocab_size: int, prompt_tokens: int = 512, decode_tokens: int = 128,
                 repeats: int = 3) -> LatencyResult:
    """transformers generate at batch 1: TTFT from a 1-token generate, TPOT from the rest."""
    import torch

    device = str(next(peer.parameters()).device)
    ids = torch.tensor([np.random.default_rng(0).integers(0, vocab_size, prompt_tokens).tolist()],
                       device=device)

    def run(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            peer.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t

    with progress.task("transformers: generate calls", total=1 + 2 * repeats) as advance:
        def counted(n: int) -> float:
            seconds = run(n)
            advance()
            return seconds

        counted(decode_tokens)
        ttft = statistics.median(counted(1) for _ in range(repeats))
        full = statistics.median(counted(decode_tokens) for _ in range(repeats))
    tpot = (full - ttft) / (decode_tokens - 1)
    return LatencyResult(
        label="transformers generate", prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
        ttft_ms=1e3 * ttft, tpot_p50_ms=1e3 * tpot, tpot_p95_ms=None,
        decode_tokens_per_s=1 / tpot, bytes_per_step=0, bandwidth=0.0, roofline_pct=None,
        peak_memory=_peak_memory(device), weights=_peer_dtype(peer),
        request_tokens_per_s=decode_tokens / full,
    )


def _peer_dtype(peer: Any) -> str:
    return str(next(peer.parameters()).dtype).removeprefix("torch.")


def _peak_memory(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    import torch

    return int(torch.cuda.max_memory_allocated())


OFFLINE_LENGTHS = (100, 1024)  # nano-vllm's bounds on prompt and on output length


def offline_lengths(max_model_len: int) -> tuple[int, int]:
    """OFFLINE_LENGTHS cut so that the longest prompt plus the longest output fit the context."""
    high = min(OFFLINE_LENGTHS[1], max_model_len // 2)
    return min(OFFLINE_LENGTHS[0], high), high


def offline_workload(num_requests: int, vocab_size: int, low: int = OFFLINE_LENGTHS[0],
                     high: int = OFFLINE_LENGTHS[1], seed: int = 0) -> list[Request]:
    """nano-vllm's offline benchmark: prompt and output lengths uniform in [low, high]."""
    rng = np.random.default_rng(seed)
    return [Request(tuple(rng.integers(0, vocab_size, int(rng.integers(low, high + 1))).tolist()),
                    int(rng.integers(low, high + 1)))
            for _ in range(num_requests)]


@dataclass(frozen=True)
class ThroughputResult:
    label: str
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    weights: str = ""  # the weights' format (int8, int4-g128, ...) or float dtype
    warmup_s: float | None = None  # the untimed warm-up run: compilation, CUDA graphs, caches


def bench_throughput(model: Model, workload: list[Request], max_num_seqs: int = 256,
                     max_num_batched_tokens: int = 8192, kv_fraction: float = 0.5,
                     async_scheduling: bool = False) -> ThroughputResult:
    """All requests at once through continuous batching; greedy, EOS ignored. A warm-up run
    first meets every decode batch size the run will (each compiles or captures a CUDA graph
    once): one-off work is not the engine's throughput."""
    pages = _pages_for(model, workload, max_num_seqs, kv_fraction)
    options = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   num_pages=pages, detail="none", async_scheduling=async_scheduling)
    # The timed run reuses the warm-up's engine: CUDA graphs belong to its KV cache. Warm-up
    # prompts repeat one token, so the prefix cache they leave serves no timed prompt.
    engine = Engine(model, **options)
    for i, r in enumerate(workload):  # short prompts, one more token each: batches shrink by one
        engine.add_request([r.prompt_ids[0]] * 16, SamplingParams(temperature=0, max_tokens=1 + i % max_num_seqs,
                                                                  ignore_eos=True))
    warm_start = time.perf_counter()
    with progress.task("throughput: warm-up steps") as advance:
        while engine.has_unfinished():
            engine.step()
            advance()
    warmup_s = time.perf_counter() - warm_start
    start = time.perf_counter()
    ids = [engine.add_request(list(r.prompt_ids),
                              SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
           for r in workload]
    with progress.task("throughput: requests", total=len(workload)) as advance:
        while engine.has_unfinished():
            advance(len(engine.step().finished))
    seconds = time.perf_counter() - start
    tokens = sum(len(engine.release(i).token_ids) for i in ids)
    return ThroughputResult(runner_label(model), len(workload), tokens, seconds,
                            tokens / seconds, weights_name(model), warmup_s)


def _pages_for(model: Model, workload: list[Request], max_num_seqs: int, kv_fraction: float) -> int:
    """Pages for max_num_seqs of the longest requests, within a share of free device memory."""
    block = DEFAULTS.page_size
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload)
    wanted = max_num_seqs * -(-longest // block)
    if not model.runner.info.device.startswith("cuda"):
        return wanted
    import torch

    free, _ = torch.cuda.mem_get_info()
    page_bytes = model.runner.info.kv_bytes_per_token(model.config) * block
    return max(-(-longest // block), min(wanted, int(kv_fraction * free) // page_bytes))


def peer_throughput(peer: Any, workload: list[Request], batch_size: int = 64) -> ThroughputResult:
    """transformers generate over the same requests, in left-padded batches of batch_size."""
    import torch

    device = str(next(peer.parameters()).device)
    start = time.perf_counter()
    tokens = 0
    for i in progress.track(range(0, len(workload), batch_size), "transformers: batches"):
        group = workload[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(group):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        new = max(r.max_tokens for r in group)
        with torch.no_grad():
            peer.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        tokens += sum(r.max_tokens for r in group)  # only what each request asked for counts
    sync(device)
    seconds = time.perf_counter() - start
    return ThroughputResult("transformers generate", len(workload), tokens, seconds, tokens / seconds,
                            _peer_dtype(peer))


def as_dict(result: Any) -> dict[str, Any]:
    return dataclasses.asdict(result)


def latency_table(results: list[LatencyResult], thread_line: str = "") -> str:
    """One row per result; tensor-parallel rows add the ranks and the all-reduce time per step."""
    parallel = any(r.tensor_parallel > 1 for r in results)
    headers = ["runner", "weights", "TTFT ms", "TPOT p50 ms", "p95 ms", "tok/s", "request tok/s",
               "roofline %", "device idle %", "peak mem GB"]
    headers += ["TP", "all-reduce ms"] if parallel else []
    rows = [[r.label + (", async scheduling" if r.async_scheduling else ""), r.weights,
             f"{r.ttft_ms:.1f}", f"{r.tpot_p50_ms:.2f}", _fixed(r.tpot_p95_ms, 2),
             f"{r.decode_tokens_per_s:.1f}", _fixed(r.request_tokens_per_s, 1), _fixed(r.roofline_pct, 1),
             _fixed(r.device_idle_pct, 1), f"{r.peak_memory / 1e9:.2f}"]
            + ([r.tensor_parallel, f"{r.all_reduce_ms:.2f}"] if parallel else []) for r in results]
    notes = [_roofline_note(r) for r in results if r.roofline_pct is not None]
    return _with_note(table(headers, rows) + "".join(notes), thread_line)


def _roofline_note(r: LatencyResult) -> str:
    """How a row's roofline was counted, and what its times leave out."""
    context = r.prompt_tokens + r.decode_tokens // 2
    return (f"\n{r.label}: roofline = {(r.bytes_per_step - r.kv_bytes_per_step) / 1e9:.3f} GB of "
            f"weights (LM head included, embedding rows not) + {r.kv_bytes_per_step / 1e9:.3f} GB "
            f"of K/V at the mean context ({context} tokens) per step, over "
            f"{r.bandwidth / 1e9:.0f} GB/s (a large copy on the device); tok/s = 1 / TPOT p50, "
            f"request tok/s = new tokens / whole request; device idle = 1 - the steps' time on "
            f"the device (CUDA events) / their wall time; warm-up request (compilation, graphs) "
            f"{_fixed(r.warmup_s, 1)} s, not timed")


def throughput_table(results: list[ThroughputResult], thread_line: str = "") -> str:
    base = results[-1].tokens_per_second
    rows = [[r.label, r.weights, r.requests, r.output_tokens, f"{r.seconds:.1f}",
             f"{r.tokens_per_second:.1f}", f"{r.tokens_per_second / base:.2f}x", _fixed(r.warmup_s, 1)]
            for r in results]
    return _with_note(table(["runner", "weights", "requests", "out tokens", "seconds", "tok/s", "ratio",
                             "warm-up s (untimed)"], rows), thread_line)


def _fixed(value: float | None, digits: int) -> str | None:
    """A number to ``digits`` decimals, or None (printed as –) where it was not measured."""
    return None if value is None else f"{value:.{digits}f}"


def _with_note(text: str, note: str) -> str:
    return f"{note}\n{text}" if note else text
