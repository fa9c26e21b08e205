"""Transfer metrics: cumulative figures of a decode endpoint, and per-transfer figures.

The endpoint's thread owns a `TransferMetrics`, whose `stats` is the latest `TransferStats`;
the worker exports it (Prometheus) and gets per-transfer figures from each `TransferOutcome`.
"""

from __future__ import annotations

from dataclasses import replace

from vocabulary.transfer_load import TransferStats


class TransferMetrics:
    """The cumulative `TransferStats` of one decode endpoint (owned by one thread).

    Every event replaces the frozen `stats` with `dataclasses.replace` (whose field names mypy
    checks), so the figures are declared once, in `TransferStats`, and `stats` may be handed to
    other threads as it is. Events come per transfer, notice or scheduling pass, never per
    token: the copy costs nothing.
    """

    def __init__(self) -> None:
        self.stats = TransferStats()

    def record_done(
        self, nbytes: int, blocks: int, reused: int, descriptors: int, seconds: float
    ) -> None:
        s = self.stats
        self.stats = replace(
            s,
            transfers_done=s.transfers_done + 1,
            bytes_transferred=s.bytes_transferred + nbytes,
            blocks_transferred=s.blocks_transferred + blocks,
            blocks_reused=s.blocks_reused + reused,
            descriptors=s.descriptors + descriptors,
            transfer_seconds=s.transfer_seconds + seconds,
            last_gbps=nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else s.last_gbps,
        )

    def record_failed(self) -> None:
        self.stats = replace(self.stats, transfers_failed=self.stats.transfers_failed + 1)

    def record_expired(self) -> None:
        self.stats = replace(self.stats, transfers_expired=self.stats.transfers_expired + 1)

    def record_started(self, queue_wait_s: float, oversized: bool) -> None:
        """A read started after `queue_wait_s` in the queue; `oversized`: larger than a budget
        limit on its own."""
        s = self.stats
        self.stats = replace(
            s,
            queue_wait_seconds=s.queue_wait_seconds + queue_wait_s,
            max_queue_wait_s=max(s.max_queue_wait_s, queue_wait_s),
            oversized_requests=s.oversized_requests + int(oversized),
        )

    def record_budget_limited_pass(self, newly_deferred: int) -> None:
        """A scheduling pass left work queued; `newly_deferred` requests waited for the first
        time."""
        s = self.stats
        self.stats = replace(
            s,
            budget_limited_passes=s.budget_limited_passes + 1,
            deferred_requests=s.deferred_requests + newly_deferred,
        )

    def record_heartbeat(self) -> None:
        self.stats = replace(self.stats, heartbeats_sent=self.stats.heartbeats_sent + 1)

    def record_abort_notice(self) -> None:
        self.stats = replace(self.stats, abort_notices_sent=self.stats.abort_notices_sent + 1)

    def record_unexpected_error(self) -> None:
        self.stats = replace(self.stats, unexpected_errors=self.stats.unexpected_errors + 1)
