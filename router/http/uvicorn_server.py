"""uvicorn serving an ASGI app on the event loop that is running (the router's own).

The socket is bound here, before uvicorn starts, so a port that is taken fails the router's
start with an OSError naming it (uvicorn would exit the process) and port 0 gives the port
that was picked; it has TCP_NODELAY, which its connections inherit (asyncio does not set it
on them here, and without it every response waited ~40 ms for the client's delayed ACK).
uvicorn installs no signal handlers: the router's owner (a Ray actor, a test, a benchmark)
decides when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp

from router.tls import TlsConfig
from vocabulary.waits import wait_within


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """One ASGI app on `host:port` (0: a free port) in the running loop; HTTPS with `tls`."""

    def __init__(
        self,
        app: ASGIApp,
        host: str,
        port: int,
        grace_s: float = 1.0,
        tls: TlsConfig | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self._config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, int(grace_s)),
            backlog=2048,
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Serve; returns the bound port once uvicorn accepts connections."""
        sock = _bind(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        self._server = _Server(self._config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"HTTP server on {self.host}:{self.port} stopped at start")
            await asyncio.sleep(0.005)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, give open requests `grace_s`, then cut them."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await wait_within(asyncio.shield(self._task), self.grace_s + 2)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server = None
        self._task = None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: a response goes out as uvicorn writes it (headers,
    # then each SSE event), not held back by Nagle until the client's delayed ACK (~40 ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind HTTP to {host}:{port}: {e.strerror or e}") from e
    sock.listen(2048)
    sock.setblocking(False)
    return sock
