"""OpenAI request bodies → checked Python values, and OpenAI-shaped error bodies.

Every check here turns a bad body into an `APIError` with a 4xx status, so no client input
can reach the engine unchecked or end in a 500. Each numeric field has a `Range` (`ranges`)
inside which the sampling math stays finite; the same table is what `/openapi.json` publishes
(serve/openapi.py), so the documented bounds are the enforced ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tinyinfer.errors import ContextOverflowError, PromptError, SamplingParamsError, TinyInferError
from tinyinfer.sampling import MAX_LOGPROBS, REPETITION_PENALTY_RANGE

MAX_STOP = 16
MAX_SEED = 2**63 - 1  # OpenAI's seed is a signed 64-bit integer; negative seeds are refused
MAX_TOP_K = 2**31 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Sampling fields beyond OpenAI's, as vLLM accepts them; passed through to SamplingParams.
EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens")
# Accepted and ignored (after a type check): they change nothing about what this server computes.
IGNORED = {"user": str, "service_tier": str, "store": bool, "metadata": dict,
           "parallel_tool_calls": bool}
TYPE_NAMES = {str: "a string", bool: "true or false", dict: "an object"}
COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
          "seed", "presence_penalty", "frequency_penalty", *EXTRA_SAMPLING, *IGNORED)
COMPLETION_FIELDS = frozenset((*COMMON, "prompt", "logprobs", "echo", "best_of", "suffix",
                               "logit_bias"))
CHAT_FIELDS = frozenset((*COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens",
                         "logit_bias", "tools", "tool_choice", "functions", "function_call",
                         "response_format", "modalities"))
# Features this server lacks, with the values that ask for nothing (also accepted).
CHAT_UNSUPPORTED = {"tools": (), "functions": (), "tool_choice": ("none", "auto"),
                    "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
                    "modalities": (["text"],)}


def printable(text: str) -> str:
    """Text that encodes as UTF-8: a lone surrogate (JSON allows "\\ud800") becomes its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = printable(message)  # it may quote the client's own text
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else printable(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code=code)


def engine_error(exc: TinyInferError, input_field: str | None = None) -> APIError:
    """Map an engine refusal (bad params, prompt too long, pool too small) to a 400, naming the
    field at fault where one is: a sampling parameter by its name (the message starts with it),
    the input (``input_field``: prompt or messages) for a token outside the vocabulary or a
    prompt that leaves no room for the answer."""
    code = "context_length_exceeded" if isinstance(exc, ContextOverflowError) else None
    param = None
    if isinstance(exc, SamplingParamsError):
        param = exc.field
    elif isinstance(exc, PromptError):
        param = input_field
    return bad_request(str(exc), param=param, code=code)


def parse_json_object(data: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object, in UTF-8 (NaN and Infinity, which
    Python clients send, parse here and fail the range of the field they are in)."""
    try:
        body = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start}); "
                          "send JSON in UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


@dataclass(frozen=True)
class Limits:
    """What this server allows, which bounds some fields: the checks and the schema share it."""

    max_n: int  # choices per prompt (the batch size)
    max_sequences: int  # prompts x n that the running batch and the queue can hold
    max_model_len: int  # the context: max_tokens and min_tokens are at most this
    vocab_size: int  # token ids of a prompt are below this


@dataclass(frozen=True)
class Range:
    """An integer or number field's inclusive range (the low end excluded where low_open)."""

    kind: str  # "integer" or "number"
    low: float
    high: float
    low_open: bool = False

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "integer" and not isinstance(value, int):
            return False
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high  # NaN holds nowhere

    def describe(self) -> str:
        if self.kind == "integer":
            return f"an integer in [{int(self.low)}, {int(self.high)}]"
        return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


def ranges(limits: Limits) -> dict[str, Range]:
    """Every numeric field of both endpoints (`logprobs` is the completions' integer form)."""
    tokens = Range("integer", 1, limits.max_model_len)
    return {
        "max_tokens": tokens, "max_completion_tokens": tokens,
        "n": Range("integer", 1, limits.max_n), "best_of": Range("integer", 1, limits.max_n),
        "temperature": Range("number", 0, 2),
        "top_p": Range("number", 0, 1, low_open=True),
        "presence_penalty": Range("number", -2, 2), "frequency_penalty": Range("number", -2, 2),
        "top_k": Range("integer", 0, MAX_TOP_K),
        "min_p": Range("number", 0, 1),
        "repetition_penalty": Range("number", *REPETITION_PENALTY_RANGE),
        "min_tokens": Range("integer", 0, limits.max_model_len),
        "seed": Range("integer", 0, MAX_SEED),
        "logprobs": Range("integer", 0, MAX_LOGPROBS),
        "top_logprobs": Range("integer", 0, MAX_LOGPROBS),
    }


@dataclass(frozen=True)
class Options:
    """What every generation request asks for besides its prompt."""

    model: str
    sampling: dict[str, Any]  # SamplingParams keyword arguments, max_tokens excluded
    max_tokens: int | None  # None: as many as the context allows (chat) or 16 (completions)
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool  # report the chosen tokens' log-probabilities
    top_logprobs: int  # and this many alternatives per token


@dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body: one or more prompts, each text or token ids."""

    prompts: tuple[str | tuple[int, ...], ...]
    options: Options


@dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions body: messages with string contents."""

    messages: tuple[dict[str, str], ...]
    options: Options


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Body:
    """Typed access to the fields of one JSON body; a wrong type or range is a 400 naming it."""

    def __init__(self, body: dict[str, Any], allowed: frozenset[str], limits: Limits) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad_request(f"unrecognized request argument {unknown[0]!r}; remove it",
                              param=unknown[0])
        self.body = body
        self.ranges = ranges(limits)
        for name, kind in IGNORED.items():
            self.get(name, lambda v, kind=kind: isinstance(v, kind), TYPE_NAMES[kind])

    def get(self, name: str, check: Any, expected: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise bad_request(f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name)
        return value

    def ranged(self, name: str, default: Any = None) -> Any:
        """An integer or number field within its range."""
        bounds = self.ranges[name]
        return self.get(name, bounds.holds, bounds.describe(), default)

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, lambda v: isinstance(v, bool), "true or false", default)

    def unsupported(self, name: str, *inert: Any) -> None:
        """Refuse a feature this server lacks unless the value asks for nothing."""
        value = self.body.get(name)
        if value is not None and not any(value == v for v in (*inert, [], {})):
            raise bad_request(f"{name} is not supported by this server; leave it out", param=name)


def _stop(body: _Body) -> tuple[str, ...]:
    def ok(v: Any) -> bool:
        strings = [v] if isinstance(v, str) else v if isinstance(v, list) else [None]
        return all(isinstance(s, str) and s for s in strings)
    stop = body.get("stop", ok, "a non-empty string or a list of non-empty strings", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP:  # every stop string is searched for after every token
        raise bad_request(f"stop has {len(stop)} strings; give at most {MAX_STOP}", param="stop")
    return stop


def _options(body: _Body, logprobs: bool, top_logprobs: int) -> Options:
    """The fields both endpoints share."""
    model = body.get("model", lambda v: isinstance(v, str), "a string")
    if model is None:
        raise bad_request("model is required: name the served model (see GET /v1/models)",
                          param="model")
    n = body.ranged("n", 1)
    stream_options = body.get("stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = stream_options.get("include_usage", False)
    if set(stream_options) - {"include_usage"} or not isinstance(include_usage, bool):
        raise bad_request('stream_options must be {"include_usage": true|false}',
                          param="stream_options")
    sampling: dict[str, Any] = {"stop": _stop(body)}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                 "repetition_penalty", "seed", "top_k", "min_tokens"):
        value = body.ranged(name)
        if value is not None:
            sampling[name] = value
    sampling["ignore_eos"] = body.boolean("ignore_eos")
    body.unsupported("logit_bias")
    return Options(model=model, sampling=sampling, max_tokens=body.ranged("max_tokens"), n=n,
                   stream=body.boolean("stream"), include_usage=include_usage,
                   logprobs=logprobs, top_logprobs=top_logprobs)


def _prompts(value: Any, limits: Limits) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: text, list of texts, token ids, list of token-id lists."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)
    if isinstance(value, list) and value and not ids(value) and len(value) > limits.max_sequences:
        raise bad_request(f"prompt lists {len(value)} prompts but this server holds at most "
                          f"{limits.max_sequences} sequences at once; send fewer", param="prompt")
    if isinstance(value, str) and value:
        return (value,)
    if ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(isinstance(p, str) and p for p in value):
        return tuple(value)
    if isinstance(value, list) and value and all(ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists (none of them empty)", param="prompt")


def parse_completion(body: dict[str, Any], limits: Limits) -> CompletionRequest:
    """Check a /v1/completions body."""
    b = _Body(body, COMPLETION_FIELDS, limits)
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    prompts = _prompts(body["prompt"], limits)
    if b.boolean("echo"):
        raise bad_request("echo is not supported by this server; leave it out", param="echo")
    b.unsupported("suffix", "")
    top = b.ranged("logprobs")
    options = _options(b, logprobs=top is not None, top_logprobs=top or 0)
    if b.ranged("best_of", options.n) != options.n:
        raise bad_request("best_of other than n is not supported; leave it out", param="best_of")
    return CompletionRequest(prompts=prompts, options=options)


def _content(message: dict[str, Any], index: int) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts "
                      '({"type": "text", "text": "..."}); this server reads text only',
                      param=f"messages[{index}].content")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects",
                          param="messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise bad_request(f"messages[{i}] must be an object with role, content and optional "
                              "name", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                              param=f"messages[{i}].role")
        checked = {"role": role, "content": _content(message, i)}
        if "name" in message:
            if not isinstance(message["name"], str):
                raise bad_request(f"messages[{i}].name must be a string", param=f"messages[{i}].name")
            checked["name"] = message["name"]
        out.append(checked)
    return tuple(out)


def parse_chat(body: dict[str, Any], limits: Limits) -> ChatRequest:
    """Check a /v1/chat/completions body."""
    b = _Body(body, CHAT_FIELDS, limits)
    messages = _messages(body.get("messages"))
    for name, inert in CHAT_UNSUPPORTED.items():
        b.unsupported(name, *inert)
    want = b.boolean("logprobs")
    top = b.ranged("top_logprobs", 0)
    if top and not want:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    options = _options(b, logprobs=want, top_logprobs=top)
    limit = b.ranged("max_completion_tokens")
    if limit is not None:
        options = dataclasses.replace(options, max_tokens=limit)
    return ChatRequest(messages=messages, options=options)
