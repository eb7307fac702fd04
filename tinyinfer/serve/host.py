"""Hosting the app: the listening socket (taken before a model loads), the uvicorn server that
keeps the shutdown promise, `serve` for the command line and `ServerThread` for tests and
notebooks."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette

from tinyinfer.engine import Engine
from tinyinfer.errors import TinyInferError
from tinyinfer.serve.loop import EngineLoop
from tinyinfer.serve.server import ServerConfig, create_app

# Past the grace period the app answers every in-flight request itself; uvicorn's own timeout,
# this much later, is only the backstop for a handler that would not end.
SHUTDOWN_BACKSTOP_S = 5.0


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, for the server to listen on: taken before a model
    loads, so a port in use is one clear error at once, not a failure after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = ("another program is listening there; stop it or pick another --port"
                if exc.errno == errno.EADDRINUSE else "check --host and --port")
        raise TinyInferError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from None
    return sock


class UvicornServer(uvicorn.Server):
    """uvicorn's server, keeping the shutdown promise of docs/serving.md: on Ctrl-C / SIGTERM it
    stops accepting connections, gives in-flight requests `grace` seconds, and then has the app
    end each one itself (a stream: an error event and [DONE]; a whole request: a JSON 503 with
    Retry-After) instead of letting uvicorn cancel their handlers."""

    def __init__(self, app: Starlette, grace: float, log_level: str = "info") -> None:
        super().__init__(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=grace + SHUTDOWN_BACKSTOP_S))
        self.engine_loop: EngineLoop = app.state.server.loop
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        expire = asyncio.get_running_loop().call_later(self.grace, self.engine_loop.expire)
        try:
            await super().shutdown(sockets)
        finally:
            expire.cancel()


def serve(engine: Engine, config: ServerConfig | None = None, sock: socket.socket | None = None,
          shutdown_timeout: float = 10.0, log_level: str = "info") -> None:
    """Serve on `sock` (default: a socket bound to 127.0.0.1:8000) until interrupted: Ctrl-C /
    SIGTERM let in-flight requests finish for shutdown_timeout seconds, then answer them 503."""
    sock = sock if sock is not None else listen("127.0.0.1", 8000)
    UvicornServer(create_app(engine, config), shutdown_timeout, log_level).run(sockets=[sock])


class ServerThread:
    """The server on a background thread (tests, notebooks): `with ServerThread(engine) as s`."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None,
                 host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0) -> None:
        self.app = create_app(engine, config)
        self.server = UvicornServer(self.app, shutdown_timeout, "warning")
        self._sock = listen(host, port)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="tinyinfer-http", daemon=True)

    @property
    def url(self) -> str:
        """Base URL with the port actually bound (port 0 picks a free one)."""
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TinyInferError("the server did not start; see the log above")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown, as on Ctrl-C; waits for the thread to end."""
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
