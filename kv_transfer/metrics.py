"""Transfer metrics: cumulative counters of a decode endpoint, and per-transfer figures.

The endpoint's thread owns a `TransferMetrics` and publishes `TransferStats` snapshots; the
worker exports them (Prometheus) and gets per-transfer figures from each `TransferOutcome`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vocabulary.transfer_load import TransferStats


@dataclass
class TransferMetrics:
    """Mutable counters behind `TransferStats` (owned by one thread)."""

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
    budget_limited_passes: int = 0
    oversized_requests: int = 0
    heartbeats_sent: int = 0
    abort_notices_sent: int = 0
    unexpected_errors: int = 0

    def record_done(
        self, nbytes: int, blocks: int, reused: int, descriptors: int, seconds: float
    ) -> None:
        self.transfers_done += 1
        self.bytes_transferred += nbytes
        self.blocks_transferred += blocks
        self.blocks_reused += reused
        self.descriptors += descriptors
        self.transfer_seconds += seconds
        if seconds > 0 and nbytes > 0:
            self.last_gbps = nbytes / seconds / 1e9

    def record_queue_wait(self, seconds: float) -> None:
        self.queue_wait_seconds += seconds
        self.max_queue_wait_s = max(self.max_queue_wait_s, seconds)

    def snapshot(self) -> TransferStats:
        return TransferStats(**asdict(self))
