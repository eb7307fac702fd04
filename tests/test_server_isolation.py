"""No request can break another: settings that would overflow the math are refused, a row of
logits the engine cannot sample from fails its own request only, and a body with many prompts
is refused before any is tokenized, with the tokenizing itself off the event loop."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import tinyinfer
from tests.conftest import nan_embedding_copy
from tests.held import HeldEngine, server_log, tracebacks
from tinyinfer.serve.host import ServerThread
from tinyinfer.serve.server import ServerConfig


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def in_engine(url: str) -> int:
    state = health(url)
    return state["running"] + state["waiting"]


def wait_until(condition, timeout: float = 30.0) -> None:
    """Poll until the condition holds (the server's state changes on its own threads)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the awaited state"
        time.sleep(0.02)


def stream_events(http: httpx.Client, body: dict) -> list[str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line]


def text_of(events: list[str]) -> str:
    return "".join(json.loads(e[6:])["choices"][0]["text"] for e in events
                   if e != "data: [DONE]" and "choices" in json.loads(e[6:]))


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


def offline(model, prompt, **params) -> str:
    return tinyinfer.Engine(model).generate(prompt, tinyinfer.SamplingParams(**params))[0].text


def test_a_penalty_that_would_overflow_is_refused_and_the_running_stream_goes_on(model):
    # repetition_penalty 1e-310 once passed "finite and > 0", sent logits to +inf, and the
    # failing step ended every request in the batch.
    engine = HeldEngine(model)
    engine.hold(after_first_text=True)  # the stream is mid-flight when the bad request comes
    greedy = {"model": model.name, "prompt": "Steady", "max_tokens": 30, "temperature": 0,
              "ignore_eos": True}
    bad = {"model": model.name, "prompt": "ROMEO: ROMEO:", "repetition_penalty": 1e-310,
           "max_tokens": 4}
    with ServerThread(engine) as live, httpx.Client(base_url=live.url, timeout=60) as http, \
            ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json={**greedy, "stream": True}) as stream:
            lines = stream.iter_lines()
            events = [next(lines)]  # the first token's event: the engine is held from now on
            refused = pool.submit(http.post, "/v1/completions", json=bad)
            wait_until(lambda: refused.done() or in_engine(live.url) == 2)  # refused, or queued
            engine.resume()
            events += [line for line in lines if line]
        answer = refused.result()
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "repetition_penalty"
    assert events[-1] == "data: [DONE]"
    assert text_of(events) == offline(model, "Steady", max_tokens=30, temperature=0,
                                      ignore_eos=True)


@pytest.fixture(scope="module")
def corrupt(text_model_folder, tmp_path_factory):
    """The test model with one NaN embedding row: every sequence holding that token gets NaN
    logits, the others are untouched. Returns the model and a prompt that holds the token."""
    bad_token = tinyinfer.load(text_model_folder).tokenizer.encode("To be")[0]
    folder = nan_embedding_copy(text_model_folder, tmp_path_factory.mktemp("corrupt"), bad_token)
    return tinyinfer.load(folder), bad_token


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_row_of_invalid_logits_fails_its_request_alone(corrupt, sampled):
    model, bad_token = corrupt
    prompt = next(p for p in ("or", "not", "the", "sea", "arms")
                  if bad_token not in model.tokenizer.encode(p))
    settings = {"temperature": 0.7, "seed": 5} if sampled else {"temperature": 0}
    good = {"model": model.name, "prompt": prompt, "max_tokens": 20, "ignore_eos": True,
            **settings}
    broken = {**good, "prompt": "To be"}
    engine = HeldEngine(model)
    engine.hold()  # both join the same batch: the broken row's step is the survivor's step
    with server_log() as log, ServerThread(engine) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http, ThreadPoolExecutor(3) as pool:
        survivor = pool.submit(stream_events, http, good)
        failing = pool.submit(stream_events, http, broken)
        whole = pool.submit(http.post, "/v1/completions", json=broken)
        wait_until(lambda: in_engine(live.url) == 3)
        engine.resume()
        events, failed, answer = survivor.result(), failing.result(), whole.result()
        wait_until(lambda: in_engine(live.url) == 0)
        state = health(live.url)
        counted = httpx.get(f"{live.url}/metrics").text
    assert text_of(events) == offline(model, prompt, max_tokens=20, ignore_eos=True, **settings)
    assert failed[-1] == "data: [DONE]"
    assert json.loads(failed[-2][6:])["error"]["type"] == "server_error"
    assert answer.status_code == 500 and "NaN" in answer.json()["error"]["message"]
    assert state["status"] == "ok" and state["kv_pages_used"] == 0
    assert 'tinyinfer_sequences_finished_total{reason="error"} 2' in counted
    assert tracebacks(log) == []


class CountingEncode:
    """The tokenizer's encode, counting its calls and, once told to, waiting at a gate: the test
    then knows a request is being tokenized, and decides when that may end."""

    def __init__(self, encode) -> None:
        self.encode = encode
        self.calls = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(60), "the test never opened the gate"
        return self.encode(*args, **kwargs)


@pytest.fixture
def spied(text_model_folder):
    """A model of its own whose tokenizer's encode is a CountingEncode."""
    model = tinyinfer.load(text_model_folder)
    spy = CountingEncode(model.tokenizer.encode)
    model.tokenizer.encode = spy
    return model, spy


def test_more_sequences_than_the_server_holds_are_refused_before_tokenizing(spied):
    model, spy = spied
    with ServerThread(tinyinfer.Engine(model, max_num_seqs=4), ServerConfig(max_queue=16)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http:
        many = http.post("/v1/completions", json={"model": model.name, "prompt": ["x"] * 5000})
        times_n = http.post("/v1/completions", json={"model": model.name,
                                                     "prompt": ["a", "b", "c", "d", "e", "f"],
                                                     "n": 4})
        assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
        assert times_n.status_code == 400 and "24 sequences" in times_n.json()["error"]["message"]
        assert spy.calls == 0
        fine = http.post("/v1/completions", json={"model": model.name, "prompt": ["a", "b"],
                                                  "n": 2, "max_tokens": 2})
        assert fine.status_code == 200 and spy.calls == 2


def test_tokenizing_a_request_leaves_the_event_loop_free(spied):
    model, spy = spied
    spy.gate = threading.Event()
    with ServerThread(tinyinfer.Engine(model)) as live, \
            httpx.Client(base_url=live.url, timeout=60) as http, ThreadPoolExecutor(1) as pool:
        try:
            slow = pool.submit(http.post, "/v1/completions",
                               json={"model": model.name, "prompt": "Long text", "max_tokens": 2})
            assert spy.entered.wait(60)
            # The request is being tokenized right now; other clients are served meanwhile.
            assert httpx.get(f"{live.url}/health", timeout=20).json()["status"] == "ok"
            assert httpx.get(f"{live.url}/v1/models", timeout=20).status_code == 200
        finally:
            spy.gate.set()
        assert slow.result().status_code == 200
