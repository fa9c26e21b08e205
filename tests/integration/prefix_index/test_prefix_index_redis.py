"""The Redis prefix index and KV-event publisher against a real redis-server."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis

from prefix_index.config import PrefixIndexConfig
from prefix_index.index import PrefixIndex
from prefix_index.publisher import KVEventPublisher
from prefix_index.types import WorkerPrefix
from vocabulary.block_hash import BlockHash, hash_chain, hash_extra
from vocabulary.kv_events import CacheSnapshot, KVEvent, KVEventKind

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
FAST = PrefixIndexConfig(liveness_ttl_s=0.6, heartbeat_interval_s=0.1, retry_after_s=0.3)


def chain(tokens: Sequence[int]) -> list[BlockHash]:
    return hash_chain(tokens, BLOCK, hash_extra("test-model"))


# Two prompts sharing their first 3 blocks, then diverging.
PROMPT_A = list(range(16 * 8))
PROMPT_B = PROMPT_A[: 16 * 3] + [7] * (16 * 5)
A, B = chain(PROMPT_A), chain(PROMPT_B)


class FakeWorkerCache:
    """A worker's cached hashes (device tier, host tier) with the engine's event numbering
    (seq from 0, +1 each)."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.host: set[BlockHash] = set()
        self.last_seq = -1

    def store(self, hashes: Sequence[BlockHash]) -> KVEvent:
        self.hashes.update(hashes)
        self.host.difference_update(hashes)
        return self._event(KVEventKind.STORED, hashes)

    def offload(self, hashes: Sequence[BlockHash]) -> KVEvent:
        self.hashes.difference_update(hashes)
        self.host.update(hashes)
        return self._event(KVEventKind.OFFLOADED, hashes)

    def remove(self, hashes: Sequence[BlockHash]) -> KVEvent:
        self.hashes.difference_update(hashes)
        self.host.difference_update(hashes)
        return self._event(KVEventKind.REMOVED, hashes)

    def _event(self, kind: KVEventKind, hashes: Sequence[BlockHash]) -> KVEvent:
        self.last_seq += 1
        return KVEvent(self.last_seq, kind, tuple(hashes))

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(self.last_seq, tuple(sorted(self.hashes)), tuple(sorted(self.host)))


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture()
def model_id() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


@pytest.fixture()
def publishers(redis_url: str, model_id: str) -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def make(worker_id: str, cache: FakeWorkerCache, url: str = redis_url) -> KVEventPublisher:
        p = KVEventPublisher(url, model_id, worker_id, cache.snapshot, FAST)
        p.start()
        made.append(p)
        return p

    yield make
    for p in made:
        p.close(deregister=False)


def test_lookup_returns_longest_prefix_per_live_worker_on_branching_prompts(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    w1, w2, w3 = FakeWorkerCache(), FakeWorkerCache(), FakeWorkerCache()
    p1, p2, p3 = publishers("w1", w1), publishers("w2", w2), publishers("w3", w3)
    p1.publish([w1.store(A[:6])])
    p2.publish([w2.store(A[:3]), w2.store(B[3:5])])
    p3.publish([w3.store(A[1:4])])  # no first block: no prefix at all
    index = PrefixIndex(redis_url, model_id, FAST)
    wait_until(lambda: (p1.applied_seq, p2.applied_seq, p3.applied_seq) == (0, 1, 0))

    assert index.lookup(A).workers == (WorkerPrefix("w1", 6), WorkerPrefix("w2", 3))
    assert index.lookup(B).workers == (WorkerPrefix("w2", 5), WorkerPrefix("w1", 3))
    assert index.lookup(A[:2]).workers == (WorkerPrefix("w1", 2), WorkerPrefix("w2", 2))
    assert index.lookup(chain([9] * 64)).workers == ()
    match = index.lookup(A)
    assert match.available and match.chain_length == 8
    assert match.best() == WorkerPrefix("w1", 6) and match.blocks_cached("w3") == 0

    p1.publish([w1.remove(A[2:3])])  # a hole at block 2 ends w1's prefix there
    wait_until(lambda: p1.applied_seq == 1)
    assert index.lookup(A).workers == (WorkerPrefix("w2", 3), WorkerPrefix("w1", 2))


def test_lookup_counts_host_tier_blocks_and_a_resync_keeps_the_tiers(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    w1, w2 = FakeWorkerCache(), FakeWorkerCache()
    p1, p2 = publishers("w1", w1), publishers("w2", w2)
    p1.publish([w1.store(A[:6]), w1.offload(A[4:6])])  # blocks 4, 5 left the device pool
    p2.publish([w2.store(A[:3]), w2.offload(A[:3]), w2.store(A[:1])])  # block 0 onboarded
    index = PrefixIndex(redis_url, model_id, FAST)
    wait_until(lambda: (p1.applied_seq, p2.applied_seq) == (1, 2))
    expected = (WorkerPrefix("w1", 6, 2), WorkerPrefix("w2", 3, 2))
    assert index.lookup(A).workers == expected
    assert index.lookup(A).host_blocks("w1") == 2 and index.lookup(A[:4]).host_blocks("w1") == 0

    p1.publish([w1.remove(A[5:6])])  # the host LRU let block 5 go: held nowhere
    wait_until(lambda: p1.applied_seq == 2)
    assert index.lookup(A).workers[0] == WorkerPrefix("w1", 5, 1)

    r = redis.Redis.from_url(redis_url)
    r.delete(f"pdserve:{model_id}:seq:w1")  # Redis lost w1's state: the heartbeat resyncs it
    wait_until(lambda: p1.stats().num_resyncs >= 2)
    wait_until(lambda: index.lookup(A).workers[0] == WorkerPrefix("w1", 5, 1))
    p1.publish([w1.remove(A[:6])])
    wait_until(lambda: p1.applied_seq == 3)
    assert index.lookup(A).workers == (WorkerPrefix("w2", 3, 2),)
    assert r.smembers(f"pdserve:{model_id}:whblk:w1") == set()


def test_dead_worker_is_ignored_at_lookup_and_purged(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    alive, dying = FakeWorkerCache(), FakeWorkerCache()
    p_alive, p_dying = publishers("alive", alive), publishers("dying", dying)
    p_alive.publish([alive.store(A[:2])])
    p_dying.publish([dying.store(A[:5])])
    index = PrefixIndex(redis_url, model_id, FAST)
    wait_until(lambda: p_alive.applied_seq == 0 and p_dying.applied_seq == 0)
    assert index.lookup(A).workers == (WorkerPrefix("dying", 5), WorkerPrefix("alive", 2))

    p_dying.close(deregister=False)  # crash: no goodbye, its liveness key just expires
    wait_until(lambda: index.live_workers() == ("alive",), timeout_s=3.0)
    assert index.lookup(A).workers == (WorkerPrefix("alive", 2),)

    assert index.purge_worker("dying") is True  # the controller removed it
    r = redis.Redis.from_url(redis_url)
    leftovers = [k for k in r.scan_iter(f"pdserve:{model_id}:*") if b"dying" in k]
    members = {m for h in A[:5] for m in r.smembers(f"pdserve:{model_id}:blk:{h.hex()}")}
    assert leftovers == [] and members == {b"alive"}
    assert index.purge_worker("dying") is False


def test_replayed_events_after_a_lost_reply_are_idempotent(
    redis_url: str, model_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = FakeWorkerCache()
    p = KVEventPublisher(redis_url, model_id, "w", w.snapshot, FAST)  # no thread: flush by hand
    p.flush_now()  # first contact: resync from the (empty) snapshot
    p.publish([w.store(A[:4]), w.remove(A[3:4])])
    real_pipeline = p._redis.pipeline

    def lossy_pipeline(*args: object, **kwargs: object) -> object:
        pipe = real_pipeline(*args, **kwargs)
        execute = pipe.execute

        def execute_then_lose_reply(raise_on_error: bool = True) -> list[object]:
            execute()
            raise redis.ConnectionError("reply lost")

        pipe.execute = execute_then_lose_reply  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(p._redis, "pipeline", lossy_pipeline)
    with pytest.raises(redis.ConnectionError):
        p.flush_now()  # Redis applied seq 0..1, the publisher does not know
    monkeypatch.undo()
    assert p.applied_seq == -1
    p.flush_now()  # the same batch again: skipped by sequence number
    assert p.applied_seq == 1 and p.num_resyncs == 1
    index = PrefixIndex(redis_url, model_id, FAST)
    assert index.lookup(A).workers == (WorkerPrefix("w", 3),)
    r = redis.Redis.from_url(redis_url)
    assert r.scard(f"pdserve:{model_id}:wblk:w") == 3
    p.close()


def test_event_gap_triggers_snapshot_resync(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    w = FakeWorkerCache()
    p = publishers("w", w)
    p.publish([w.store(A[:2])])
    wait_until(lambda: p.applied_seq == 0)
    resyncs = p.num_resyncs
    w.store(A[2:6])  # seq 1 is lost on the way (never published) ...
    p.publish([w.store(A[6:8])])  # ... so seq 2 follows 0: gap → resync from the snapshot
    wait_until(lambda: p.num_resyncs == resyncs + 1 and p.applied_seq == 2)
    index = PrefixIndex(redis_url, model_id, FAST)
    assert index.lookup(A).workers == (WorkerPrefix("w", 8),)


def test_publisher_resyncs_after_redis_restart(
    redis_server: object, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    url = redis_server.url  # type: ignore[attr-defined]
    w = FakeWorkerCache()
    p = publishers("w", w, url)
    p.publish([w.store(A[:5])])
    wait_until(lambda: p.applied_seq == 0)
    index = PrefixIndex(url, model_id, FAST)
    assert index.lookup(A).workers == (WorkerPrefix("w", 5),)

    redis_server.stop()  # type: ignore[attr-defined]
    t0 = time.monotonic()
    down = index.lookup(A)
    assert not down.available and down.workers == ()
    assert time.monotonic() - t0 < 0.5
    p.publish([w.store(A[5:7])])  # queued while Redis is down; publish never blocks

    redis_server.start()  # type: ignore[attr-defined]  # same port, empty
    time.sleep(FAST.retry_after_s)
    wait_until(lambda: index.lookup(A).workers == (WorkerPrefix("w", 7),), timeout_s=10.0)
    assert p.num_resyncs >= 2


def test_lookup_with_redis_unreachable_returns_unavailable_fast() -> None:
    index = PrefixIndex("redis://127.0.0.1:1/0", "m", FAST)
    t0 = time.monotonic()
    first = index.lookup(A)
    first_s = time.monotonic() - t0
    t1 = time.monotonic()
    second = index.lookup(A)
    second_s = time.monotonic() - t1
    assert not first.available and not second.available and first.workers == ()
    assert first_s < 0.3 and second_s < 0.01
    assert index.num_unavailable == 2
    cache = FakeWorkerCache()
    p = KVEventPublisher("redis://127.0.0.1:1/0", "m", "w", cache.snapshot, FAST)
    p.start()
    t2 = time.monotonic()
    p.publish([cache.store(A[:3])])
    assert time.monotonic() - t2 < 0.01
    p.close(deregister=True)


def traces_of(redis_url: str, model_id: str, worker_id: str) -> list[str]:
    """Every key or set membership the index still holds for `worker_id`."""
    r = redis.Redis.from_url(redis_url)
    root, w = f"pdserve:{model_id}:", worker_id.encode()
    keys = (f"worker:{worker_id}", f"wblk:{worker_id}", f"seq:{worker_id}")
    found = [k for k in keys if r.exists(root + k)]
    if r.sismember(root + "workers", w):
        found.append("workers")
    found += [k.decode() for k in r.scan_iter(root + "blk:*") if r.sismember(k, w)]
    return found


def test_publisher_thread_survives_a_raising_snapshot_and_counts_it(
    redis_url: str, model_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = FakeWorkerCache()
    failures = [RuntimeError("snapshot broke"), RuntimeError("snapshot broke")]

    def flaky_snapshot() -> CacheSnapshot:
        if failures:
            raise failures.pop()
        return w.snapshot()

    p = KVEventPublisher(redis_url, model_id, "w", flaky_snapshot, FAST)
    p.start()
    try:
        p.publish([w.store(A[:3])])
        index = PrefixIndex(redis_url, model_id, FAST)
        wait_until(lambda: index.lookup(A).workers == (WorkerPrefix("w", 3),))
        p.publish([w.store(A[3:6])])  # later events keep landing
        wait_until(lambda: index.lookup(A).workers == (WorkerPrefix("w", 6),))
        # Redis holds the write before the publisher counts it: wait for its own confirmation
        wait_until(lambda: p.stats().applied_seq == 1 and p.stats().connected)
        stats = p.stats()
        assert stats.running and stats.connected and stats.applied_seq == 1
        assert (stats.num_errors, stats.last_error) == (2, "RuntimeError: snapshot broke")
        failed = [
            r
            for r in caplog.records
            if r.name == "prefix_index.publisher" and "fail" in r.getMessage()
        ]
        assert [r.exc_info is not None for r in failed] == [True, False]  # one traceback per kind
    finally:
        p.close()


class Unhexable(bytes):
    """A value in place of a block hash that the publisher cannot encode (a malformed event)."""

    def hex(self, *args: object) -> str:  # type: ignore[override]
        raise TypeError("not a block hash")


def test_publisher_resyncs_past_a_malformed_event_and_serves_later_ones(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    w = FakeWorkerCache()
    p = publishers("w", w)
    p.publish([w.store(A[:2])])
    wait_until(lambda: p.applied_seq == 0)
    resyncs = p.num_resyncs
    good = w.store(A[2:4])  # the cache holds these; the event on the wire is broken
    p.publish([KVEvent(good.seq, good.kind, (BlockHash(Unhexable(b"x" * 16)),))])
    p.publish([w.store(A[4:6])])
    index = PrefixIndex(redis_url, model_id, FAST)
    wait_until(lambda: index.lookup(A).workers == (WorkerPrefix("w", 6),))
    # Redis holds the resync before the publisher counts it: wait for its own confirmation
    wait_until(lambda: p.stats().applied_seq == 2)
    stats = p.stats()
    assert stats.running and stats.num_resyncs == resyncs + 1 and stats.applied_seq == 2
    assert (stats.num_errors, stats.last_error) == (1, "TypeError: not a block hash")


def test_purge_worker_removes_one_named_worker_even_while_its_liveness_lasts(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    gone, kept = FakeWorkerCache(), FakeWorkerCache()
    p_gone, p_kept = publishers("gone", gone), publishers("kept", kept)
    p_gone.publish([gone.store(A[:5])])
    p_kept.publish([kept.store(A[:2])])
    wait_until(lambda: p_gone.applied_seq == 0 and p_kept.applied_seq == 0)
    p_gone.close(deregister=False)  # removed by the controller; its liveness key still lasts
    index = PrefixIndex(redis_url, model_id, FAST)
    assert index.purge_worker("gone") is True
    assert index.lookup(A).workers == (WorkerPrefix("kept", 2),)
    assert traces_of(redis_url, model_id, "gone") == []
    assert len(traces_of(redis_url, model_id, "kept")) == 6  # 3 keys, the set, 2 blocks
    assert index.purge_worker("gone") is False and index.purge_worker("nobody") is False

    assert index.purge_worker("kept") is True  # still publishing: back after a resync
    wait_until(lambda: index.lookup(A).workers == (WorkerPrefix("kept", 2),))


def test_purge_workers_except_keeps_only_the_given_workers(
    redis_url: str, model_id: str, publishers: Callable[..., KVEventPublisher]
) -> None:
    caches = {w: FakeWorkerCache() for w in ("a", "b", "c")}
    pubs = {w: publishers(w, c) for w, c in caches.items()}
    for n, (w, c) in enumerate(caches.items(), start=2):
        pubs[w].publish([c.store(A[:n])])
    wait_until(lambda: all(p.applied_seq == 0 for p in pubs.values()))
    pubs["b"].close(deregister=False)  # an earlier cluster's workers, liveness keys still alive
    pubs["c"].close(deregister=False)
    index = PrefixIndex(redis_url, model_id, FAST)

    assert index.purge_workers_except({"a"}) == ("b", "c")
    assert index.lookup(A).workers == (WorkerPrefix("a", 2),)
    assert traces_of(redis_url, model_id, "b") == traces_of(redis_url, model_id, "c") == []
    assert index.live_workers() == ("a",)
    assert index.purge_workers_except(["a"]) == ()
