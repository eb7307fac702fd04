"""The OpenAI-compatible server on loopback, driven by the official openai client.

One real server (uvicorn in a background thread) serves a small random Llama with a trained
BPE tokenizer; every answer is checked against the offline engine run on the same prompt.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tinyinfer
from tests.held import HeldEngine, server_log, tracebacks
from tinyinfer.serve.host import ServerThread
from tinyinfer.serve.server import ServerConfig

MAX_NUM_SEQS = 8
SHARED_PROMPT = ("Or to take arms against a sea of troubles, and by opposing end them. "
                 "To die, to sleep, no more; and by a sleep to say we end the heartache")


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


@pytest.fixture(scope="module")
def server(model):
    engine = tinyinfer.Engine(model, max_num_seqs=MAX_NUM_SEQS, detail="none")  # as `serve`
    with ServerThread(engine, ServerConfig(max_queue=64)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def offline(model, prompt, **params) -> tinyinfer.Completion:
    """The same request run by a fresh engine in this process: what the server must return."""
    return tinyinfer.Engine(model).generate(prompt, tinyinfer.SamplingParams(**params))[0]


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def wait_until_idle(server, timeout: float = 10.0) -> dict:
    """Poll /health until nothing runs, waits or holds a page (aborts reach the engine async)."""
    deadline = time.monotonic() + timeout
    while True:
        state = health(server)
        idle = state["running"] == 0 and state["waiting"] == 0 and state["kv_pages_used"] == 0
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed by the Prometheus client's own parser."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_models_lists_the_served_model(client, model):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [model.name]
    assert client.models.retrieve(model.name).id == model.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_equals_offline_greedy(client, model):
    expected = offline(model, "To be, or not", max_tokens=20, temperature=0)
    out = client.completions.create(model=model.name, prompt="To be, or not", max_tokens=20,
                                    temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(expected.prompt_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == len(expected.prompt_ids) + len(expected.token_ids)


def test_streamed_completion_equals_offline_greedy(client, model):
    expected = offline(model, "Whether 'tis nobler", max_tokens=24, temperature=0)
    stream = client.completions.create(model=model.name, prompt="Whether 'tis nobler",
                                       max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_token_id_prompt_equals_text_prompt(client, model):
    ids = model.tokenizer.encode("The slings and arrows")
    by_ids = client.completions.create(model=model.name, prompt=ids, max_tokens=12, temperature=0)
    by_text = client.completions.create(model=model.name, prompt="The slings and arrows",
                                        max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_uses_the_simple_template_and_equals_offline_greedy(client, model):
    messages = [{"role": "system", "content": "Speak plainly."},
                {"role": "user", "content": "To be, or not to be?"}]
    prompt = "system: Speak plainly.\nuser: To be, or not to be?\nassistant:"
    expected = offline(model, prompt, max_tokens=16, temperature=0, stop=("\nuser:",))
    out = client.chat.completions.create(model=model.name, messages=messages, max_tokens=16,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
    stream = client.chat.completions.create(model=model.name, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_without_max_tokens_may_fill_the_context(client, model):
    out = client.chat.completions.create(model=model.name, temperature=0,
                                         messages=[{"role": "user", "content": "Speak."}])
    used = out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.choices[0].finish_reason == "stop" or used == model.config.max_model_len


def test_seeded_n_choices_equal_offline_samples_with_derived_seeds(client, model):
    out = client.completions.create(model=model.name, prompt="No more", max_tokens=10,
                                    temperature=1.0, seed=11, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for j, choice in enumerate(out.choices):
        assert choice.text == offline(model, "No more", max_tokens=10, temperature=1.0,
                                      seed=11 + j).text
    assert out.usage.prompt_tokens == len(model.tokenizer.encode("No more"))  # counted once
    assert out.usage.completion_tokens == sum(
        len(offline(model, "No more", max_tokens=10, temperature=1.0, seed=11 + j).token_ids)
        for j in range(3))


def test_n_choices_of_a_long_prompt_share_its_cached_pages(server, client, model):
    prompt = SHARED_PROMPT
    pages = len(model.tokenizer.encode(prompt)) // 16
    assert pages >= 2
    before = health(server)["prefix_hit_tokens"]
    out = client.completions.create(model=model.name, prompt=prompt, max_tokens=8,
                                    temperature=0, n=3)
    expected = offline(model, prompt, max_tokens=8, temperature=0).text
    assert [c.text for c in out.choices] == [expected] * 3
    # Choices 1 and 2 were admitted after choice 0 computed the prompt, so they found its
    # full pages (all but possibly the one holding the last prompt token) in the cache.
    assert health(server)["prefix_hit_tokens"] - before >= 2 * 16 * (pages - 1)


def test_several_prompts_give_choices_prompt_by_prompt(client, model):
    prompts = ["To die", "to sleep"]
    out = client.completions.create(model=model.name, prompt=prompts, max_tokens=6, temperature=0,
                                    n=2)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    expected = [offline(model, p, max_tokens=6, temperature=0).text for p in prompts]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]


def test_completion_logprobs_are_the_engines(client, model):
    expected = offline(model, "Or to take arms", max_tokens=8, temperature=0, logprobs=3)
    out = client.completions.create(model=model.name, prompt="Or to take arms", max_tokens=8,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert lp.tokens == [model.tokenizer.token_bytes(t).decode("utf-8", "replace")
                         for t in expected.token_ids]
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_chat_logprobs_carry_bytes_and_alternatives(client, model):
    out = client.chat.completions.create(model=model.name, max_tokens=5, temperature=0,
                                         messages=[{"role": "user", "content": "Speak."}],
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the best
        assert bytes(token.bytes).decode("utf-8", "replace") == token.token


def test_stop_string_cuts_the_text(client, model):
    full = offline(model, "The slings", max_tokens=40, temperature=0).text
    stop = full[8:10]
    cut = full[: full.find(stop)]
    out = client.completions.create(model=model.name, prompt="The slings", max_tokens=40,
                                    temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model=model.name, prompt="The slings", max_tokens=40,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_32_concurrent_streams_each_get_their_own_tokens(server, model):
    prompts = [f"{word} {i}" for i, word in enumerate(["To be", "or not", "the question"] * 11)][:32]
    lengths = [6 + (i % 5) * 4 for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
        stream = await client.completions.create(model=model.name, prompt=prompt, stream=True,
                                                 max_tokens=max_tokens, temperature=0)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_clients() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    before = health(server)["steps"]
    texts = asyncio.run(all_clients())
    for prompt, n, text in zip(prompts, lengths, texts):
        assert text == offline(model, prompt, max_tokens=n, temperature=0).text, prompt
    state = health(server)  # read at once: the engine publishes its state before the last token
    assert (state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0)
    # Batched: far fewer steps than the 32 requests' tokens one by one.
    assert state["steps"] - before < sum(lengths)


def test_disconnecting_streams_free_pages_and_others_keep_streaming(server, model):
    expected = offline(model, "Survivor", max_tokens=60, temperature=0).text
    long_request = {"model": model.name, "prompt": "Dropout", "max_tokens": 240,
                    "ignore_eos": True, "temperature": 0, "stream": True}
    aborts_before = metrics(server).get("tinyinfer_request_aborts_total{reason=disconnect}", 0)

    async def drop(http: httpx.AsyncClient) -> int:
        async with http.stream("POST", "/v1/completions", json=long_request) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    return seen  # leaving the block closes the connection mid-stream
        return seen

    async def survive(client: openai.AsyncOpenAI) -> str:
        stream = await client.completions.create(model=model.name, prompt="Survivor", stream=True,
                                                 max_tokens=60, temperature=0)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> tuple[list[int], str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, \
                openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=60) as client:
            survivor = asyncio.ensure_future(survive(client))
            dropped = await asyncio.gather(*(drop(http) for _ in range(4)))
            return dropped, await survivor

    dropped, text = asyncio.run(run())
    assert dropped == [3, 3, 3, 3]
    assert text == expected
    state = wait_until_idle(server)
    assert (state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0)
    after = metrics(server)
    assert after["tinyinfer_request_aborts_total{reason=disconnect}"] - aborts_before == 4
    assert after["tinyinfer_sequences_finished_total{reason=abort}"] >= 4


def test_disconnecting_before_a_whole_answer_frees_pages_and_counts_499(model):
    engine = HeldEngine(model)
    engine.hold(after_first_text=True)  # the answer cannot be whole before the client leaves
    with server_log() as log, ServerThread(engine) as live:
        body = {"model": model.name, "prompt": "Impatient", "max_tokens": 240, "ignore_eos": True}
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{live.url}/v1/completions", json=body,
                           timeout=httpx.Timeout(10, read=0.2))
        state = wait_until_idle(live)
        assert (state["running"], state["kv_pages_used"]) == (0, 0)
        counted = metrics(live)
        assert counted["tinyinfer_request_aborts_total{reason=disconnect}"] == 3
        assert counted["tinyinfer_requests_total{endpoint=/v1/completions,status=499}"] == 3
        assert "tinyinfer_requests_total{endpoint=/v1/completions,status=500}" not in counted
    assert tracebacks(log) == []


def test_metrics_count_requests_tokens_and_latencies(server, client, model):
    before = metrics(server)
    out = client.completions.create(model=model.name, prompt="Count me", max_tokens=7,
                                    temperature=0, extra_body={"ignore_eos": True})  # vLLM's field
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert out.usage.completion_tokens == 7
    assert grew("tinyinfer_requests_total{endpoint=/v1/completions,status=200}") == 1
    assert grew("tinyinfer_generation_tokens_total") == 7
    assert grew("tinyinfer_prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("tinyinfer_time_to_first_token_seconds_count") == 1
    assert grew("tinyinfer_time_per_output_token_seconds_count") == 1
    assert grew("tinyinfer_sequences_finished_total{reason=length}") == 1
    assert after["tinyinfer_kv_pages_used"] == 0
    assert after["tinyinfer_kv_pages_total"] == health(server)["kv_pages_total"] > 0
    assert 0 <= after["tinyinfer_prefix_cache_hit_rate"] <= 1
    for gauge in ("tinyinfer_num_requests_running", "tinyinfer_num_requests_waiting"):
        assert after[gauge] == 0


def test_repeated_prompt_hits_the_prefix_cache(server, client, model):
    prompt = "To be, or not to be, that is the question: whether 'tis nobler in the mind"
    client.completions.create(model=model.name, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model.name, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full page
    assert metrics(server)["tinyinfer_prefix_cache_hit_tokens_total"] >= 16


def test_raw_sse_framing(server, model):
    body = {"model": model.name, "prompt": "Frame", "max_tokens": 3, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
