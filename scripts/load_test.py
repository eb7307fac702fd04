"""Load-test the OpenAI-compatible server on loopback: requests/s, TTFT p50/p95, tokens/s.

    python scripts/load_test.py --model bundled                      # spawns `tinyinfer serve`
    python scripts/load_test.py --url http://127.0.0.1:8000 --served-model-name bundled
    python scripts/load_test.py --model path/to/folder --runner torch --concurrency 1 8 32

At each concurrency level C, C clients each send `--rounds` streaming completions one after
another (distinct prompts, `ignore_eos` so every answer is exactly `--max-tokens` long).
Bounded: a level stops issuing requests after `--time-limit` seconds. TTFT is measured by the
client, from sending the request to the first streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINES = (
    "Now is the winter of our discontent", "But soft, what light through yonder window breaks",
    "All the world's a stage, and all the men and women", "Friends, Romans, countrymen, lend me",
    "If music be the food of love, play on", "The quality of mercy is not strained",
    "Once more unto the breach, dear friends", "O Romeo, Romeo, wherefore art thou Romeo",
)


@dataclass(frozen=True)
class Level:
    """What one concurrency level measured."""

    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    output_tokens_per_s: float
    errors: int


async def one_request(http: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    """Stream one completion; return (TTFT seconds, completion tokens)."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def run_level(url: str, model: str, concurrency: int, rounds: int, max_tokens: int,
                    time_limit: float) -> Level:
    """C clients, each sending `rounds` requests back to back, until done or out of time."""
    ttfts: list[float] = []
    tokens = [0]
    errors = [0]
    start = time.perf_counter()

    async def client(index: int, http: httpx.AsyncClient) -> None:
        for r in range(rounds):
            if time.perf_counter() - start > time_limit:
                return
            body = {"model": model, "prompt": f"{LINES[(index + r) % len(LINES)]} ({index}.{r})",
                    "max_tokens": max_tokens, "temperature": 0.8, "seed": index * rounds + r,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            try:
                ttft, n = await one_request(http, body)
            except (httpx.HTTPError, RuntimeError) as exc:
                print(f"  request failed: {exc}", file=sys.stderr)
                errors[0] += 1
                continue
            ttfts.append(ttft)
            tokens[0] += n

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    seconds = time.perf_counter() - start
    return Level(concurrency, len(ttfts), round(seconds, 2), round(len(ttfts) / seconds, 2),
                 round(1e3 * float(np.percentile(ttfts, 50)), 1),
                 round(1e3 * float(np.percentile(ttfts, 95)), 1),
                 round(tokens[0] / seconds, 1), errors[0])


def serve_forever(model: str, runner: str, port: int, max_num_seqs: int, max_queue: int) -> None:
    """Child process: load the model and serve it (as `tinyinfer serve` does)."""
    import tinyinfer
    from tinyinfer.serve.host import listen, serve
    from tinyinfer.serve.server import ServerConfig

    engine = tinyinfer.Engine(tinyinfer.load(model, runner=runner), max_num_seqs=max_num_seqs,
                              detail="none")
    serve(engine, ServerConfig(served_model_name="load-test", max_queue=max_queue),
          listen("127.0.0.1", port), log_level="warning")


def wait_for_server(url: str, process: multiprocessing.Process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/health").raise_for_status()
            return
        except httpx.HTTPError:
            if not process.is_alive() or time.monotonic() > deadline:
                raise SystemExit("the server did not come up; see its log above") from None
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(levels: list[Level]) -> str:
    rows = ["| clients | requests | req/s | TTFT p50 (ms) | TTFT p95 (ms) | output tokens/s | errors |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    rows += [f"| {x.concurrency} | {x.requests} | {x.requests_per_s} | {x.ttft_p50_ms} | "
             f"{x.ttft_p95_ms} | {x.output_tokens_per_s} | {x.errors} |" for x in levels]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="bundled", help="model to spawn a server for")
    source.add_argument("--url", help="test a server that is already running instead")
    parser.add_argument("--served-model-name", default="load-test",
                        help="the model name to request (with --url)")
    parser.add_argument("--runner", default="numpy", choices=("numpy", "torch"))
    parser.add_argument("--max-num-seqs", type=int, default=32, help="server batch size")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=4, help="requests per client per level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="seconds per level after which clients stop sending")
    parser.add_argument("--server-threads", type=int, default=None,
                        help="BLAS / OpenMP threads of the spawned server (default: the library's "
                             "own choice); on a small machine, leave a core to the clients")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    process = None
    url, model = args.url, args.served_model_name
    if url is None:
        url, model = f"http://127.0.0.1:{free_port()}", "load-test"
        if args.server_threads is not None:  # read by NumPy's BLAS and torch as they load
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                os.environ[name] = str(args.server_threads)
        process = multiprocessing.get_context("spawn").Process(
            target=serve_forever, daemon=True,
            args=(args.model, args.runner, int(url.rsplit(":", 1)[1]), args.max_num_seqs,
                  4 * max(args.concurrency)))
        process.start()
        wait_for_server(url, process)
    try:
        levels = []
        for c in args.concurrency:
            # Warm-up, not reported: compiled runners build code for each new batch size.
            asyncio.run(run_level(url, model, c, 1, 8, args.time_limit))
            levels.append(asyncio.run(run_level(url, model, c, args.rounds, args.max_tokens,
                                                args.time_limit)))
            print(f"{c:>3} clients: {levels[-1]}", file=sys.stderr)
    finally:
        if process is not None:
            process.terminate()
            process.join(30)
    header = (f"{datetime.date.today()} | {platform.machine()} {platform.processor() or ''} "
              f"{os.cpu_count()} CPUs | model {args.url or args.model}, runner {args.runner}, "
              f"max_num_seqs {args.max_num_seqs}, server threads {args.server_threads or 'default'}"
              f" | {args.max_tokens} tokens per request, "
              f"{args.rounds} requests per client")
    print(header)
    print(table(levels))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "levels": [asdict(x) for x in levels]},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
