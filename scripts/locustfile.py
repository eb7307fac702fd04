"""Locust scenario for `tinyinfer serve`: streaming clients on loopback (docs/serving.md).

    tinyinfer serve --model bundled --max-num-seqs 32 &
    locust -f scripts/locustfile.py --headless --host http://127.0.0.1:8000 -u 8 -r 8 -t 60s

Each simulated user sends streaming /v1/completions back to back, each with a distinct prompt,
temperature 0.8 and `ignore_eos`, so every answer is exactly TINYINFER_LOAD_MAX_TOKENS tokens
(default 64). Locust reports two request types: `stream`, the whole request (sending to
[DONE]), and `ttft`, sending to the first streamed text; both are timed here, since Locust's
own timing of a streamed response stops at its headers. A stream that ends without [DONE],
carries an error event, or reports fewer tokens than asked counts as a failure.
Environment: TINYINFER_MODEL (the served name, default bundled), TINYINFER_API_KEY (if the
server asks for one), TINYINFER_LOAD_MAX_TOKENS.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import requests
from locust import HttpUser, task

LINES = (
    "Now is the winter of our discontent", "But soft, what light through yonder window breaks",
    "All the world's a stage, and all the men and women", "Friends, Romans, countrymen, lend me",
    "If music be the food of love, play on", "The quality of mercy is not strained",
    "Once more unto the breach, dear friends", "O Romeo, Romeo, wherefore art thou Romeo",
)
MODEL = os.environ.get("TINYINFER_MODEL", "bundled")
MAX_TOKENS = int(os.environ.get("TINYINFER_LOAD_MAX_TOKENS", "64"))
NUMBERS = itertools.count()


class StreamingClient(HttpUser):
    """One client: a streaming completion, then the next, with no pause between them."""

    def on_start(self) -> None:
        self.http = requests.Session()  # timed here, so not through Locust's client
        key = os.environ.get("TINYINFER_API_KEY")
        if key:
            self.http.headers["Authorization"] = f"Bearer {key}"

    def record(self, name: str, seconds: float, error: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="POST", name=name, response_time=1e3 * seconds, response_length=0,
            exception=error, context={})

    @task
    def stream(self) -> None:
        number = next(NUMBERS)
        body = {"model": MODEL, "prompt": f"{LINES[number % len(LINES)]} ({number})",
                "max_tokens": MAX_TOKENS, "temperature": 0.8, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        try:
            first, tokens = self.read(body, start)
            if tokens != MAX_TOKENS:
                raise RuntimeError(f"the stream gave {tokens} tokens, not {MAX_TOKENS}")
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the user
            self.record("stream", time.perf_counter() - start, exc)
            return
        self.record("stream", time.perf_counter() - start)
        self.record("ttft", first)

    def read(self, body: dict, start: float) -> tuple[float, int]:
        """Stream one completion to [DONE]; return (seconds to first text, tokens generated)."""
        first, tokens = None, 0
        with self.http.post(f"{self.host}/v1/completions", json=body, stream=True,
                            timeout=300) as response:
            response.raise_for_status()
            for line in response.iter_lines(decode_unicode=True):
                if line == "data: [DONE]":
                    return (first if first is not None else time.perf_counter() - start), tokens
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        raise RuntimeError("the stream ended without [DONE]")
