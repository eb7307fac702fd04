"""`tinyinfer serve`: load a model and serve it over the OpenAI HTTP API."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tinyinfer.engine_config import DEFAULTS


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `serve` command on the top-level parser's subparsers."""
    from tinyinfer.cli.args import add_async_scheduling_arg, add_model_args

    parser = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (streaming)",
        description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics. Ctrl-C finishes or aborts in-flight requests.")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind, 127.0.0.1: this machine only")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model's name)")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULTS.max_num_seqs,
                        help="sequences decoded together in one batch")
    add_async_scheduling_arg(parser)
    parser.add_argument("--max-queue", type=int, default=64,
                        help="sequences allowed to wait beyond the batch before 429")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may run before it is stopped with 504")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on shutdown")
    parser.add_argument("--api-key", default=os.environ.get("TINYINFER_API_KEY"),
                        help="require this key as `Authorization: Bearer KEY` on every request "
                             "(default: $TINYINFER_API_KEY; unset: no key)")
    parser.add_argument("--open-health-metrics", action="store_true",
                        help="with an API key: answer /health and /metrics without it (for load "
                             "balancers and Prometheus)")
    parser.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="web origins (https://app.example) whose pages may call the server "
                             "from a browser (CORS); '*' for any; default: none")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="how much the server logs")
    return parser


def run(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    import tinyinfer
    from tinyinfer.cli.args import load_model
    from tinyinfer.errors import TinyInferError
    from tinyinfer.serve.host import listen, serve
    from tinyinfer.serve.server import ServerConfig

    for name in ("max_num_seqs", "request_timeout", "shutdown_timeout"):
        if getattr(args, name) <= 0:
            raise TinyInferError(f"--{name.replace('_', '-')} must be positive")
    if args.max_queue < 0:
        raise TinyInferError("--max-queue must be 0 or more")
    if args.api_key is not None and not args.api_key.strip():
        raise TinyInferError("--api-key (or TINYINFER_API_KEY) is empty; give a key or unset it")
    if args.open_health_metrics and not args.api_key:
        raise TinyInferError("--open-health-metrics needs --api-key: without a key every "
                             "endpoint is open already")
    sock = listen(args.host, args.port)  # before the model loads: a port in use fails at once
    try:
        model = load_model(args)
    except BaseException:
        sock.close()
        raise
    # detail "none": the server reads tokens from the trace, never the per-page pool view.
    engine = tinyinfer.Engine(model, max_num_seqs=args.max_num_seqs, detail="none",
                              async_scheduling=args.async_scheduling)
    config = ServerConfig(served_model_name=args.served_model_name, max_queue=args.max_queue,
                          request_timeout=args.request_timeout, api_key=args.api_key,
                          open_probes=args.open_health_metrics,
                          allowed_origins=tuple(args.allowed_origins))
    print(f"serving {config.served_model_name or model.name} ({model.runner.name} runner) on "
          f"http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if args.api_key else ''}", file=sys.stderr)
    serve(engine, config, sock, args.shutdown_timeout, args.log_level)
    return 0
