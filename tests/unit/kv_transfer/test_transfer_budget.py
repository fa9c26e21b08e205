"""In-flight budget: FCFS admission over block counts, per-peer limits, oversized requests,
and the host tier's copies sharing it with the pulls (heads, oldest first, lapses)."""

from __future__ import annotations

from kv_transfer.budget import (
    HEAD_TTL_S,
    HOST_TIER,
    ONBOARD_LANE,
    TRANSFERS,
    Candidate,
    InFlightBudget,
)
from kv_transfer.config import BudgetConfig
from vocabulary.kv_events import TierMove
from vocabulary.transfer_load import PeerLoad

KB = 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budget(
    blocks: int = 10,
    per_peer: int = 10,
    nbytes: int = 10**9,
    per_peer_bytes: int = 10**9,
    clock: Clock | None = None,
) -> InFlightBudget:
    return InFlightBudget(BudgetConfig(blocks, nbytes, per_peer, per_peer_bytes), clock or Clock())


def c(rid: str, blocks: int, peer: str = "P", nbytes: int | None = None) -> Candidate:
    return Candidate(rid, peer, blocks, blocks * KB if nbytes is None else nbytes)


def ids(cands: list[Candidate]) -> list[str]:
    return [x.request_id for x in cands]


def test_admits_in_order_until_the_global_budget_is_full_and_nobody_overtakes() -> None:
    b = budget(blocks=10)
    queue = [c("a", 4), c("b", 5), c("c", 3), c("d", 1)]
    assert ids(b.select(queue)) == ["a", "b"]  # c (3) does not fit; d (1) would, but waits
    b.acquire(queue[0])
    b.acquire(queue[1])
    assert ids(b.select(queue[2:])) == []
    b.release(queue[0])  # 5 in flight: c (3) and d (1) now fit, in order
    assert ids(b.select(queue[2:])) == ["c", "d"]


def test_byte_limit_counts_like_the_block_limit() -> None:
    b = budget(blocks=100, nbytes=10 * KB)
    assert ids(b.select([c("a", 6), c("b", 6), c("c", 1)])) == ["a"]


def test_a_full_peer_blocks_only_its_own_requests_fcfs_within_the_peer() -> None:
    b = budget(blocks=20, per_peer=6)
    b.acquire(c("busy", 5, "P1"))
    queue = [c("p1-a", 2, "P1"), c("p2-a", 3, "P2"), c("p1-b", 1, "P1"), c("p2-b", 3, "P2")]
    # p1-a does not fit P1 (5+2 > 6); p1-b (1) would fit, but FCFS within P1 keeps it behind.
    assert ids(b.select(queue)) == ["p2-a", "p2-b"]


def test_oversized_request_runs_alone_only_at_the_head_with_nothing_in_flight() -> None:
    b = budget(blocks=10, per_peer=8)
    big = c("big", 9)  # larger than the per-peer limit on its own
    assert b.is_oversized(big) and not b.is_oversized(c("x", 8))
    b.acquire(c("running", 2))
    assert ids(b.select([big, c("small", 1)])) == []  # waits at the head, blocks the line
    b.release(c("running", 2))
    assert ids(b.select([big, c("small", 1)])) == ["big"]  # alone: nothing may join it
    assert ids(b.select([c("first", 1), big, c("small", 1)])) == ["first"]  # not at the head


def test_usage_and_peer_loads_follow_acquire_and_release() -> None:
    b = budget(blocks=20)
    b.acquire(c("a", 3, "P1"))
    b.acquire(c("b", 2, "P2"))
    assert (b.num_transfers, b.num_blocks, b.nbytes) == (2, 5, 5 * KB)
    assert b.peer_usage("P1") == (1, 3, 3 * KB)
    loads = b.peer_loads([c("q", 4, "P2"), c("r", 1, "P3")])
    assert loads == (
        PeerLoad("P1", 1, 3, 3 * KB, 0, 0),
        PeerLoad("P2", 1, 2, 2 * KB, 1, 4),
        PeerLoad("P3", 0, 0, 0, 1, 1),
    )
    b.release(c("a", 3, "P1"))
    b.release(c("b", 2, "P2"))
    assert (b.num_transfers, b.num_blocks, b.peer_usage("P1")) == (0, 0, (0, 0, 0))
    assert b.peer_loads([]) == ()


# -- the host tier's copies in the same budget ----------------------------------------------


def onboard(b: InFlightBudget, key: str, blocks: int, wait: bool = True) -> bool:
    return b.try_move(TierMove.ONBOARD, key, blocks, blocks * KB, wait)


def test_an_onboard_counts_in_its_own_lane_and_ends_with_end_move() -> None:
    b = budget(blocks=10, per_peer=6)
    assert onboard(b, "r1", 4)
    assert b.peer_usage(ONBOARD_LANE) == (1, 4, 4 * KB) and b.num_blocks == 4
    assert not onboard(b, "r2", 3)  # the lane's limit (6): the onboard lane is full
    assert ids(b.take([c("pull", 6, "P1")])) == ["pull"]  # pulls have the rest of the budget
    b.end_move(TierMove.ONBOARD, 4, 4 * KB)
    assert b.peer_usage(ONBOARD_LANE) == (0, 0, 0) and b.num_blocks == 6


def test_a_waiting_onboard_holds_later_pulls_back_until_it_starts() -> None:
    b = budget(blocks=10)
    b.take([c("pull-1", 8, "P1")])  # in flight
    assert not onboard(b, "r1", 4)  # does not fit: it is the host tier's head now
    assert b.head_of(HOST_TIER) == Candidate("r1", ONBOARD_LANE, 4, 4 * KB)
    # a new pull (2) would fit (8 + 2), but leaves no room for the older onboard (4)
    assert ids(b.take([c("pull-2", 2, "P2")])) == []
    b.release(c("pull-1", 8, "P1"))
    assert onboard(b, "r1", 4) and b.head_of(HOST_TIER) is None
    assert ids(b.take([c("pull-2", 2, "P2")])) == ["pull-2"]


def test_a_waiting_pull_holds_later_onboards_back_oldest_head_first() -> None:
    clock = Clock()
    b = budget(blocks=10, clock=clock)
    assert onboard(b, "r0", 6)  # in flight
    assert ids(b.take([c("pull", 6, "P1")])) == []  # the transfers' head from now on
    clock.now += 0.1
    assert not onboard(b, "r1", 3)  # fits (6 + 3) but the older pull comes first
    b.end_move(TierMove.ONBOARD, 6, 6 * KB)
    # both wait; the younger head (r1) leaves room for the older (pull), not the other way
    assert ids(b.take([c("pull", 6, "P1")])) == ["pull"]
    assert onboard(b, "r1", 3)


def test_a_head_its_user_stops_asking_for_lapses() -> None:
    clock = Clock()
    b = budget(blocks=10, clock=clock)
    b.take([c("pull-1", 8, "P1")])
    assert not onboard(b, "gone", 4)  # then its request is aborted: nobody asks again
    assert ids(b.take([c("pull-2", 2, "P2")])) == []
    clock.now += HEAD_TTL_S + 0.01
    assert ids(b.take([c("pull-2", 2, "P2")])) == ["pull-2"]


def test_a_move_that_does_not_wait_never_holds_anyone_back() -> None:
    b = budget(blocks=10)
    b.take([c("pull-1", 8, "P1")])
    assert not onboard(b, "r1", 4, wait=False)  # (a transfer reservation pulls them instead)
    assert b.head_of(HOST_TIER) is None
    assert ids(b.take([c("pull-2", 2, "P2")])) == ["pull-2"]


def test_an_eviction_copy_is_counted_past_the_limits() -> None:
    b = budget(blocks=4, per_peer=4)
    b.take([c("pull", 4, "P1")])
    b.force_move(TierMove.OFFLOAD, 2, 2 * KB)
    assert b.num_blocks == 6  # over the limit: nothing else starts until it is back under
    assert ids(b.take([c("pull-2", 1, "P1")])) == []
    b.end_move(TierMove.OFFLOAD, 2, 2 * KB)
    b.release(c("pull", 4, "P1"))
    assert (b.num_blocks, b.num_transfers) == (0, 0)


def test_an_oversized_onboard_waits_for_an_empty_budget_and_holds_pulls_back() -> None:
    b = budget(blocks=10, per_peer=8)
    b.take([c("pull-1", 3, "P1")])
    assert not onboard(b, "big", 9)  # over the lane limit on its own
    assert ids(b.take([c("pull-2", 1, "P2")])) == []  # nothing joins while it waits
    b.release(c("pull-1", 3, "P1"))
    assert onboard(b, "big", 9)  # alone (pull-2, younger, left room for it)
    assert b.head_of(HOST_TIER) is None and b.head_of(TRANSFERS) == c("pull-2", 1, "P2")
    assert ids(b.take([c("pull-2", 1, "P2")])) == ["pull-2"]  # fits beside it now
    assert b.head_of(TRANSFERS) is None
