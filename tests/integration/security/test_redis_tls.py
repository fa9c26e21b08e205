"""`rediss://` URLs with a password reach Redis as given: the prefix index (router) and the
KV-event publisher (workers) talk to the embedded redis-server through a TLS terminator
started here (Debian's redis-server is built without TLS), verifying its certificate with
the CA named in the URL; a client that does not trust that CA gets no connection."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from certs import Certs, make_certs

from prefix_index.config import PrefixIndexConfig
from prefix_index.index import PrefixIndex
from prefix_index.publisher import KVEventPublisher
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.kv_events import CacheSnapshot, KVEvent, KVEventKind

pytestmark = pytest.mark.timeout(60)


class TlsTerminator:
    """TLS on a loopback port, plain TCP on to `upstream` (what stunnel would do)."""

    def __init__(self, certs: Certs, upstream: tuple[str, int]) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(str(certs.server.cert), str(certs.server.key))
        self.upstream = upstream
        self.loop = asyncio.new_event_loop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.context)
        )
        self._ready.set()
        self.loop.run_forever()
        server.close()

    def __enter__(self) -> TlsTerminator:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("redis-certs"))


@pytest.fixture
def rediss_url(redis_server: object, certs: Certs) -> Iterator[str]:
    server = redis_server
    with TlsTerminator(certs, (server.host, server.port)) as tls:  # type: ignore[attr-defined]
        password = server.password  # type: ignore[attr-defined]
        yield f"rediss://:{password}@127.0.0.1:{tls.port}/0?ssl_ca_certs={certs.ca}"


def test_index_and_publisher_work_over_rediss_with_a_password(rediss_url: str) -> None:
    hashes = hash_chain(list(range(64)), 16, hash_extra("tls-model"))
    config = PrefixIndexConfig(heartbeat_interval_s=0.1, socket_timeout_s=2.0,
                               connect_timeout_s=2.0)  # fmt: skip
    cached: list[KVEvent] = [KVEvent(0, KVEventKind.STORED, tuple(hashes))]
    snapshot = CacheSnapshot(0, tuple(hashes))
    publisher = KVEventPublisher(rediss_url, "tls-model", "w1", lambda: snapshot, config)
    index = PrefixIndex(rediss_url, "tls-model", config)
    try:
        publisher.start()
        publisher.publish(cached)
        deadline = time.monotonic() + 10
        match = index.lookup(hashes)
        while not match.workers and time.monotonic() < deadline:
            time.sleep(0.05)
            match = index.lookup(hashes)
        assert match.available
        assert [(w.worker_id, w.num_blocks) for w in match.workers] == [("w1", 4)]
    finally:
        publisher.close()
        index.close()


def test_a_client_that_does_not_trust_the_ca_gets_no_connection(
    rediss_url: str, tmp_path: Path
) -> None:
    untrusted = rediss_url.split("?")[0]  # the system CAs only
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(untrusted, socket_timeout=5).ping()
    assert redis.Redis.from_url(rediss_url, socket_timeout=5).ping()
