"""OpenAI request bodies → checked Python values, and OpenAI-shaped error bodies.

Every check here turns a bad body into an `APIError` with a 4xx status, so no client input
can reach the engine unchecked or end in a 500. Value ranges of sampling fields are left to
`SamplingParams`, the one place that knows them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from tinyinfer.errors import ContextOverflowError, TinyInferError

MAX_STOP = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Sampling fields beyond OpenAI's, as vLLM accepts them; passed through to SamplingParams.
EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens")
# Accepted and ignored: they change nothing about what this server computes.
IGNORED = ("user", "service_tier", "store", "metadata", "parallel_tool_calls")
COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
          "seed", "presence_penalty", "frequency_penalty", *EXTRA_SAMPLING, *IGNORED)
COMPLETION_FIELDS = frozenset((*COMMON, "prompt", "logprobs", "echo", "best_of", "suffix",
                               "logit_bias"))
CHAT_FIELDS = frozenset((*COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens",
                         "logit_bias", "tools", "tool_choice", "functions", "function_call",
                         "response_format", "modalities"))


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code=code)


def engine_error(exc: TinyInferError) -> APIError:
    """Map an engine refusal (bad params, prompt too long, pool too small) to a 400."""
    code = "context_length_exceeded" if isinstance(exc, ContextOverflowError) else None
    return bad_request(str(exc), code=code)


def parse_json_object(data: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Body:
    """Typed access to the fields of one JSON body; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict[str, Any], allowed: frozenset[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad_request(f"unrecognized request argument {unknown[0]!r}; remove it",
                              param=unknown[0])
        self.body = body

    def get(self, name: str, check: Any, expected: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise bad_request(f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name)
        return value

    def integer(self, name: str, default: int | None = None) -> int | None:
        return self.get(name, _is_int, "an integer", default)

    def number(self, name: str) -> float | None:
        return self.get(name, _is_number, "a number")

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, lambda v: isinstance(v, bool), "true or false", default)

    def unsupported(self, name: str, *inert: Any) -> None:
        """Refuse a feature this server lacks unless the value asks for nothing."""
        value = self.body.get(name)
        if value is not None and not any(value == v for v in (*inert, [], {})):
            raise bad_request(f"{name} is not supported by this server; leave it out", param=name)


def _stop(body: _Body) -> tuple[str, ...]:
    def ok(v: Any) -> bool:
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))
    stop = body.get("stop", ok, "a string or a list of strings", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP:  # every stop string is searched for after every token
        raise bad_request(f"stop has {len(stop)} strings; give at most {MAX_STOP}", param="stop")
    return stop


def _options(body: _Body, max_n: int, logprobs: bool, top_logprobs: int) -> Options:
    """The fields both endpoints share."""
    model = body.get("model", lambda v: isinstance(v, str), "a string")
    if model is None:
        raise bad_request("model is required: name the served model (see GET /v1/models)",
                          param="model")
    n = body.integer("n", 1)
    if not 1 <= n <= max_n:
        raise bad_request(f"n={n} is invalid: this server makes between 1 and {max_n} choices "
                          "per prompt", param="n")
    stream_options = body.get("stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = stream_options.get("include_usage", False)
    if set(stream_options) - {"include_usage"} or not isinstance(include_usage, bool):
        raise bad_request('stream_options must be {"include_usage": true|false}',
                          param="stream_options")
    sampling: dict[str, Any] = {"stop": _stop(body)}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                 "repetition_penalty"):
        value = body.number(name)
        if value is not None:
            sampling[name] = value
    for name in ("seed", "top_k", "min_tokens"):
        value = body.integer(name)
        if value is not None:
            sampling[name] = value
    sampling["ignore_eos"] = body.boolean("ignore_eos")
    body.unsupported("logit_bias")
    return Options(model=model, sampling=sampling, max_tokens=body.integer("max_tokens"), n=n,
                   stream=body.boolean("stream"), include_usage=include_usage,
                   logprobs=logprobs, top_logprobs=top_logprobs)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four prompt forms: text, list of texts, token ids, list of token-id lists."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)
    if isinstance(value, str):
        return (value,)
    if ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    if isinstance(value, list) and value and all(ids(p) for p in value):
        return tuple(tuple(p) for p in value)
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists (none of them empty)", param="prompt")


def parse_completion(body: dict[str, Any], max_n: int) -> CompletionRequest:
    """Check a /v1/completions body."""
    b = _Body(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    prompts = _prompts(body["prompt"])
    if b.boolean("echo"):
        raise bad_request("echo is not supported by this server; leave it out", param="echo")
    b.unsupported("suffix", "")
    top = b.integer("logprobs")
    options = _options(b, max_n, logprobs=top is not None, top_logprobs=top or 0)
    best_of = b.integer("best_of", options.n)
    if best_of != options.n:
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


def parse_chat(body: dict[str, Any], max_n: int) -> ChatRequest:
    """Check a /v1/chat/completions body."""
    b = _Body(body, CHAT_FIELDS)
    messages = _messages(body.get("messages"))
    for name, *inert in (("tools",), ("functions",), ("tool_choice", "none", "auto"),
                         ("function_call", "none", "auto"), ("response_format", {"type": "text"}),
                         ("modalities", ["text"])):
        b.unsupported(name, *inert)
    want = b.boolean("logprobs")
    top = b.integer("top_logprobs", 0)
    if top and not want:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    options = _options(b, max_n, logprobs=want, top_logprobs=top)
    limit = b.integer("max_completion_tokens")
    if limit is not None:
        options = dataclasses.replace(options, max_tokens=limit)
    return ChatRequest(messages=messages, options=options)
