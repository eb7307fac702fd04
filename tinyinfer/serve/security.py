"""Who may call the server: an API key checked before anything else, JSON-only request bodies,
and web pages from other sites only where the operator allowed their origin (CORS).

Browsers send a cross-site POST without asking first only when it is a "simple" request
(a text/plain or form body); the server refuses those (415), so a page on another site can
reach it only through a CORS preflight, which fails unless `--allowed-origins` names that site.
"""

from __future__ import annotations

import hmac
from typing import Collection

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tinyinfer.serve.schemas import APIError

PROBES = frozenset({"/health", "/metrics"})  # what load balancers and Prometheus read
JSON = "application/json"


def _bearer(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer <token>` header, if it has one."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class RequireAPIKey:
    """ASGI middleware: a request without the key gets OpenAI's 401 and reaches nothing else.

    The key is compared in constant time (hmac.compare_digest), so the time a refusal takes
    says nothing about how much of a guess was right.
    """

    def __init__(self, app: ASGIApp, key: str, open_paths: Collection[str] = ()) -> None:
        self.app = app
        self.key = key.encode("utf-8")
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is not None and hmac.compare_digest(token, self.key):
            await self.app(scope, receive, send)
            return
        if token is None:
            error = APIError(401, "You didn't provide an API key. Send it in an Authorization "
                                  "header using Bearer auth (Authorization: Bearer YOUR_KEY); "
                                  "with the openai client, pass api_key=...")
        else:
            error = APIError(401, "Incorrect API key provided. Use the key this server was "
                                  "started with (--api-key or TINYINFER_API_KEY).",
                             code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def check_json_body(content_type: str | None) -> None:
    """Refuse (415) a POST body that is not declared as JSON in UTF-8."""
    media, _, params = (content_type or "").partition(";")
    charset = ""
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
    if media.strip().lower() != JSON or charset not in ("", "utf-8", "utf8"):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise APIError(415, f"send the request body as JSON in UTF-8 with Content-Type: "
                            f"{JSON} (got {got})", code="unsupported_media_type")


def middleware(api_key: str | None, open_probes: bool,
               allowed_origins: Collection[str]) -> list[Middleware]:
    """CORS first (a preflight carries no key), then the key check; each only if configured."""
    stack = []
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                                allow_methods=["GET", "POST"],
                                allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        stack.append(Middleware(RequireAPIKey, key=api_key,
                                open_paths=PROBES if open_probes else ()))
    return stack
