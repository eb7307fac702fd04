"""The OpenAPI 3.1 document served at /openapi.json: the endpoints this server implements, the
fields it accepts with the ranges it enforces (from schemas.ranges, the table the checks use),
and the shapes of its answers. Clients and fuzzers (the test suite runs schemathesis on it)
read the server's real contract here."""

from __future__ import annotations

from typing import Any

import tinyinfer
from tinyinfer.serve.schemas import (
    CHAT_ROLES,
    CHAT_UNSUPPORTED,
    MAX_STOP,
    Limits,
    Range,
    ranges,
)

DESCRIPTIONS = {
    "model": "the served model's name (GET /v1/models)",
    "max_tokens": "tokens to generate at most (completions: 16 if left out; chat: what the "
                  "context allows)",
    "max_completion_tokens": "chat's name for max_tokens",
    "temperature": "0 is greedy; higher is more random",
    "top_p": "sample from the smallest set of tokens whose probability reaches top_p",
    "n": "choices per prompt; with a seed, choice j samples with seed + j",
    "best_of": "accepted only equal to n",
    "stream": "answer as server-sent events, ending with data: [DONE]",
    "stream_options": "include_usage: a last chunk with the usage",
    "stop": f"up to {MAX_STOP} strings; the text is cut before the first one found",
    "seed": "same seed, prompt and parameters: same text",
    "presence_penalty": "lower the logit of every token already generated",
    "frequency_penalty": "lower each generated token's logit by this times its count",
    "top_k": "keep the k most likely tokens (0: all)",
    "min_p": "drop tokens less likely than min_p times the most likely one",
    "repetition_penalty": "divide positive (multiply negative) logits of seen tokens (1: off)",
    "min_tokens": "end-of-sequence is forbidden before this many tokens",
    "ignore_eos": "generate past the end-of-sequence token, up to max_tokens",
    "logprobs": "log-probabilities of the chosen tokens and this many alternatives",
    "top_logprobs": "alternatives per token (needs logprobs: true)",
}
IGNORED_TYPES = {"user": "string", "service_tier": "string", "store": "boolean",
                 "metadata": "object", "parallel_tool_calls": "boolean"}
SAMPLING = ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
            "top_k", "min_p", "repetition_penalty", "min_tokens", "max_tokens")


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _ranged(name: str, bounds: Range) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": bounds.kind, "maximum": bounds.high,
                              "description": DESCRIPTIONS.get(name, "")}
    schema["exclusiveMinimum" if bounds.low_open else "minimum"] = bounds.low
    return _nullable(schema)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _common(limits: Limits, model: str) -> dict[str, Any]:
    table = ranges(limits)
    text = {"type": "string", "minLength": 1}
    props: dict[str, Any] = {
        "model": {"type": "string", "enum": [model], "description": DESCRIPTIONS["model"]},
        **{name: _ranged(name, table[name]) for name in SAMPLING},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "properties": {"include_usage": {"type": "boolean"}}}),
        "stop": {"anyOf": [text, {"type": "array", "items": text, "maxItems": MAX_STOP},
                           {"type": "null"}], "description": DESCRIPTIONS["stop"]},
        "ignore_eos": _nullable({"type": "boolean"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        **{name: _nullable({"type": kind}) for name, kind in IGNORED_TYPES.items()},
    }
    for name in ("stream", "stream_options", "ignore_eos"):
        props[name]["description"] = DESCRIPTIONS[name]
    return props


def _completion_request(limits: Limits, model: str) -> dict[str, Any]:
    table = ranges(limits)
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "maxItems": limits.max_model_len,
           "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}
    many = {"minItems": 1, "maxItems": limits.max_sequences}
    prompt = {"anyOf": [text, {"type": "array", "items": text, **many}, ids,
                        {"type": "array", "items": ids, **many}],
              "description": "text, texts, token ids or lists of token ids; prompts x n at "
                             f"most {limits.max_sequences}"}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": {**_common(limits, model), "prompt": prompt,
                           "logprobs": _ranged("logprobs", table["logprobs"]),
                           "best_of": _ranged("best_of", table["best_of"]),
                           "echo": {"enum": [False, None]}, "suffix": {"enum": ["", None]}}}


def _chat_request(limits: Limits, model: str) -> dict[str, Any]:
    table = ranges(limits)
    part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
               "properties": {"role": {"enum": list(CHAT_ROLES)}, "name": {"type": "string"},
                              "content": {"anyOf": [{"type": "string"},
                                                    {"type": "array", "items": part}]}}}
    inert = {name: {"enum": [*values, None]} for name, values in CHAT_UNSUPPORTED.items()
             if values and all(isinstance(v, str) for v in values)}
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": {
                **_common(limits, model),
                "messages": {"type": "array", "items": message, "minItems": 1},
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _ranged("top_logprobs", table["top_logprobs"]),
                "max_completion_tokens": _ranged("max_completion_tokens",
                                                 table["max_completion_tokens"]),
                "tools": _nullable({"type": "array", "maxItems": 0}),
                "functions": _nullable({"type": "array", "maxItems": 0}),
                "response_format": _nullable({
                    "type": "object", "additionalProperties": False, "required": ["type"],
                    "properties": {"type": {"enum": ["text"]}}}),
                "modalities": _nullable({"type": "array", "items": {"enum": ["text"]},
                                         "minItems": 1, "maxItems": 1}),
                **inert}}


def _answers() -> dict[str, Any]:
    """Response bodies: completions, chat, models, health, errors."""
    integer = {"type": "integer"}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {"prompt_tokens": integer, "completion_tokens": integer,
                            "total_tokens": integer,
                            "prompt_tokens_details": {"type": "object",
                                                      "properties": {"cached_tokens": integer}}}}
    finish = {"enum": ["stop", "length", None]}

    def envelope(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                "properties": {"id": {"type": "string"}, "object": {"enum": [kind]},
                               "created": integer, "model": {"type": "string"},
                               "system_fingerprint": {"type": "string"},
                               "choices": {"type": "array", "items": choice}, "usage": usage}}

    def chunk(kind: str) -> dict[str, Any]:
        return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
                "properties": {"id": {"type": "string"}, "object": {"enum": [kind]},
                               "created": integer, "model": {"type": "string"},
                               "choices": {"type": "array", "items": {
                                   "type": "object", "required": ["index", "finish_reason"],
                                   "properties": {"index": integer, "finish_reason": finish}}},
                               "usage": usage}}

    return {
        "CompletionChunk": chunk("text_completion"),
        "ChatCompletionChunk": chunk("chat.completion.chunk"),
        "Completion": envelope("text_completion", {
            "type": "object", "required": ["index", "text", "finish_reason"],
            "properties": {"index": integer, "text": {"type": "string"}, "finish_reason": finish,
                           "logprobs": {"type": ["object", "null"]}}}),
        "ChatCompletion": envelope("chat.completion", {
            "type": "object", "required": ["index", "message", "finish_reason"],
            "properties": {"index": integer, "finish_reason": finish,
                           "logprobs": {"type": ["object", "null"]},
                           "message": {"type": "object", "required": ["role", "content"],
                                       "properties": {"role": {"enum": ["assistant"]},
                                                      "content": {"type": "string"}}}}}),
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"enum": ["model"]},
                                 "created": integer, "owned_by": {"type": "string"},
                                 "max_model_len": integer}},
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"enum": ["list"]},
                                     "data": {"type": "array", "items": _ref("Model")}}},
        "Health": {"type": "object", "required": ["status", "model", "running", "waiting",
                                                  "kv_pages_used", "kv_pages_total"],
                   "properties": {"status": {"enum": ["ok", "unavailable"]},
                                  "model": {"type": "string"}, "running": integer,
                                  "waiting": integer, "kv_pages_used": integer,
                                  "kv_pages_total": integer, "kv_pages_cached": integer,
                                  "prefix_hit_tokens": integer, "prefix_queried_tokens": integer,
                                  "steps": integer, "prefix_hit_rate": {"type": "number"}}},
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
    }


ERRORS = {
    "400": "a field of the wrong type or out of range, an unknown field, a prompt too long",
    "401": "no API key, or a wrong one (when the server has one)",
    "404": "a model this server does not serve",
    "413": "a body over the server's size limit",
    "415": "a body not declared as JSON (Content-Type: application/json)",
    "429": "running and queued sequences are at capacity; retry after Retry-After seconds",
    "500": "the engine failed while running the request (the server keeps serving)",
    "503": "the server is shutting down; retry after Retry-After seconds",
    "504": "the request ran past the server's --request-timeout",
}


def _error(status: str) -> dict[str, Any]:
    return {"description": ERRORS[status], "content": {"application/json": {"schema": _ref("Error")}}}


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: a chunk, an error object, or the closing [DONE]."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}


def _generation(summary: str, request: str, answer: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the whole answer, or with stream: true server-sent events "
                                   "(data: chunk lines, then data: [DONE])",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": _event(f"{answer}Chunk")}}},
            **{status: _error(status) for status in ERRORS}}}}


def document(limits: Limits, model: str, api_key: bool, open_probes: bool) -> dict[str, Any]:
    """The OpenAPI document of a server with these limits, serving `model`."""
    auth = ({"401": _error("401")} if api_key else {})
    probe_auth = {} if open_probes else auth

    def get(summary: str, answer: dict[str, Any], extra: dict[str, Any],
            media: str = "application/json") -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": summary, "content": {media: {"schema": answer}}}, **extra}}}

    paths = {
        "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest",
                                            "ChatCompletion"),
        "/v1/models": get("The served model", _ref("ModelList"), auth),
        "/v1/models/{model}": get("One model", _ref("Model"), {"404": _error("404"), **auth}),
        "/health": get("Liveness and engine state", _ref("Health"), {
            "503": {"description": "the engine loop has stopped",
                    "content": {"application/json": {"schema": _ref("Health")}}}, **probe_auth}),
        "/metrics": get("Prometheus metrics", {"type": "string"}, probe_auth,
                        media="text/plain"),
        "/openapi.json": get("This document", {"type": "object"}, auth),
    }
    paths["/v1/models/{model}"]["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tinyinfer", "version": tinyinfer.__version__,
                 "description": "OpenAI-compatible server (docs/serving.md)"},
        "paths": paths,
        "components": {"schemas": {"CompletionRequest": _completion_request(limits, model),
                                   "ChatCompletionRequest": _chat_request(limits, model),
                                   **_answers()}},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        if open_probes:
            for path in ("/health", "/metrics"):
                paths[path]["get"]["security"] = []
    return doc
