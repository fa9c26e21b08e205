"""A decode endpoint's cumulative transfer figures: each event adds to its own figures only,
and `stats` is a frozen snapshot that later events do not change."""

from __future__ import annotations

import pytest

from kv_transfer.metrics import TransferMetrics
from vocabulary.transfer_load import TransferStats


def test_events_add_to_their_own_figures() -> None:
    m = TransferMetrics()
    assert m.stats == TransferStats()
    m.record_started(0.5, oversized=False)
    m.record_started(0.25, oversized=True)
    m.record_done(nbytes=4_000_000, blocks=3, reused=1, descriptors=2, seconds=0.002)
    m.record_done(nbytes=1_000_000, blocks=1, reused=0, descriptors=1, seconds=0.001)
    m.record_failed()
    m.record_expired()
    m.record_expired()
    m.record_budget_limited_pass(newly_deferred=2)
    m.record_budget_limited_pass(newly_deferred=0)
    m.record_heartbeat()
    m.record_abort_notice()
    m.record_unexpected_error()
    assert m.stats == TransferStats(
        transfers_done=2,
        transfers_failed=1,
        transfers_expired=2,
        bytes_transferred=5_000_000,
        blocks_transferred=4,
        blocks_reused=1,
        descriptors=3,
        transfer_seconds=pytest.approx(0.003),
        queue_wait_seconds=0.75,
        max_queue_wait_s=0.5,
        last_gbps=pytest.approx(1.0),  # the last transfer's: 1 MB in 1 ms
        deferred_requests=2,
        budget_limited_passes=2,
        oversized_requests=1,
        heartbeats_sent=1,
        abort_notices_sent=1,
        unexpected_errors=1,
    )


def test_a_transfer_without_bytes_or_time_keeps_the_last_rate() -> None:
    m = TransferMetrics()
    m.record_done(nbytes=2_000_000, blocks=1, reused=0, descriptors=1, seconds=0.001)
    m.record_done(nbytes=0, blocks=0, reused=2, descriptors=0, seconds=0.0005)
    m.record_done(nbytes=10, blocks=1, reused=0, descriptors=1, seconds=0.0)
    assert m.stats.last_gbps == pytest.approx(2.0)
    assert (m.stats.transfers_done, m.stats.bytes_transferred) == (3, 2_000_010)


def test_a_published_snapshot_does_not_change_with_later_events() -> None:
    m = TransferMetrics()
    m.record_failed()
    published = m.stats
    m.record_failed()
    m.record_heartbeat()
    assert published == TransferStats(transfers_failed=1)
    assert m.stats == TransferStats(transfers_failed=2, heartbeats_sent=1)
