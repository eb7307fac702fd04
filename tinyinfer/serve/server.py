"""OpenAI-compatible HTTP server: Starlette routes in front of one continuous-batching loop.

    POST /v1/completions        text or token-id prompts, streamed (SSE) or whole
    POST /v1/chat/completions   messages laid out by the model's chat template
    GET  /v1/models             the one served model
    GET  /health                liveness plus engine state (running, waiting, KV pages)
    GET  /metrics               Prometheus text: requests, tokens, TTFT / TPOT, pages, cache
    GET  /openapi.json          the OpenAPI document of all of the above

Handlers check the cheap things first (API key, Content-Type, size, prompts x n), then parse
the body and tokenize on a worker thread, so the event loop keeps serving every other client,
and hand a job to the engine thread (serve/loop.py); they never touch the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tinyinfer.engine import Engine
from tinyinfer.errors import TinyInferError
from tinyinfer.sampling import SamplingParams
from tinyinfer.serve.loop import Delta, EngineLoop, Failure, Job, Usage
from tinyinfer.serve.metrics import Metrics
from tinyinfer.serve.openapi import document
from tinyinfer.serve.responses import ChatShape, CompletionShape, Shape
from tinyinfer.serve.schemas import (
    APIError,
    Limits,
    Options,
    engine_error,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from tinyinfer.serve.security import check_json_body, middleware

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", used only in metrics
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
             "/openapi.json")


@dataclass(frozen=True)
class ServerConfig:
    """Server policy: the model's public name, the limits that protect the engine, and who may
    call it."""

    served_model_name: str | None = None  # default: the model's own name
    max_queue: int = 64  # sequences allowed to wait beyond the running batch before 429
    request_timeout: float = 300.0  # seconds from arrival to the last token
    max_body_bytes: int = 1 << 20
    api_key: str | None = field(default=None, repr=False)  # None: no key asked
    open_probes: bool = False  # with a key: /health and /metrics answer without it
    allowed_origins: tuple[str, ...] = ()  # web origins allowed by CORS; none by default


DONE = "data: [DONE]\n\n"
# A request ready for the engine: its sequences (token ids, sampling), options and answer shape.
Prepared = tuple[list[tuple[list[int], SamplingParams]], Options, Shape]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _disconnected(receive: Receive) -> None:
    """Return once the client hangs up (after the body, receive() waits for exactly that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class OpenAIServer:
    """The routes and the engine loop behind them."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.model = engine.model
        self.name = config.served_model_name or self.model.name
        self.metrics = Metrics()
        self.loop = EngineLoop(engine, self.metrics, config.max_queue)
        self.template = self.model.chat_template
        self.tokenizer = self.model.tokenizer if self.model.has_tokenizer else None
        self.limits = Limits(max_n=engine.scheduler.config.max_num_seqs,
                             max_sequences=self.loop.capacity,
                             max_model_len=self.model.config.max_model_len,
                             vocab_size=self.model.config.vocab_size)
        self.created = int(time.time())
        self.fingerprint = f"tinyinfer-{self.model.runner.name}"
        self.openapi = document(self.limits, self.name, api_key=bool(config.api_key),
                                open_probes=config.open_probes)

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        entries, options, shape = await run_in_threadpool(self._prepare_completion,
                                                          await self._body(request))
        return await self._generate(request, entries, options, shape, deadline)

    async def chat(self, request: Request) -> Response:
        """POST /v1/chat/completions."""
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        entries, options, shape = await run_in_threadpool(self._prepare_chat,
                                                          await self._body(request))
        return await self._generate(request, entries, options, shape, deadline)

    def _prepare_completion(self, body: bytes) -> Prepared:
        """Parse, check and tokenize a completions body (on a worker thread). Prompts x n is
        checked against the server's room before any prompt is tokenized."""
        req = parse_completion(parse_json_object(body), self.limits)
        options = req.options
        self._check_model(options.model)
        self.loop.check_room(len(req.prompts) * options.n)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if options.max_tokens is None else options.max_tokens
        entries = []
        for prompt in req.prompts:
            # special-token text in a prompt is parsed as the token, as vLLM's HF tokenizer does
            ids = (self.model.tokenizer.encode(prompt, allow_special=True) if isinstance(prompt, str)
                   else list(prompt))
            entries += self._entries(ids, options, max_tokens)
        shape = CompletionShape(self.name, self.tokenizer, options.n, len(entries),
                                options.logprobs, self.fingerprint)
        return entries, options, shape

    def _prepare_chat(self, body: bytes) -> Prepared:
        """Parse and check a chat body, lay out its messages and tokenize (on a worker thread)."""
        req = parse_chat(parse_json_object(body), self.limits)
        self._check_model(req.options.model)
        self.loop.check_room(req.options.n)
        text = self.template.render(req.messages)
        ids = self.template.encode(self.model.tokenizer, text)
        room = max(self.model.config.max_model_len - len(ids), 1)  # default: fill the context
        stop = (*self.template.stop, *req.options.sampling["stop"])
        options = dataclasses.replace(req.options, sampling={**req.options.sampling, "stop": stop})
        max_tokens = room if options.max_tokens is None else options.max_tokens
        entries = self._entries(ids, options, max_tokens)
        shape = ChatShape(self.name, self.tokenizer, options.n, len(entries),
                          options.logprobs, self.fingerprint)
        return entries, options, shape

    def _check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(404, f"model {name!r} is not served here; use {self.name!r}",
                           param="model", code="model_not_found")

    def _entries(self, ids: list[int], options: Options,
                 max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
        """n sequences of one prompt; a seeded request gives choice j the seed seed + j."""
        entries = []
        for j in range(options.n):
            sampling = dict(options.sampling)
            if sampling.get("seed") is not None:
                sampling["seed"] += j
            params = SamplingParams(max_tokens=max_tokens, **sampling,
                                    logprobs=options.top_logprobs if options.logprobs else None)
            entries.append((ids, params))
        return entries

    async def _generate(self, request: Request, entries: list[tuple[list[int], SamplingParams]],
                        options: Options, shape: Shape, deadline: float) -> Response:
        job = self.loop.submit(entries, options.n, asyncio.get_running_loop(), shape.input_field)
        await self._until(job, job.accepted, deadline)
        if options.stream:
            return StreamingResponse(self._stream(job, shape, options.include_usage, deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._until(job, self._collect(job, shape), deadline))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        done: set[asyncio.Future[Any]] = set()
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left, or this handler itself was cancelled
                collect.cancel()
                self._give_up(job, "disconnect")
        if collect not in done:  # the client left first: nobody reads an answer now
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(shape.response(collect.result()))

    async def _until(self, job: Job, awaitable: Awaitable[Any], deadline: float) -> Any:
        """Await part of a job within the request's deadline; past it, abort the job."""
        try:
            async with asyncio.timeout_at(deadline):
                return await awaitable
        except TimeoutError:
            self._give_up(job, "timeout")
            raise APIError(504, f"the request ran past the server's limit of "
                                f"{self.config.request_timeout:g} s and was stopped; lower "
                                "max_tokens or raise the server's --request-timeout",
                           type="timeout_error", code="timeout") from None

    def _give_up(self, job: Job, reason: str) -> None:
        self.metrics.count_abort(reason)
        self.loop.cancel(job)

    async def _collect(self, job: Job, shape: Shape) -> list[list[Delta]]:
        """Every delta of every choice, until all have finished."""
        choices: list[list[Delta]] = [[] for _ in range(shape.num_choices)]
        finished = 0
        while finished < shape.num_choices:
            event = await job.events.get()
            if isinstance(event, Failure):
                raise event.error
            choices[event.index].append(event)
            finished += event.finish_reason is not None
        return choices

    async def _stream(self, job: Job, shape: Shape, include_usage: bool,
                      deadline: float) -> AsyncIterator[str]:
        """Server-sent events: one chunk per delta, usage if asked, then [DONE].

        Deltas that queued up while the event loop was busy go out in one write (still one
        event each), so a loaded server spends less time per token on the socket.
        """
        usages: dict[int, Usage] = {}
        done = False
        try:
            for chunk in shape.opening():
                yield _sse(chunk)
            while len(usages) < shape.num_choices:
                events = [await self._until(job, job.events.get(), deadline)]
                while not job.events.empty():
                    events.append(job.events.get_nowait())
                text = []
                for event in events:
                    if isinstance(event, Failure):  # shutdown past its grace, or the engine
                        done = True
                        yield "".join(text) + _sse(event.error.body()) + DONE
                        return
                    chunk = shape.chunk(event)
                    if chunk is not None:
                        text.append(_sse(chunk))
                    if event.usage is not None:
                        usages[event.index] = event.usage
                if text:
                    yield "".join(text)
            done = True
            if include_usage:
                yield _sse(shape.usage_chunk([usages[i] for i in range(shape.num_choices)]))
            yield DONE
        except APIError as exc:  # the deadline passed mid-stream; _until aborted the job
            done = True
            yield _sse(exc.body()) + DONE
        finally:
            if not done:  # the client disconnected (or the server cancelled us) mid-stream
                self._give_up(job, "disconnect")

    async def _body(self, request: Request) -> bytes:
        """The request body: JSON only (415 otherwise), refused past max_body_bytes by its
        declared length or before it is all read (413)."""
        check_json_body(request.headers.get("content-type"))
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise APIError(413, f"the request body is over {self.config.max_body_bytes} bytes; "
                                "send a shorter prompt")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.config.max_body_bytes:
                raise APIError(413, f"the request body is over {self.config.max_body_bytes} bytes; "
                                    "send a shorter prompt")
            chunks.append(chunk)
        return b"".join(chunks)

    # ------------------------------------------------------------------ state

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "tinyinfer",
                "max_model_len": self.model.config.max_model_len}

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the served model."""
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request) -> Response:
        """GET /v1/models/{model}."""
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """GET /health: the engine's latest state, including KV pages in use; 503 once stopped."""
        stats = self.loop.stats
        alive = self.loop.alive
        return JSONResponse({"status": "ok" if alive else "unavailable", "model": self.name,
                             **dataclasses.asdict(stats), "prefix_hit_rate": stats.prefix_hit_rate},
                            status_code=200 if alive else 503)

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics in the Prometheus text format."""
        return PlainTextResponse(self.metrics.render(self.loop.stats),
                                 media_type="text/plain; version=0.0.4")

    async def openapi_document(self, request: Request) -> Response:
        """GET /openapi.json: the endpoints, fields, ranges and answers of this server."""
        return JSONResponse(self.openapi)


class _CountResponses:
    """ASGI middleware: count every answered request by endpoint and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client gets if the app raises before answering

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            path = scope["path"]
            endpoint = "/v1/models" if path.startswith("/v1/models") else path
            self.metrics.count_request(endpoint if endpoint in ENDPOINTS else "other", status)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc)


async def _on_engine_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, TinyInferError)
    input_field = "messages" if request.url.path.endswith("/chat/completions") else "prompt"
    return _error_response(engine_error(exc, input_field))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                    f"{exc.detail}; see GET /v1/models", type=kind))


async def _on_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED)


def create_app(engine: Engine, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving `engine`; its lifespan starts and stops the engine thread.

    `app.state.server` is the OpenAIServer behind the routes; serve/host.py runs the app under a
    uvicorn server that keeps the shutdown promise.
    """
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model_card, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        Route("/openapi.json", server.openapi_document, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        APIError: _on_api_error, TinyInferError: _on_engine_error,
        HTTPException: _on_http_error, ClientDisconnect: _on_disconnect}
    stack = [Middleware(_CountResponses, metrics=server.metrics),
             *middleware(config.api_key, config.open_probes, config.allowed_origins)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                    middleware=stack)
    app.state.server = server
    return app
