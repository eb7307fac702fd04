"""/openapi.json describes the server as it is: the routes it has, the ranges it enforces, the
answers it gives. Schemathesis fuzzes a live server on loopback from that document (bounded in
examples and time): no request may get a 5xx, every answer must match the document, and the
KV page pool must be all free afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

import tinyinfer
from tinyinfer.serve.host import ServerThread
from tinyinfer.serve.server import ServerConfig

MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


@pytest.fixture(scope="module")
def live(model):
    engine = tinyinfer.Engine(model, max_num_seqs=MAX_NUM_SEQS, detail="none")  # as `serve`
    with ServerThread(engine, ServerConfig(max_queue=8, request_timeout=60)) as server:
        yield server


@pytest.fixture(scope="module")
def document(live) -> dict:
    return httpx.get(f"{live.url}/openapi.json", timeout=10).json()


def test_the_document_lists_exactly_the_routes_the_app_has(live, document):
    routes = {route.path.replace("{model:path}", "{model}"): route.methods
              for route in live.app.routes}
    assert set(document["paths"]) == set(routes)
    for path, operations in document["paths"].items():
        assert {method.upper() for method in operations} <= routes[path], path


def request_fields(document: dict, name: str) -> dict:
    return document["components"]["schemas"][name]["properties"]


def ranged(schema: dict) -> dict | None:
    """The numeric schema inside a nullable field's anyOf, if the field is numeric."""
    for option in schema.get("anyOf", ()):
        if option.get("type") in ("integer", "number"):
            return option
    return None


@pytest.mark.parametrize("endpoint,request_schema,base", [
    ("/v1/completions", "CompletionRequest", {"prompt": "Edge"}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "Edge"}], "logprobs": True}),
])
def test_the_published_ranges_are_the_enforced_ones(live, model, document, endpoint,
                                                    request_schema, base):
    """Each numeric field's published bounds are accepted, and just past them refused."""
    fields = {name: numeric for name, schema in request_fields(document, request_schema).items()
              if (numeric := ranged(schema)) is not None}
    assert {"temperature", "top_p", "repetition_penalty", "seed", "n"} <= set(fields)
    body = {"model": model.name, "max_tokens": 2, **base}
    with httpx.Client(base_url=live.url, timeout=60) as http:
        for name, numeric in fields.items():
            step = 1 if numeric["type"] == "integer" else 1e-3
            low = numeric.get("minimum", numeric.get("exclusiveMinimum"))
            inside = [numeric["maximum"]] + ([low] if "minimum" in numeric else [])
            outside = [numeric["maximum"] + step, low if "exclusiveMinimum" in numeric else low - step]
            if name in ("max_tokens", "max_completion_tokens", "min_tokens"):
                inside = []  # their top is the whole context: prompt + max_tokens overflows it
            for value in inside:
                extra = {"best_of": value} if name == "n" and endpoint == "/v1/completions" else {}
                if name == "best_of":
                    extra = {"n": value}
                answer = http.post(endpoint, json={**body, name: value, **extra})
                assert answer.status_code == 200, (name, value, answer.text)
            for value in outside:
                answer = http.post(endpoint, json={**body, name: value})
                assert answer.status_code == 400, (name, value, answer.text)
                assert answer.json()["error"]["param"] == name


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_5xx_and_match_the_document(case, live):
    response = case.call(base_url=live.url, timeout=60)
    case.validate_response(response, checks=CHECKS)
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]"
        assert all("error" not in json.loads(e[6:]) for e in events[:-1]), response.text


def test_after_the_fuzzing_every_page_is_free_and_no_request_failed(live):
    deadline = time.monotonic() + 30
    while True:  # a disconnected request's abort reaches the engine between two steps
        state = httpx.get(f"{live.url}/health", timeout=10).json()
        if (state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
    assert 'status="5' not in metrics
    assert 'tinyinfer_requests_total{endpoint="/v1/completions",status="200"}' in metrics
