"""In-flight budget: FCFS admission over block counts, per-peer limits, oversized requests."""

from __future__ import annotations

from kv_transfer.budget import Candidate, InFlightBudget
from kv_transfer.config import BudgetConfig
from kv_transfer.types import PeerLoad

KB = 1024


def budget(
    blocks: int = 10, per_peer: int = 10, nbytes: int = 10**9, per_peer_bytes: int = 10**9
) -> InFlightBudget:
    return InFlightBudget(BudgetConfig(blocks, nbytes, per_peer, per_peer_bytes))


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
