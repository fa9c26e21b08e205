"""Typed changes of a worker's prefix cache, in the order they happened.

The block pool emits one event per change with a per-worker sequence number that increases by
exactly one, so a consumer (the Redis prefix-index publisher in kv_transfer) can detect a gap
(a lost event, a restart) and answer it with a full resync from `BlockPool.cached_hashes()`
and `BlockPool.host_only_hashes()`. A hash is in one tier as far as the index goes: the
device pool when it is cached there (it may also have a host copy), else the host tier.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vocabulary.block_hash import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"  # blocks became cached in the device pool (reusable on this worker)
    OFFLOADED = "offloaded"  # evicted from the device pool, held in the host tier only
    REMOVED = "removed"  # held in no tier of this worker any more
    CLEARED = "cleared"  # the whole prefix cache was dropped (no hashes listed)


class KVTier(enum.Enum):
    """Where a worker holds a block. DISK is reserved for a tier behind the host one (NIXL's
    POSIX/GDS backends; not built): the events, the index, `KVHandle` regions and the
    transfer plan already name a block's tier, so it adds a tier value, not a new path."""

    DEVICE = "device"  # the KV pool the model reads (VRAM on GPU)
    HOST = "host"  # the host tier (pinned RAM, engine/kv/host_tier.py)
    DISK = "disk"  # reserved


class TierMove(enum.Enum):
    """A copy between a worker's own tiers (budgeted with KV transfers, kv_transfer/budget.py)."""

    ONBOARD = "onboard"  # host tier → device pool (a prefix hit found in the host tier)
    OFFLOAD = "offload"  # device pool → host tier (a cached block became evictable)


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = ()

    @property
    def tier(self) -> KVTier | None:
        """The tier the blocks are in after the event (None: held nowhere)."""
        if self.kind is KVEventKind.STORED:
            return KVTier.DEVICE
        return KVTier.HOST if self.kind is KVEventKind.OFFLOADED else None


@dataclass(frozen=True)
class CacheSnapshot:
    """Every hash a worker holds, by tier, as of event `seq` (a full index resync)."""

    seq: int
    device_hashes: tuple[BlockHash, ...]
    host_hashes: tuple[BlockHash, ...] = ()
    """Held in the host tier only."""


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of one worker's publisher (any thread may take it; the worker exports it)."""

    running: bool
    """The publisher thread is alive."""
    connected: bool
    """The last round reached Redis and succeeded."""
    applied_seq: int
    """Sequence number Redis has applied up to (as last confirmed)."""
    pending_events: int
    num_resyncs: int
    num_errors: int
    """Failed rounds since start: Redis errors and any other exception."""
    last_error: str
    """`Type: message` of the latest failure, "" if none."""
