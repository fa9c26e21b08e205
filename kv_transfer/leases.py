"""Prefill-side leases: handed-off blocks stay pinned until decode pulled them, or time ran out.

Lifecycle of a lease (`LeaseState`):

    HELD ──(decode `done` notice)────────────► RELEASED
      ├───(decode `abort` notice, or cancel)──► ABORTED
      └───(deadline passed; reaper)───────────► EXPIRED
    HELD ──(decode heartbeat)──► HELD with a later deadline (never shorter)

A lease leaves HELD exactly once; the endpoint then calls the worker's `release_blocks` exactly
once for it. Notices for a lease that is no longer held are late and change nothing.

Pinning: a block is pinned while at least one held lease names it (two requests sharing a
cached prefix pin the same blocks; pins are counted). The worker keeps its own reference on
every handed-off block until `release_blocks` (so its prefix cache cannot evict them) and may
ask `is_pinned` as well. Thread-safe: the worker thread grants and queries, the endpoint's
loop thread completes, extends and reaps.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kv_transfer.config import KVTransferConfig

_HISTORY = 4096


class LeaseState(enum.Enum):
    HELD = "held"
    RELEASED = "released"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    granted_at: float
    deadline: float
    state: LeaseState = LeaseState.HELD


@dataclass(frozen=True)
class LeaseStats:
    granted: int = 0
    released: int = 0
    aborted: int = 0
    expired: int = 0
    extensions: int = 0
    late_notices: int = 0
    held: int = 0
    pinned_blocks: int = 0


class LeaseTable:
    """The held leases of one prefill endpoint and the block pins they imply."""

    def __init__(self, config: KVTransferConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Lease] = {}
        self._pins: Counter[int] = Counter()
        self._ended: OrderedDict[str, LeaseState] = OrderedDict()
        self._counts: Counter[str] = Counter()

    def grant(
        self, request_id: str, block_ids: Sequence[int], lease_s: float | None = None
    ) -> Lease:
        """Pin `block_ids` for `request_id` until now + `lease_s` (default `config.lease_s`)."""
        now = self._clock()
        lease = Lease(
            request_id=request_id,
            block_ids=tuple(int(b) for b in block_ids),
            granted_at=now,
            deadline=now + (self.config.lease_s if lease_s is None else lease_s),
        )
        with self._lock:
            if request_id in self._held:
                raise ValueError(f"request {request_id} already holds a lease")
            self._held[request_id] = lease
            self._pins.update(lease.block_ids)
            self._ended.pop(request_id, None)
            self._counts["granted"] += 1
        return lease

    def complete(self, request_id: str) -> Lease | None:
        """Decode pulled the blocks: the ended lease, or None if it was not held (late)."""
        return self._end(request_id, LeaseState.RELEASED)

    def abort(self, request_id: str) -> Lease | None:
        """Decode gave up, or the worker cancelled: the ended lease, or None if not held."""
        return self._end(request_id, LeaseState.ABORTED)

    def extend(self, request_ids: Sequence[str], deadline: float) -> int:
        """Move held leases to `deadline` (capped, never shorter); returns how many moved."""
        cap = self._clock() + self.config.lease_max_extension_s
        target = min(deadline, cap)
        moved = 0
        with self._lock:
            for rid in request_ids:
                lease = self._held.get(rid)
                if lease is None:
                    self._counts["late_notices"] += 1
                elif target > lease.deadline:
                    self._held[rid] = replace(lease, deadline=target)
                    moved += 1
            self._counts["extensions"] += moved
        return moved

    def reap(self) -> list[Lease]:
        """End every lease whose deadline has passed (state EXPIRED)."""
        now = self._clock()
        with self._lock:
            due = [rid for rid, lease in self._held.items() if lease.deadline <= now]
            return [self._end_locked(rid, LeaseState.EXPIRED) for rid in due]

    def abort_all(self) -> list[Lease]:
        """End every held lease (ABORTED): the endpoint is shutting down."""
        with self._lock:
            return [self._end_locked(rid, LeaseState.ABORTED) for rid in list(self._held)]

    def _end(self, request_id: str, state: LeaseState) -> Lease | None:
        with self._lock:
            if request_id not in self._held:
                self._counts["late_notices"] += 1
                return None
            return self._end_locked(request_id, state)

    def _end_locked(self, request_id: str, state: LeaseState) -> Lease:
        lease = replace(self._held.pop(request_id), state=state)
        self._pins.subtract(lease.block_ids)
        for b in lease.block_ids:
            if self._pins[b] <= 0:
                del self._pins[b]
        self._ended[request_id] = state
        while len(self._ended) > _HISTORY:
            self._ended.popitem(last=False)
        self._counts[state.value] += 1
        return lease

    # ---- views ----------------------------------------------------------------------------

    def is_pinned(self, block_id: int) -> bool:
        with self._lock:
            return block_id in self._pins

    def pinned_block_ids(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._pins)

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._held.get(request_id)

    def state_of(self, request_id: str) -> LeaseState | None:
        """HELD, the final state of a recently ended lease, or None."""
        with self._lock:
            if request_id in self._held:
                return LeaseState.HELD
            return self._ended.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def stats(self) -> LeaseStats:
        with self._lock:
            c = self._counts
            return LeaseStats(
                granted=c["granted"],
                released=c[LeaseState.RELEASED.value],
                aborted=c[LeaseState.ABORTED.value],
                expired=c[LeaseState.EXPIRED.value],
                extensions=c["extensions"],
                late_notices=c["late_notices"],
                held=len(self._held),
                pinned_blocks=len(self._pins),
            )
