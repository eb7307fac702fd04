"""Every limit of the server answers with a clean 4xx (or the documented 504), never a 500 or a
hang: bad bodies, context overflow, a full queue, timeouts, shutdown; plus a fuzz pass."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyinfer
from tests.conftest import INTERRUPTIBLE, nan_embedding_copy
from tests.held import HeldEngine, server_log, tracebacks
from tinyinfer.serve.host import ServerThread
from tinyinfer.serve.server import ServerConfig

LONG = {"max_tokens": 240, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(tinyinfer.Engine(model, max_num_seqs=4), ServerConfig(max_queue=16)) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Content-Type": "application/json"}) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have this status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll until the condition holds (the server's state changes on its own threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the awaited state"
        time.sleep(0.02)


def wait_until_idle(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(f"{url}/health", timeout=10).json()
        if (state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.02)


# ----------------------------------------------------------------- bad requests


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe\x00", b"[" * 100_000, b"NaN"])
def test_malformed_json_is_400(http, data):
    error_of(http.post("/v1/completions", content=data), 400)


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_non_object_json_is_400(http, body):
    error_of(http.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("max_tokens", 1.5), ("max_tokens", True), ("stream", "yes"),
    ("n", 0), ("n", 999), ("stop", [1, 2]), ("stop", ["a"] * 17), ("seed", -1), ("top_p", 0),
    ("logprobs", 99), ("prompt", []), ("prompt", [[]]), ("prompt", [1, "a"]), ("prompt", [-1]),
    ("prompt", ""), ("stream_options", {"include_usage": "yes"}), ("echo", True),
    ("logit_bias", {"5": 10}), ("bogus_field", 1), ("presence_penalty", float("inf")),
    ("repetition_penalty", 1e-310), ("repetition_penalty", 0), ("repetition_penalty", 1e300),
    ("temperature", 2.5), ("temperature", float("nan")), ("top_k", 2**40), ("seed", 2**64),
    ("min_tokens", 10**9), ("user", 5), ("store", "yes"), ("metadata", []), ("stop", ""),
])
def test_wrong_values_are_400(http, model, field, value):
    body = {"model": model.name, "prompt": "To be", "max_tokens": 4, field: value}
    error = error_of(http.post("/v1/completions", content=json.dumps(body)), 400)
    assert field in error["message"] or field == "prompt" or error["param"] == field


def test_an_unknown_field_named_by_a_lone_surrogate_is_a_clean_400(http, model):
    # JSON may spell a lone surrogate ("\ud800"), which no UTF-8 text can hold; the error
    # object names the field by its escape, so it always encodes.
    data = '{"model": "%s", "prompt": "x", "\\ud800": 1}' % model.name
    response = http.post("/v1/completions", content=data.encode())
    assert response.headers["content-type"] == "application/json"
    error = error_of(response, 400)
    assert error["param"] == "\\ud800" and "\\ud800" in error["message"]


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "user"}], [{"role": "wizard", "content": "hi"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
])
def test_bad_messages_are_400(http, model, messages):
    body = {"model": model.name, "messages": messages, "max_tokens": 4}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"].startswith("messages")


def test_missing_or_unknown_model(http, model):
    error_of(http.post("/v1/completions", json={"prompt": "hi"}), 400)
    error = error_of(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and model.name in error["message"]


def test_unknown_route_and_method(http):
    assert error_of(http.get("/v1/nothing"), 404)["type"] == "not_found_error"
    error_of(http.get("/v1/completions"), 405)


def test_oversized_body_is_413(http, model):
    body = {"model": model.name, "prompt": "x" * (2 << 20)}
    error_of(http.post("/v1/completions", json=body), 413)


def test_context_overflow_is_400_with_openai_code(server, model):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    limit = model.config.max_model_len
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model.name, prompt="To be", max_tokens=limit)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"
    assert str(limit) in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model.name, prompt=[5] * (limit + 1), max_tokens=1)
    assert caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model.name, max_tokens=1,
                                       messages=[{"role": "user", "content": "word " * limit}])
    assert caught.value.param == "messages"
    # a token the vocabulary does not have names the field it came in
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model.name, prompt=[model.config.vocab_size + 7], max_tokens=1)
    assert caught.value.param == "prompt" and "outside the vocabulary" in caught.value.message
    # and the server still answers
    assert client.completions.create(model=model.name, prompt="To be", max_tokens=2).choices[0].text


# ----------------------------------------------------------------- capacity and time


def test_full_queue_is_429_with_retry_after(model):
    config = ServerConfig(max_queue=1)  # 2 running + 1 waiting
    engine = HeldEngine(model, max_num_seqs=2)
    engine.hold()  # the three streams stay in flight until the refusals are checked
    with ServerThread(engine, config) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        body = {"model": model.name, "prompt": "Hold", "stream": True, **LONG}
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]  # headers arrive once each is accepted
        assert [r.status_code for r in responses] == [200, 200, 200]
        refused = http.post("/v1/completions", json=body)
        error = error_of(refused, 429)
        assert int(refused.headers["retry-after"]) >= 1 and error["type"] == "rate_limit_error"
        error_of(http.post("/v1/completions", json={**body, "n": 2, "stream": False}), 429)
        engine.resume()
        for stream in streams:
            stream.__exit__(None, None, None)
        wait_until_idle(live.url)
        assert http.post("/v1/completions", json={**body, "stream": False,
                                                   "max_tokens": 3}).status_code == 200


def test_request_timeout_stops_the_request(model):
    engine = HeldEngine(model)
    engine.hold()  # no request can finish before its deadline, however fast this machine is
    with ServerThread(engine, ServerConfig(request_timeout=0.3)) as live:
        body = {"model": model.name, "prompt": "Slow", **LONG}
        error = error_of(httpx.post(f"{live.url}/v1/completions", json=body, timeout=30), 504)
        assert error["type"] == "timeout_error"
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=model.name, prompt="Slow", stream=True,
                                           max_tokens=240, temperature=0,
                                           extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="limit of 0.3 s"):
            for _ in stream:
                pass
        engine.resume()
        wait_until_idle(live.url)
        text = httpx.get(f"{live.url}/metrics").text
        assert 'tinyinfer_request_aborts_total{reason="timeout"} 2' in text


def test_engine_failure_mid_step_is_500_and_the_server_keeps_serving(text_model_folder, tmp_path):
    # A real fault: one corrupt embedding row (NaN) makes every sequence containing that
    # token produce NaN logits, so sampling raises inside step(); other prompts are fine.
    bad_token = tinyinfer.load(text_model_folder).tokenizer.encode("To be")[0]
    model = tinyinfer.load(nan_embedding_copy(text_model_folder, tmp_path / "m", bad_token))
    greedy = tinyinfer.SamplingParams(max_tokens=1, temperature=0)
    with pytest.raises(ValueError, match="NaN"):
        tinyinfer.Engine(model).generate("To be", greedy)
    with ServerThread(tinyinfer.Engine(model)) as live:
        body = {"model": model.name, "prompt": "To be", "max_tokens": 30, "temperature": 0}
        error = error_of(httpx.post(f"{live.url}/v1/completions", json=body, timeout=30), 500)
        assert error["type"] == "server_error"
        state = wait_until_idle(live.url)
        assert state["status"] == "ok"
        prompt = next(p for p in ("or", "not", "the", "sea", "arms")
                      if bad_token not in model.tokenizer.encode(p))
        expected = tinyinfer.Engine(model).generate(prompt, greedy)[0]
        out = httpx.post(f"{live.url}/v1/completions", timeout=30, json={
            "model": model.name, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert out.json()["choices"][0]["text"] == expected.text


# ----------------------------------------------------------------- shutdown


def test_shutdown_lets_in_flight_streams_finish(model):
    expected = tinyinfer.Engine(model).generate(
        "Finish me", tinyinfer.SamplingParams(max_tokens=80, temperature=0))[0].text
    live = ServerThread(tinyinfer.Engine(model), shutdown_timeout=20).start()
    url = live.url
    body = {"model": model.name, "prompt": "Finish me", "max_tokens": 80, "temperature": 0,
            "stream": True}
    stopper = threading.Thread(target=live.stop)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        events = [next(lines)]
        stopper.start()  # shut down while this stream is mid-flight
        events += [line for line in lines if line]
    stopper.join(30)
    assert not stopper.is_alive()
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == expected
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


def test_shutdown_past_its_grace_period_keeps_the_documented_promise(model):
    """Past --shutdown-timeout a stream gets an error event and [DONE], a whole request a JSON
    503 with Retry-After; no traceback is logged and every page is freed."""
    engine = HeldEngine(model)
    engine.hold(after_first_text=True)  # the stream gets its first event; then nothing finishes
    live = ServerThread(engine, shutdown_timeout=0.2).start()
    body = {"model": model.name, "prompt": "Too long", **LONG}
    with server_log() as log, httpx.Client(base_url=live.url, timeout=30) as http, \
            ThreadPoolExecutor(2) as pool:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            events = [next(lines)]  # the first token's event: the engine is held from now on
            whole = pool.submit(http.post, "/v1/completions", json=body)
            wait_until(lambda: health(live.url)["waiting"] + health(live.url)["running"] == 2)
            stopper = pool.submit(live.stop)
            events += [line for line in lines if line]
        answer = whole.result()
        stopper.result()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "shutting_down"
    assert error_of(answer, 503)["code"] == "shutting_down"
    assert int(answer.headers["retry-after"]) > 0
    assert tracebacks(log) == []
    assert not engine.has_unfinished()
    assert engine.pool.num_used_pages == 0


def test_serve_command_starts_serves_and_stops_on_interrupt(text_model_folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wiring = (INTERRUPTIBLE +  # as in a terminal, whatever started this test run
              "import argparse, sys; from tinyinfer.cli import serve as cli_serve\n"  # as tinyinfer.cli.commands does
              "parser = argparse.ArgumentParser(); cli_serve.add_parser(parser.add_subparsers())\n"
              "try: sys.exit(cli_serve.run(parser.parse_args(sys.argv[1:])))\n"
              "except KeyboardInterrupt: sys.exit(130)")
    proc = subprocess.Popen(
        [sys.executable, "-c", wiring, "serve", "--model", str(text_model_folder),
         "--port", str(port), "--served-model-name", "tiny", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").json()["model"] == "tiny"
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                         json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert out.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully, then re-raises it
        assert proc.wait(30) == 130
        log = proc.stderr.read()
        assert "serving tiny (numpy runner)" in log and "Traceback" not in log
    finally:
        proc.kill()
        proc.wait()


def test_serve_refuses_bad_limits(text_model_folder):
    import argparse

    from tinyinfer.cli import serve as cli_serve

    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(text_model_folder), "--max-num-seqs", "0"])
    with pytest.raises(tinyinfer.TinyInferError, match="--max-num-seqs must be positive"):
        cli_serve.run(args)


# ----------------------------------------------------------------- fuzz

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
SMALL_INT = st.integers(-3, 12)
PLAUSIBLE = {
    "max_tokens": SMALL_INT, "n": st.integers(-1, 3), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_k": SMALL_INT, "seed": st.integers(-5, 2**64),
    "stream": st.booleans(), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "logprobs": st.integers(-1, 22) | st.booleans(), "top_logprobs": st.integers(-1, 22),
    "presence_penalty": st.floats(-3, 3), "stream_options": st.just({"include_usage": True}),
    "prompt": st.text(max_size=20) | st.lists(st.integers(-2, 400), max_size=5)
              | st.lists(st.text(max_size=8), max_size=3),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]),
         "content": st.text(max_size=20) | JUNK}), max_size=3),
    "min_p": st.floats(-1, 2), "ignore_eos": st.booleans(), "echo": st.booleans(),
}


@st.composite
def bodies(draw, base: dict) -> dict:
    """A valid body with some fields dropped, replaced by plausible or junk values, or added."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE) + ["model", "bogus"]), max_size=4)):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            body.pop(name, None)
        else:
            body[name] = draw(PLAUSIBLE.get(name, JUNK) if choice == 1 else JUNK)
    if "max_tokens" not in body or not isinstance(body["max_tokens"], int) or body["max_tokens"] > 12:
        body["max_tokens"] = 8  # keep every example quick; other fields stay free
    return body


def check_answer(response: httpx.Response) -> None:
    """A 2xx is a whole answer or stream; anything else is a 4xx OpenAI error body."""
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert response.status_code in (400, 404, 413, 422), response.text
        assert isinstance(response.json()["error"]["message"], str)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text
    else:
        assert response.json()["choices"]


FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_fuzzed_completion_bodies_never_500(http, model, data):
    body = data.draw(bodies({"model": model.name, "prompt": "To be", "max_tokens": 4}))
    check_answer(http.post("/v1/completions", content=json.dumps(body)))


@FUZZ
@given(data=st.data())
def test_fuzzed_chat_bodies_never_500(http, model, data):
    body = data.draw(bodies({"model": model.name, "messages": [{"role": "user", "content": "hi"}]}))
    check_answer(http.post("/v1/chat/completions", content=json.dumps(body)))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_fuzzed_raw_bytes_never_500(http, raw):
    check_answer(http.post("/v1/completions", content=raw))


def test_server_still_healthy_after_the_abuse(server, http, model):
    state = wait_until_idle(server.url)
    assert state["status"] == "ok"
    assert "tinyinfer_requests_total" in http.get("/metrics").text
    metrics = http.get("/metrics").text
    assert 'status="500"' not in metrics
    out = http.post("/v1/completions", json={"model": model.name, "prompt": "Still", "max_tokens": 3})
    assert out.json()["usage"]["completion_tokens"] == 3
