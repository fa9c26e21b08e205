"""The embedded redis-server keeps its config (the AUTH password) and log in a private
directory for exactly as long as it runs."""

from __future__ import annotations

import stat
from pathlib import Path

import redis

from deploy.control.embedded_redis import EmbeddedRedis


def test_its_directory_is_private_while_it_runs_and_gone_when_it_stops() -> None:
    server = EmbeddedRedis()
    server.start()
    try:
        home = Path(server._dir)
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE((home / "redis.conf").stat().st_mode) == 0o600
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
    assert not home.exists()
    server.start()  # a restart (the outage tests do this) gets a fresh directory, same port
    try:
        assert Path(server._dir) != home and Path(server._dir).is_dir()
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
    assert not Path(server._dir).exists()
