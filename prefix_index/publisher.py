"""Publish a worker's KV events (blocks stored / removed / cleared) into the prefix index.

`publish(events)` never blocks: it appends to a queue that a background thread drains. Each
flush is one pipelined round trip: the liveness heartbeat (when due) and the batched events,
applied by a Lua script that is idempotent through the worker's sequence number:

- an event with `seq <= seq:{id}` was applied already and is skipped (retries are safe);
- an event with `seq > seq:{id} + 1` is a gap: the script stops and answers `gap`;
- a missing `seq:{id}` (Redis restarted or was flushed; a new worker) answers nil;
both make the publisher resync.

Tiers (vocabulary/kv_events.py): STORED puts a hash in the worker's device tier, OFFLOADED in its
host tier (it stays a holder in `blk:`, and is also listed in `hblk:`), REMOVED takes it out
of both. A resync replaces everything Redis holds for the worker with `snapshot()` (called on
the publisher thread; it must be thread-safe and quick) in one MULTI/EXEC: the worker's
entries are removed, the snapshot's hashes added by tier and `seq:{id}` set to the
snapshot's sequence number. Queued events up to that number are dropped, later ones applied
after it. The publisher resyncs when it starts, on a gap, when the heartbeat finds `seq:{id}`
missing or behind (Redis restarted), and after too many events piled up while Redis was down.
While
Redis is down it retries with capped exponential backoff; the worker never waits on it.

The thread outlives every failure, not only Redis errors: an exception from `snapshot()`, a
malformed event or a bug here fails that round, is counted (`stats()`: `num_errors`,
`last_error`), is logged with its traceback the first time its kind (exception type) shows up
and in one line after that, and is retried after the same backoff with a resync first (what
reached Redis is unknown; the snapshot also drops a malformed event it covers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import redis

from prefix_index.config import PrefixIndexConfig
from prefix_index.index import IndexKeys, connect
from vocabulary.kv_events import CacheSnapshot, KVEvent, KVEventKind, PublisherStats

log = logging.getLogger(__name__)

Snapshot = Callable[[], CacheSnapshot]
"""Returns every hash held by tier, as of the sequence number of the last event reflected."""

_HEARTBEAT = """
redis.call('SET', KEYS[1], '1', 'PX', ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
local s = redis.call('GET', KEYS[2])
if not s then return false end
return tonumber(s)
"""

# KEYS: seq, device+host reverse index, host reverse index. ARGV: worker, block and host-block
# key prefixes, then per event: seq, kind (s stored, o offloaded, r removed, c cleared), n, hashes.
_APPLY = """
local cur = redis.call('GET', KEYS[1])
if not cur then return false end
cur = tonumber(cur)
local w, bp, hp, i = ARGV[1], ARGV[2], ARGV[3], 4
while i <= #ARGV do
  local seq, kind, n = tonumber(ARGV[i]), ARGV[i + 1], tonumber(ARGV[i + 2])
  if seq > cur then
    if seq ~= cur + 1 then redis.call('SET', KEYS[1], cur); return 'gap' end
    if kind == 'c' then
      for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('SREM', bp .. h, w) end
      for _, h in ipairs(redis.call('SMEMBERS', KEYS[3])) do redis.call('SREM', hp .. h, w) end
      redis.call('DEL', KEYS[2], KEYS[3])
    else
      for j = i + 3, i + 2 + n do
        local h = ARGV[j]
        if kind == 'r' then
          redis.call('SREM', bp .. h, w); redis.call('SREM', KEYS[2], h)
        else
          redis.call('SADD', bp .. h, w); redis.call('SADD', KEYS[2], h)
        end
        if kind == 'o' then
          redis.call('SADD', hp .. h, w); redis.call('SADD', KEYS[3], h)
        else
          redis.call('SREM', hp .. h, w); redis.call('SREM', KEYS[3], h)
        end
      end
    end
    cur = seq
  end
  i = i + 3 + n
end
redis.call('SET', KEYS[1], cur)
return cur
"""

# KEYS as _APPLY's. ARGV: worker, block and host-block key prefixes, a mode, then hashes
# ('add': held in the device pool, 'addh': in the host tier only) or the seq ('end').
_RESYNC = """
local w, bp, hp, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if mode == 'begin' then
  for _, h in ipairs(redis.call('SMEMBERS', KEYS[2])) do redis.call('SREM', bp .. h, w) end
  for _, h in ipairs(redis.call('SMEMBERS', KEYS[3])) do redis.call('SREM', hp .. h, w) end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
elseif mode == 'add' or mode == 'addh' then
  for j = 5, #ARGV do
    redis.call('SADD', bp .. ARGV[j], w); redis.call('SADD', KEYS[2], ARGV[j])
    if mode == 'addh' then
      redis.call('SADD', hp .. ARGV[j], w); redis.call('SADD', KEYS[3], ARGV[j])
    end
  end
else
  redis.call('SET', KEYS[1], ARGV[5])
end
return 0
"""

_KIND = {
    KVEventKind.STORED: "s",
    KVEventKind.OFFLOADED: "o",
    KVEventKind.REMOVED: "r",
    KVEventKind.CLEARED: "c",
}


class KVEventPublisher:
    """Background publisher of one worker's KV events (see module docstring)."""

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        worker_id: str,
        snapshot: Snapshot,
        config: PrefixIndexConfig | None = None,
        socket_timeout_s: float = 2.0,
    ) -> None:
        self.config = config or PrefixIndexConfig()
        self.worker_id = worker_id
        self.keys = IndexKeys(model_id, self.config.key_prefix)
        self._snapshot = snapshot
        self._redis = connect(redis_url, socket_timeout_s, socket_timeout_s)
        self._heartbeat = self._redis.register_script(_HEARTBEAT)
        self._apply = self._redis.register_script(_APPLY)
        self._resync_script = self._redis.register_script(_RESYNC)
        self._cond = threading.Condition()
        self._pending: deque[KVEvent] = deque()
        self._last_enqueued: int | None = None
        self._needs_resync = True
        self._applied_seq = -1
        self._stopping = False
        self._flush_lock = threading.Lock()  # the thread's flushes vs `flush_now`
        self._thread: threading.Thread | None = None
        self.num_resyncs = 0
        self.num_errors = 0
        self.last_error = ""
        self.connected = False
        self._failure_kinds: set[str] = set()  # exception types already logged with a traceback

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kv-publisher-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def publish(self, events: Iterable[KVEvent]) -> None:
        """Queue events for Redis (never blocks). Sequence numbers must rise by one."""
        with self._cond:
            for e in events:
                if self._last_enqueued is not None and e.seq != self._last_enqueued + 1:
                    log.info("KV event gap (%s -> %s): resync", self._last_enqueued, e.seq)
                    self._needs_resync = True
                self._last_enqueued = e.seq
                self._pending.append(e)
            if len(self._pending) > self.config.max_pending_events:
                self._pending.clear()
                self._needs_resync = True
            self._cond.notify()

    def request_resync(self) -> None:
        with self._cond:
            self._needs_resync = True
            self._cond.notify()

    @property
    def applied_seq(self) -> int:
        """Sequence number Redis has applied up to (as last confirmed)."""
        return self._applied_seq

    def stats(self) -> PublisherStats:
        with self._cond:
            pending = len(self._pending)
        return PublisherStats(
            running=self._thread is not None and self._thread.is_alive(),
            connected=self.connected,
            applied_seq=self._applied_seq,
            pending_events=pending,
            num_resyncs=self.num_resyncs,
            num_errors=self.num_errors,
            last_error=self.last_error,
        )

    def _run(self) -> None:
        backoff = 0.0
        retry_at = next_heartbeat = 0.0
        while True:
            with self._cond:
                while not self._stopping:  # until work is due (a retry waits out its backoff)
                    now = time.monotonic()
                    if now < retry_at:
                        self._cond.wait(retry_at - now)
                    elif self._pending or self._needs_resync or now >= next_heartbeat:
                        break
                    else:
                        self._cond.wait(next_heartbeat - now)
                if self._stopping:
                    return
            heartbeat_due = time.monotonic() >= next_heartbeat
            try:
                self._flush(heartbeat_due)
            except Exception as e:  # any failure: the index must not go stale for good
                backoff = min(max(0.1, backoff * 2), self.config.max_backoff_s)
                retry_at = time.monotonic() + backoff
                self._round_failed(e, backoff)
                continue
            if heartbeat_due:
                next_heartbeat = time.monotonic() + self.config.heartbeat_interval_s
            if backoff:
                log.info("KV event publisher of %s recovered", self.worker_id)
            backoff = 0.0
            self.connected = True

    def _round_failed(self, e: Exception, retry_in_s: float) -> None:
        """Count a failed round; a non-Redis failure also asks for a resync."""
        self.num_errors += 1
        self.last_error = f"{type(e).__name__}: {e}"
        self.connected = False
        if isinstance(e, redis.RedisError):  # Redis down or restarting: expected, retried
            log.warning("KV event publish failed (retry in %.1fs): %s", retry_in_s, e)
            return
        self.request_resync()
        kind = type(e).__qualname__
        if kind in self._failure_kinds:
            log.warning(
                "KV event publish of %s failed again (resync in %.1fs): %s",
                self.worker_id,
                retry_in_s,
                self.last_error,
            )
        else:
            self._failure_kinds.add(kind)
            log.error(
                "KV event publish of %s failed (resync in %.1fs)",
                self.worker_id,
                retry_in_s,
                exc_info=e,
            )

    def flush_now(self, heartbeat: bool = True) -> None:
        """Write what is pending now, on the caller's thread (raises `redis.RedisError`)."""
        self._flush(heartbeat)

    def _flush(self, heartbeat_due: bool) -> None:
        with self._flush_lock:
            self._flush_locked(heartbeat_due)

    def _flush_locked(self, heartbeat_due: bool) -> None:
        if self._needs_resync:
            self._resync()
        with self._cond:
            batch = list(self._pending)
        if not batch and not heartbeat_due:
            return
        k, w = self.keys, self.worker_id
        pipe = self._redis.pipeline(transaction=False)
        if heartbeat_due:
            ttl_ms = int(self.config.liveness_ttl_s * 1000)
            self._heartbeat(keys=[k.worker(w), k.seq(w), k.workers], args=[w, ttl_ms], client=pipe)
        for args in self._event_args(batch):
            self._apply(keys=self._worker_keys(), args=args, client=pipe)
        results = pipe.execute()
        if heartbeat_due:
            seq = results.pop(0)  # None: seq key missing
            if seq is None or int(seq) < self._applied_seq:  # Redis lost our state
                log.info("prefix index lost worker %s state (seq %s): resync", w, seq)
                self.request_resync()
                return
        for r in results:
            if not isinstance(r, int):  # None: seq key missing; b"gap": events were lost
                self.request_resync()
                return
            self._applied_seq = r
        with self._cond:
            for _ in range(len(batch)):
                self._pending.popleft()

    def _event_args(self, batch: Sequence[KVEvent]) -> list[list[str | int]]:
        """Script argument lists, each holding at most `resync_chunk` hashes."""
        head: list[str | int] = [
            self.worker_id,
            self.keys.block_prefix,
            self.keys.host_block_prefix,
        ]
        out: list[list[str | int]] = []
        args = list(head)
        for e in batch:
            args += [e.seq, _KIND[e.kind], len(e.block_hashes)]
            args += [h.hex() for h in e.block_hashes]
            if len(args) >= self.config.resync_chunk:
                out.append(args)
                args = list(head)
        if len(args) > len(head):
            out.append(args)
        return out

    def _worker_keys(self) -> list[str]:
        k, w = self.keys, self.worker_id
        return [k.seq(w), k.worker_blocks(w), k.worker_host_blocks(w)]

    def _resync_args(self, mode: str, *values: str | int) -> list[str | int]:
        k = self.keys
        return [self.worker_id, k.block_prefix, k.host_block_prefix, mode, *values]

    def _resync(self) -> None:
        with self._cond:
            self._needs_resync = False
        try:
            snap = self._snapshot()
            keys = self._worker_keys()
            pipe = self._redis.pipeline(transaction=True)
            self._resync_script(keys=keys, args=self._resync_args("begin"), client=pipe)
            chunk = self.config.resync_chunk
            for mode, hashes in (("add", snap.device_hashes), ("addh", snap.host_hashes)):
                for i in range(0, len(hashes), chunk):
                    hexes = [h.hex() for h in hashes[i : i + chunk]]
                    self._resync_script(
                        keys=keys, args=self._resync_args(mode, *hexes), client=pipe
                    )
            self._resync_script(keys=keys, args=self._resync_args("end", snap.seq), client=pipe)
            pipe.execute()
        except BaseException:
            self.request_resync()
            raise
        self.num_resyncs += 1
        self._applied_seq = snap.seq
        with self._cond:
            while self._pending and self._pending[0].seq <= snap.seq:
                self._pending.popleft()
        log.info(
            "worker %s resynced %d device + %d host blocks at seq %d",
            self.worker_id, len(snap.device_hashes), len(snap.host_hashes), snap.seq,
        )  # fmt: skip

    def close(self, deregister: bool = True) -> None:
        """Stop the thread; with `deregister`, remove this worker from the index at once."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5.0)
        if deregister:
            k, w = self.keys, self.worker_id
            try:
                pipe = self._redis.pipeline(transaction=True)
                keys = self._worker_keys()
                self._resync_script(keys=keys, args=self._resync_args("begin"), client=pipe)
                pipe.delete(k.worker(w))
                pipe.srem(k.workers, w)
                pipe.execute()
            except redis.RedisError as e:
                log.warning("deregistering worker %s from the index: %s", w, e)
        self._redis.close()
