"""Prefill leases: pinning, release exactly once, expiry by the clock, capped extensions."""

from __future__ import annotations

import pytest
from kvt_factories import FakeClock

from kv_transfer.config import KVTransferConfig
from kv_transfer.leases import LeaseState, LeaseTable

CONFIG = KVTransferConfig(lease_s=10.0, lease_max_extension_s=30.0)


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture()
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(CONFIG, clock)


def test_grant_pins_blocks_until_done_and_shared_blocks_stay_pinned(table: LeaseTable) -> None:
    a = table.grant("a", [1, 2, 3])
    table.grant("b", [2, 3, 7])  # shares a cached prefix with a
    assert a.deadline == 1010.0 and a.state is LeaseState.HELD
    assert table.pinned_block_ids() == frozenset({1, 2, 3, 7})
    ended = table.complete("a")
    assert ended is not None and ended.state is LeaseState.RELEASED
    assert ended.block_ids == (1, 2, 3)
    assert table.pinned_block_ids() == frozenset({2, 3, 7})
    assert not table.is_pinned(1) and table.is_pinned(2)
    assert table.abort("b") is not None and table.pinned_block_ids() == frozenset()
    assert table.state_of("a") is LeaseState.RELEASED and table.state_of("b") is LeaseState.ABORTED


def test_expired_lease_is_reaped_exactly_at_its_deadline(
    table: LeaseTable, clock: FakeClock
) -> None:
    table.grant("short", [4, 5], lease_s=2.0)
    table.grant("long", [6])
    clock.advance(1.999)
    assert table.reap() == []
    clock.advance(0.001)
    expired = table.reap()
    assert [(x.request_id, x.state, x.block_ids) for x in expired] == [
        ("short", LeaseState.EXPIRED, (4, 5))
    ]
    assert table.reap() == [] and table.pinned_block_ids() == frozenset({6})
    assert table.stats().expired == 1 and table.stats().held == 1


def test_notices_after_the_end_are_late_and_change_nothing(
    table: LeaseTable, clock: FakeClock
) -> None:
    table.grant("r", [1], lease_s=1.0)
    clock.advance(1.0)
    assert len(table.reap()) == 1
    assert table.complete("r") is None  # late done after expiry: no second release
    assert table.abort("r") is None
    assert table.extend(["r"], clock() + 5) == 0
    stats = table.stats()
    assert (stats.expired, stats.released, stats.late_notices) == (1, 0, 3)


def test_heartbeat_extends_up_to_the_cap_and_never_shortens(
    table: LeaseTable, clock: FakeClock
) -> None:
    table.grant("r", [1])  # deadline 1010
    assert table.extend(["r"], 1005.0) == 0  # shorter: ignored
    assert table.extend(["r"], 1020.0) == 1
    assert table.get("r").deadline == 1020.0  # type: ignore[union-attr]
    assert table.extend(["r"], 5000.0) == 1  # capped at now + 30
    assert table.get("r").deadline == 1030.0  # type: ignore[union-attr]
    clock.advance(29.0)
    assert table.reap() == []


def test_double_grant_is_refused_and_abort_all_ends_every_lease(table: LeaseTable) -> None:
    table.grant("r", [1])
    with pytest.raises(ValueError, match="already holds"):
        table.grant("r", [2])
    table.grant("s", [3])
    assert sorted(x.request_id for x in table.abort_all()) == ["r", "s"]
    assert len(table) == 0 and table.pinned_block_ids() == frozenset()
