"""Settings of the Redis prefix-cache index: lookups (router) and KV-event publishing
(workers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixIndexConfig:
    """The Redis prefix-cache index and the KV-event publisher."""

    key_prefix: str = "pdserve"
    """First part of every key (`{key_prefix}:{model}:...`): the cluster's name, so clusters
    sharing a Redis keep apart."""
    socket_timeout_s: float = 0.05
    """Redis socket read/write timeout: a lookup never waits longer than about this."""
    connect_timeout_s: float = 0.05
    """Redis connect timeout."""
    retry_after_s: float = 1.0
    """After a failed lookup, answer `available=False` at once for this long."""
    liveness_ttl_s: float = 5.0
    """TTL of a worker's liveness key; a worker silent for longer is treated as dead."""
    heartbeat_interval_s: float = 1.0
    """How often the publisher refreshes the liveness key (also detects a Redis restart)."""
    max_pending_events: int = 100_000
    """Pending events beyond this are dropped and replaced by a full resync."""
    resync_chunk: int = 4096
    """Hashes per script call in a full resync (all chunks go in one MULTI/EXEC)."""
    max_backoff_s: float = 2.0
    """Longest wait between publisher retries while Redis is down."""
