"""llama.cpp (through llama-cpp-python) as the CPU peer of `bench latency` on a GGUF file.

It is what a CPU user would pick for the same file: the same GGUF, the same thread count,
batch 1, greedy. TTFT is the prompt's evaluation; TPOT one token's evaluation and greedy
choice, the median over the run, after a warm-up run (as tinyinfer's own numbers).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from tinyinfer.bench.shapes import LatencyResult
from tinyinfer.display import progress
from tinyinfer.errors import TinyInferError


def llama_cpp_latency(path: Path, threads: int, vocab_size: int, prompt_tokens: int = 512,
                      decode_tokens: int = 128, repeats: int = 3) -> LatencyResult:
    """Batch-1 TTFT and per-token decode time of llama.cpp on a GGUF file."""
    try:
        import llama_cpp
    except ModuleNotFoundError:
        raise TinyInferError("--peer llama.cpp needs llama-cpp-python: pip install llama-cpp-python "
                             "(it builds llama.cpp from source, minutes on a small machine)") from None
    llm = llama_cpp.Llama(str(path), n_ctx=prompt_tokens + decode_tokens + 1, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(prompt_tokens, 512), verbose=False)
    prompt = np.random.default_rng(0).integers(0, vocab_size, prompt_tokens).tolist()
    ttfts, tpots, requests = [], [], []
    with progress.task(f"llama.cpp: steps ({repeats} runs + warm-up)",
                       total=(repeats + 1) * decode_tokens) as advance:
        for run in range(repeats + 1):
            llm.reset()
            start = time.perf_counter()
            llm.eval(prompt)
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            first = time.perf_counter() - start
            steps = []
            for _ in range(decode_tokens - 1):
                t = time.perf_counter()
                llm.eval([token])
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                steps.append(time.perf_counter() - t)
                advance()
            advance()
            if run:  # the first run warms caches up
                ttfts.append(first)
                tpots += steps
                requests.append(first + sum(steps))
    tpot = statistics.median(tpots)
    return LatencyResult(
        label=f"llama.cpp {llama_cpp.__version__} ({threads} threads)", prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens, ttft_ms=1e3 * statistics.median(ttfts), tpot_p50_ms=1e3 * tpot,
        tpot_p95_ms=1e3 * float(np.percentile(tpots, 95)), decode_tokens_per_s=1 / tpot,
        bytes_per_step=0, bandwidth=0.0, roofline_pct=None, peak_memory=0,
        request_tokens_per_s=decode_tokens / statistics.median(requests),
    )
