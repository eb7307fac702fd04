"""Who may call the server: the API key, JSON-only bodies (no browser "simple" cross-site POST),
CORS off unless origins are allowed, and a port in use reported before the model loads."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import httpx
import openai
import pytest

import tinyinfer
from tinyinfer.cli import serve as cli_serve
from tinyinfer.serve.host import ServerThread
from tinyinfer.serve.server import ServerConfig

KEY = "sk-test-0123456789"
EVIL = "https://evil.example"
APP = "https://app.example"


@pytest.fixture(scope="module")
def model(text_model_folder):
    return tinyinfer.load(text_model_folder)


@pytest.fixture(scope="module")
def keyed(model):
    """A server that asks for KEY, with /health and /metrics left open, and one allowed origin."""
    config = ServerConfig(api_key=KEY, open_probes=True, allowed_origins=(APP,))
    with ServerThread(tinyinfer.Engine(model), config) as live:
        yield live


@pytest.fixture(scope="module")
def plain(model):
    """A server as it starts by default: no key, no allowed origin."""
    with ServerThread(tinyinfer.Engine(model)) as live:
        yield live


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def body(model, **extra) -> dict:
    return {"model": model.name, "prompt": "Key", "max_tokens": 2, **extra}


# ----------------------------------------------------------------- API key


def test_requests_without_the_key_get_openai_401(keyed, model):
    url = f"{keyed.url}/v1/completions"
    missing = httpx.post(url, json=body(model))
    assert "API key" in error_of(missing, 401)["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(url, json=body(model), headers={"Authorization": "Bearer sk-test-01234"})
    assert error_of(wrong, 401)["code"] == "invalid_api_key" and KEY not in wrong.text
    other_scheme = httpx.post(url, json=body(model), headers={"Authorization": f"Basic {KEY}"})
    error_of(other_scheme, 401)
    for path in ("/v1/models", "/openapi.json", "/v1/nothing"):
        error_of(httpx.get(f"{keyed.url}{path}"), 401)


def test_the_key_opens_every_endpoint_to_the_openai_client(keyed, model):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(**body(model)).usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == [model.name]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong",
                      max_retries=0).models.list()


def test_probes_can_stay_open(keyed, model):
    assert httpx.get(f"{keyed.url}/health").json()["status"] == "ok"
    assert "tinyinfer_requests_total" in httpx.get(f"{keyed.url}/metrics").text
    with ServerThread(tinyinfer.Engine(model), ServerConfig(api_key=KEY)) as closed:
        error_of(httpx.get(f"{closed.url}/health"), 401)
        error_of(httpx.get(f"{closed.url}/metrics"), 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{closed.url}/health", headers=auth).status_code == 200


def parse_serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch, text_model_folder):
    monkeypatch.delenv("TINYINFER_API_KEY", raising=False)
    assert parse_serve().api_key is None
    monkeypatch.setenv("TINYINFER_API_KEY", "from-env")
    assert parse_serve().api_key == "from-env"
    assert parse_serve("--api-key", "from-flag").api_key == "from-flag"
    monkeypatch.setenv("TINYINFER_API_KEY", " ")
    with pytest.raises(tinyinfer.TinyInferError, match="empty"):
        cli_serve.run(parse_serve("--model", str(text_model_folder)))
    monkeypatch.delenv("TINYINFER_API_KEY")
    with pytest.raises(tinyinfer.TinyInferError, match="needs --api-key"):
        cli_serve.run(parse_serve("--model", str(text_model_folder), "--open-health-metrics"))


# ----------------------------------------------------------------- bodies and browsers


@pytest.mark.parametrize("content_type,data", [
    ("text/plain", None),  # what a browser sends cross-site without asking first
    ("application/x-www-form-urlencoded", None),
    (None, None),
    ("application/json; charset=utf-16", "utf-16"),
    ("application/jsonx", None),
])
def test_only_json_bodies_are_read(plain, model, content_type, data):
    raw = json.dumps(body(model)).encode(data or "utf-8")
    headers = {"Origin": EVIL, **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(f"{plain.url}/v1/completions", content=raw, headers=headers)
    assert error_of(response, 415)["code"] == "unsupported_media_type"
    assert "access-control-allow-origin" not in response.headers


def test_json_must_be_utf8(plain, model):
    url = f"{plain.url}/v1/completions"
    utf16 = httpx.post(url, content=json.dumps(body(model)).encode("utf-16"),
                       headers={"Content-Type": "application/json"})
    assert "UTF-8" in error_of(utf16, 400)["message"]
    fine = httpx.post(url, content=json.dumps(body(model)).encode(),
                      headers={"Content-Type": "Application/JSON; charset=UTF-8"})
    assert fine.status_code == 200


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_is_off_by_default(plain, model):
    assert "access-control-allow-origin" not in preflight(plain.url, EVIL).headers
    response = httpx.post(f"{plain.url}/v1/completions", json=body(model), headers={"Origin": EVIL})
    assert response.status_code == 200  # not a browser: nothing stops it, and nothing invites
    assert "access-control-allow-origin" not in response.headers


def test_allowed_origins_pass_the_preflight_and_others_do_not(keyed, model):
    allowed = preflight(keyed.url, APP)  # a preflight carries no key, and needs none
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == APP
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight(keyed.url, EVIL)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    answer = httpx.post(f"{keyed.url}/v1/completions", json=body(model),
                        headers={"Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP


# ----------------------------------------------------------------- the port


def test_a_port_in_use_is_one_clear_line_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model that does not exist: were it loaded first, that would be the error.
        done = subprocess.run([sys.executable, "-m", "tinyinfer", "serve", "--model", "no-such-model",
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
