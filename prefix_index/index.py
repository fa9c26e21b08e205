"""The Redis prefix-cache index: which live worker holds the longest prefix of a prompt.

Keys (all under `{cluster}:{model}:`, the cluster's name being `PrefixIndexConfig.key_prefix`,
"pdserve" by default: neither models nor clusters sharing a Redis share entries):

    blk:{hash hex}   set of worker ids that hold the block with this chained hash (any tier)
    hblk:{hash hex}  of those, the workers that hold it in their host tier only
    worker:{id}      liveness key, refreshed by the worker's publisher, expires after a TTL
    workers          set of every worker id that ever published (for purging)
    wblk:{id}        reverse index: hashes a worker holds (for resync and purge)
    whblk:{id}       reverse index: hashes a worker holds in its host tier only
    seq:{id}         sequence number of the last KV event applied for a worker

A block's hash carries its tenant and cache salt (vocabulary/block_hash.py `scoped_salt`), so the
`blk:` keys of one tenant's prompt are never another tenant's: lookups find only the
caller's own cached prefixes.

Written only by `KVEventPublisher` (prefix_index/publisher.py); read by `lookup` in one
round trip: a Lua script gets the chain as one hex string (and the hex digits of one hash:
32 for xxh3, 64 for sha256, vocabulary/block_hash.py), keeps the live holders of the
first block as candidates, and walks on with one SMISMEMBER per block (SISMEMBER per
candidate on Redis < 6.2) until no candidate is left (a miss costs one SMEMBERS). A worker's
count is the number of leading blocks it holds without a hole; because hashes chain, an
equal hash at position i means an equal prompt up to block i. The index is a hint: a stale
entry costs a cache miss, never a wrong answer. With host tiers (engine/kv/host_tier.py) the
answer also says, per worker, how many of its leading blocks are in the host tier only
(onboarded before use, cheaper than a recompute and dearer than a device hit): one more
SMISMEMBER per block over the workers still holding it.

Redis unavailable: `lookup` answers `PrefixMatch(available=False)` after at most the socket
timeout, and then at once for `retry_after_s` (a circuit breaker), so routing falls back to
load alone and never waits on Redis. Scripts touch keys they compute from arguments
(block keys, liveness, reverse index): this needs a single Redis (any version with Lua; 6.0
as bundled for the GPU machine works), not Redis Cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefix_index.config import PrefixIndexConfig
from prefix_index.types import PrefixMatch, WorkerPrefix
from vocabulary.block_hash import BlockHash

log = logging.getLogger(__name__)

_LOOKUP = """
local bp, wp, hexes, width = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local n = #hexes / width
local function key(i) return bp .. string.sub(hexes, width * (i - 1) + 1, width * i) end
local names, depth = {}, {}
for _, w in ipairs(redis.call('SMEMBERS', key(1))) do
  if redis.call('EXISTS', wp .. w) == 1 then names[#names + 1] = w; depth[w] = 1 end
end
local multi = true  -- SMISMEMBER (Redis >= 6.2); older servers fall back to SISMEMBER
for i = 2, n do
  if #names == 0 then break end
  local k, still, flags = key(i), {}, nil
  if multi then
    flags = redis.pcall('SMISMEMBER', k, unpack(names))
    if type(flags) == 'table' and flags.err then multi = false; flags = nil end
  end
  for j, w in ipairs(names) do
    local hit
    if flags then hit = flags[j] == 1 else hit = redis.call('SISMEMBER', k, w) == 1 end
    if hit then depth[w] = i; still[#still + 1] = w end
  end
  names = still
end
local hosts = {}
for w, _ in pairs(depth) do hosts[w] = 0 end
local hp = ARGV[5]
for i = 1, n do
  local holding = {}
  for w, d in pairs(depth) do if d >= i then holding[#holding + 1] = w end end
  if #holding == 0 then break end
  local k = hp .. string.sub(hexes, width * (i - 1) + 1, width * i)
  if redis.call('EXISTS', k) == 1 then
    for _, w in ipairs(holding) do
      if redis.call('SISMEMBER', k, w) == 1 then hosts[w] = hosts[w] + 1 end
    end
  end
end
local out = {}
for w, d in pairs(depth) do out[#out + 1] = w; out[#out + 1] = d; out[#out + 1] = hosts[w] end
return out
"""

# ARGV: worker, reverse-index, seq, block, host-block and host reverse-index key prefixes, then
# a mode and worker ids: 'named' purges the ids given (live or not), 'except' every registered
# worker not among the ids given. Returns the ids purged.
_PURGE = """
local wp, wbp, sp, bp, hp, whp, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local function purge(w)
  local held = redis.call('SREM', KEYS[1], w)
  for _, h in ipairs(redis.call('SMEMBERS', wbp .. w)) do redis.call('SREM', bp .. h, w) end
  for _, h in ipairs(redis.call('SMEMBERS', whp .. w)) do redis.call('SREM', hp .. h, w) end
  return held + redis.call('DEL', wp .. w, wbp .. w, whp .. w, sp .. w) > 0
end
local purged, given = {}, {}
for i = 8, #ARGV do given[ARGV[i]] = true end
if mode == 'named' then
  for i = 8, #ARGV do if purge(ARGV[i]) then purged[#purged + 1] = ARGV[i] end end
  return purged
end
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if not given[w] then purge(w); purged[#purged + 1] = w end
end
return purged
"""


@dataclass(frozen=True)
class IndexKeys:
    """Key names of one model's index (see module docstring)."""

    model_id: str
    prefix: str = "pdserve"
    """The cluster's name (`PrefixIndexConfig.key_prefix`)."""

    @property
    def root(self) -> str:
        return f"{self.prefix}:{self.model_id}:"

    @property
    def block_prefix(self) -> str:
        return self.root + "blk:"

    @property
    def host_block_prefix(self) -> str:
        return self.root + "hblk:"

    @property
    def worker_prefix(self) -> str:
        return self.root + "worker:"

    @property
    def worker_host_blocks_prefix(self) -> str:
        return self.root + "whblk:"

    @property
    def worker_blocks_prefix(self) -> str:
        return self.root + "wblk:"

    @property
    def seq_prefix(self) -> str:
        return self.root + "seq:"

    @property
    def workers(self) -> str:
        return self.root + "workers"

    def worker(self, worker_id: str) -> str:
        return self.worker_prefix + worker_id

    def worker_blocks(self, worker_id: str) -> str:
        return self.worker_blocks_prefix + worker_id

    def worker_host_blocks(self, worker_id: str) -> str:
        return self.worker_host_blocks_prefix + worker_id

    def seq(self, worker_id: str) -> str:
        return self.seq_prefix + worker_id


def connect(url: str, socket_timeout_s: float, connect_timeout_s: float) -> redis.Redis:
    """A client that fails fast: small timeouts, no retries (callers decide what to do)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )


class PrefixIndex:
    """Longest cached prefix per live worker, for routing. Thread-safe; never blocks long."""

    def __init__(
        self,
        redis_url: str,
        model_id: str,
        config: PrefixIndexConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or PrefixIndexConfig()
        self.keys = IndexKeys(model_id, self.config.key_prefix)
        self._clock = clock
        self._redis = connect(
            redis_url, self.config.socket_timeout_s, self.config.connect_timeout_s
        )
        self._lookup = self._redis.register_script(_LOOKUP)
        self._purge = self._redis.register_script(_PURGE)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.num_lookups = 0
        self.num_unavailable = 0

    def lookup(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """For each live worker, how many leading blocks of `block_hashes` it caches."""
        n = len(block_hashes)
        with self._lock:
            self.num_lookups += 1
            if self._clock() < self._down_until:
                self.num_unavailable += 1
                return PrefixMatch(chain_length=n, available=False)
        if n == 0:
            return PrefixMatch(chain_length=0)
        try:
            chain_hex = b"".join(block_hashes).hex()  # 2 hex digits per byte of each hash
            width = 2 * len(block_hashes[0])
            raw = self._lookup(
                args=[
                    self.keys.block_prefix,
                    self.keys.worker_prefix,
                    chain_hex,
                    width,
                    self.keys.host_block_prefix,
                ],
            )
        except redis.RedisError as e:
            self._mark_down(e)
            return PrefixMatch(chain_length=n, available=False)
        pairs = [
            WorkerPrefix(_text(raw[i]), int(raw[i + 1]), int(raw[i + 2]))
            for i in range(0, len(raw), 3)
        ]
        pairs.sort(key=lambda w: (-w.num_blocks, w.worker_id))
        return PrefixMatch(chain_length=n, workers=tuple(pairs))

    def live_workers(self) -> tuple[str, ...]:
        """Workers whose liveness key exists (empty when Redis is unavailable)."""
        try:
            members = self._redis.smembers(self.keys.workers)
            ids = sorted(_text(w) for w in members)
            pipe = self._redis.pipeline(transaction=False)
            for w in ids:
                pipe.exists(self.keys.worker(w))
            flags = pipe.execute() if ids else []
        except redis.RedisError as e:
            self._mark_down(e)
            return ()
        return tuple(w for w, alive in zip(ids, flags, strict=True) if alive)

    def purge_worker(self, worker_id: str) -> bool:
        """Delete every entry of `worker_id` now, live or not (a worker the controller removed).

        True when the index held anything of it. A worker still publishing re-registers with
        its next heartbeat (its publisher finds its state gone and resyncs).
        """
        return self._run_purge("named", (worker_id,)) == (worker_id,)

    def purge_workers_except(self, live_worker_ids: Iterable[str]) -> tuple[str, ...]:
        """Delete every entry of each registered worker not in `live_worker_ids`, even while
        its liveness key lasts (workers an earlier cluster left behind); returns their ids.

        Only for the owner of every worker publishing under this model: a worker missing from
        `live_worker_ids` (just started, another cluster's) loses its entries until its next
        heartbeat resyncs them.
        """
        return self._run_purge("except", tuple(live_worker_ids))

    def _run_purge(self, mode: str, worker_ids: Sequence[str]) -> tuple[str, ...]:
        """The `_PURGE` script in `mode`; () when Redis is unavailable (nothing was purged)."""
        k = self.keys
        prefixes = [
            k.worker_prefix, k.worker_blocks_prefix, k.seq_prefix, k.block_prefix,
            k.host_block_prefix, k.worker_host_blocks_prefix,
        ]  # fmt: skip
        try:
            purged = self._purge(keys=[k.workers], args=[*prefixes, mode, *worker_ids])
        except redis.RedisError as e:
            self._mark_down(e)
            return ()
        return tuple(sorted(_text(w) for w in purged))

    def _mark_down(self, e: Exception) -> None:
        log.warning("prefix index unavailable for %.1fs: %s", self.config.retry_after_s, e)
        with self._lock:
            self.num_unavailable += 1
            self._down_until = self._clock() + self.config.retry_after_s

    def close(self) -> None:
        self._redis.close()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
