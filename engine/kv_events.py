"""Typed changes of a worker's prefix cache, in the order they happened.

The block pool emits one event per change with a per-worker sequence number that increases by
exactly one, so a consumer (the Redis prefix-index publisher in kv_transfer) can detect a gap
(a lost event, a restart) and answer it with a full resync from `BlockPool.cached_hashes()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.block_hash import BlockHash


class KVEventKind(enum.Enum):
    STORED = "stored"  # blocks became cached (their hash is now reusable on this worker)
    REMOVED = "removed"  # cached blocks were evicted (hash no longer on this worker)
    CLEARED = "cleared"  # the whole prefix cache was dropped (no hashes listed)


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    block_hashes: tuple[BlockHash, ...] = ()
