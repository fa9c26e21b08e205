"""A decode endpoint's KV-transfer load (for admission and placement) and its cumulative
transfer figures (for status and metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerLoad:
    """Transfer load towards one prefill peer (agent name)."""

    peer: str
    in_flight_transfers: int
    in_flight_blocks: int
    in_flight_bytes: int
    queued_transfers: int
    queued_blocks: int


@dataclass(frozen=True)
class TransferLoad:
    """A decode endpoint's transfer load and budget, for admission and placement."""

    in_flight_transfers: int = 0
    in_flight_blocks: int = 0
    in_flight_bytes: int = 0
    queued_transfers: int = 0
    queued_blocks: int = 0
    queued_bytes: int = 0
    max_inflight_blocks: int = 0
    max_inflight_bytes: int = 0
    per_peer: tuple[PeerLoad, ...] = ()

    @property
    def pending_blocks(self) -> int:
        """Blocks this endpoint still has to pull (queued + in flight)."""
        return self.in_flight_blocks + self.queued_blocks


@dataclass(frozen=True)
class TransferStats:
    """Cumulative figures of one decode endpoint since it started."""

    transfers_done: int = 0
    transfers_failed: int = 0
    transfers_expired: int = 0
    bytes_transferred: int = 0
    blocks_transferred: int = 0
    blocks_reused: int = 0
    descriptors: int = 0
    transfer_seconds: float = 0.0
    queue_wait_seconds: float = 0.0
    max_queue_wait_s: float = 0.0
    last_gbps: float = 0.0
    deferred_requests: int = 0
    """Requests that waited at least one scheduling pass for in-flight budget."""
    budget_limited_passes: int = 0
    """Scheduling passes that left work queued because the budget was full."""
    oversized_requests: int = 0
    """Requests larger than a budget limit on their own (started alone at the head)."""
    heartbeats_sent: int = 0
    abort_notices_sent: int = 0
    unexpected_errors: int = 0
    """Exceptions no transfer path expects (a backend or manager bug, a raising outcome
    callback), each confined to one transfer or notice and logged with its traceback."""
