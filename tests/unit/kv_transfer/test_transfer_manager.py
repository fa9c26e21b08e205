"""The decode-side transfer state machine, driven step by step with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvt_factories import (
    COMPAT,
    SPEC,
    FakeClock,
    LoopbackBackend,
    LoopbackFabric,
    filled_cache,
    make_handle,
)

from engine.kv.kv_cache import KVCache
from kv_transfer.config import BudgetConfig, KVTransferConfig
from kv_transfer.manager import TransferManager, TransferOutcome, TransferState
from kv_transfer.plan import plan_transfer
from kv_transfer.protocol import NoticeKind, decode_notice
from vocabulary.kv_handle import KVHandle
from vocabulary.transfer_errors import (
    HandshakeError,
    LeaseExpired,
    PeerLost,
    TransferCancelled,
    TransferError,
    TransferTimeout,
    UnknownPeer,
)

CONFIG = KVTransferConfig(
    budget=BudgetConfig(max_inflight_blocks=4, max_inflight_bytes=1 << 30),
    transfer_timeout_s=5.0,
    heartbeat_interval_s=1.0,
    lease_extension_s=10.0,
    lease_safety_margin_s=0.5,
)
S = TransferState


class Harness:
    """A manager on a loopback decode agent "D" pulling from a prefill agent "P"."""

    def __init__(self, config: KVTransferConfig = CONFIG, auto_complete: bool = False) -> None:
        self.clock = FakeClock()
        self.fabric = LoopbackFabric(auto_complete=auto_complete)
        self.prefill_cache = filled_cache(seed=1)
        self.decode_cache = KVCache(SPEC)
        self.prefill = LoopbackBackend(self.fabric, "P", self.prefill_cache)
        self.decode = LoopbackBackend(self.fabric, "D", self.decode_cache)
        self.outcomes: list[TransferOutcome] = []
        self.manager = TransferManager(
            self.decode, config, COMPAT, self.outcomes.append, self.outcomes.append, self.clock
        )
        self.decode.add_peer("P", b"P", self.prefill.memory_region())
        self.manager.add_peer("P")

    def handle(self, rid: str, blocks: tuple[int, ...], lease_s: float = 30.0) -> KVHandle:
        return make_handle(rid, blocks, lease_deadline=self.clock() + lease_s)

    def submit(
        self, handle: KVHandle, local: list[int], reused: int = 0, deadline: float | None = None
    ) -> None:
        plan = plan_transfer(handle, local, SPEC.block_nbytes, reused)
        self.manager.submit(handle, plan, deadline)

    def notices_at_prefill(self) -> list[tuple[NoticeKind, tuple[str, ...], float]]:
        out = []
        for n in self.prefill.get_notifs():
            notice = decode_notice(n.message)
            assert notice is not None
            out.append((notice.kind, notice.request_ids, notice.lease_deadline))
        return out

    def states(self) -> list[tuple[str, TransferState, type | None]]:
        return [(o.request_id, o.state, type(o.error) if o.error else None) for o in self.outcomes]


def test_transfer_goes_queued_then_transferring_then_done_and_bytes_land() -> None:
    h = Harness()
    h.submit(h.handle("r", (5, 6, 9)), [20, 21, 30])
    assert h.manager.state_of("r") is S.QUEUED
    h.manager.step()
    assert h.manager.state_of("r") is S.TRANSFERRING
    assert h.manager.load().in_flight_blocks == 3
    h.clock.advance(0.25)
    assert h.fabric.complete("r")
    h.manager.step()
    assert h.states() == [("r", S.DONE, None)]
    out = h.outcomes[0]
    assert (out.transfer_s, out.queue_wait_s, out.posted_descriptors) == (0.25, 0.0, 2)
    assert torch.equal(h.decode_cache.tensor[[20, 21, 30]], h.prefill_cache.tensor[[5, 6, 9]])
    assert h.notices_at_prefill() == [(NoticeKind.DONE, ("r",), 0.0)]
    assert h.manager.load().in_flight_blocks == 0 and not h.manager.has_work
    stats = h.manager.stats()
    assert (stats.transfers_done, stats.blocks_transferred, stats.descriptors) == (1, 3, 2)
    assert stats.bytes_transferred == 3 * SPEC.block_nbytes


def test_budget_defers_then_admits_in_submission_order() -> None:
    h = Harness()  # 4 blocks in flight at most
    h.submit(h.handle("a", (1, 2, 3)), [10, 11, 12])
    h.submit(h.handle("b", (4, 5)), [13, 14])
    h.submit(h.handle("c", (6,)), [15])  # would fit next to a, but may not overtake b
    h.manager.step()
    assert [h.manager.state_of(r) for r in "abc"] == [S.TRANSFERRING, S.QUEUED, S.QUEUED]
    h.clock.advance(0.1)
    h.fabric.complete("a")
    h.manager.step()  # a done; b and c (2 + 1 blocks) start together
    assert [h.manager.state_of(r) for r in "abc"] == [S.DONE, S.TRANSFERRING, S.TRANSFERRING]
    assert h.outcomes[0].request_id == "a"
    h.fabric.complete("c")
    h.fabric.complete("b")
    h.manager.step()
    assert sorted(h.states()) == [("a", S.DONE, None), ("b", S.DONE, None), ("c", S.DONE, None)]
    assert [o.queue_wait_s for o in h.outcomes] == pytest.approx([0.0, 0.1, 0.1])
    stats = h.manager.stats()
    assert (stats.deferred_requests, stats.budget_limited_passes, stats.oversized_requests) == (
        2,
        1,
        0,
    )


def test_oversized_request_runs_alone_when_nothing_else_is_in_flight() -> None:
    h = Harness()
    h.submit(h.handle("small", (1,)), [10])
    h.submit(h.handle("big", (2, 3, 4, 5, 6)), [11, 12, 13, 14, 15])  # 5 > 4 blocks
    h.manager.step()
    assert h.manager.state_of("big") is S.QUEUED
    h.fabric.complete("small")
    h.manager.step()
    assert h.manager.state_of("big") is S.TRANSFERRING
    assert h.manager.load().in_flight_blocks == 5
    assert h.manager.stats().oversized_requests == 1


def test_deadline_while_queued_expires_with_timeout_and_tells_prefill() -> None:
    h = Harness()
    h.submit(h.handle("a", (1, 2, 3, 4)), [10, 11, 12, 13])
    h.submit(h.handle("b", (5,)), [14], deadline=h.clock() + 2.0)
    h.manager.step()
    h.clock.advance(2.0)
    h.manager.step()
    assert h.states() == [("b", S.EXPIRED, TransferTimeout)]
    assert h.outcomes[0].plan.local_block_ids == (14,)
    assert (NoticeKind.ABORT, ("b",), 0.0) in h.notices_at_prefill()
    assert h.manager.state_of("b") is S.EXPIRED and h.manager.load().queued_transfers == 0


def test_deadline_in_flight_aborts_the_read_and_a_late_completion_is_ignored() -> None:
    h = Harness()
    h.submit(h.handle("r", (1, 2)), [10, 11], deadline=h.clock() + 1.0)
    h.manager.step()
    h.clock.advance(1.0)
    h.manager.step()
    assert h.states() == [("r", S.EXPIRED, TransferTimeout)]
    assert h.manager.load().in_flight_blocks == 0
    assert not h.fabric.complete("r")  # the read was aborted: nothing can complete it
    h.manager.step()
    assert len(h.outcomes) == 1 and h.manager.cancel("r") is False


def test_abort_that_cannot_complete_keeps_blocks_held_until_it_can() -> None:
    h = Harness()
    h.submit(h.handle("r", (1, 2)), [10, 11], deadline=h.clock() + 1.0)
    h.manager.step()
    h.fabric.abort_fails = True
    h.clock.advance(1.0)
    h.manager.step()
    h.manager.step()
    assert h.outcomes == [] and h.manager.load().in_flight_blocks == 2
    h.fabric.abort_fails = False
    h.manager.step()
    assert h.states() == [("r", S.EXPIRED, TransferTimeout)]
    assert h.manager.load().in_flight_blocks == 0


def test_lease_too_close_to_its_end_fails_with_lease_expired() -> None:
    h = Harness()
    h.submit(h.handle("r", (1,), lease_s=0.4), [10])  # less than the 0.5 s margin left
    h.manager.step()
    assert h.states() == [("r", S.EXPIRED, LeaseExpired)]


def test_in_flight_read_is_aborted_before_the_lease_ends() -> None:
    h = Harness()
    h.submit(h.handle("r", (1,), lease_s=3.0), [10], deadline=h.clock() + 60)
    h.manager.step()
    h.clock.advance(2.5)  # lease end 3.0 - margin 0.5
    h.manager.step()
    assert h.states() == [("r", S.EXPIRED, LeaseExpired)]


def test_heartbeats_extend_the_leases_of_queued_transfers_only() -> None:
    h = Harness()
    h.submit(h.handle("a", (1, 2, 3, 4)), [10, 11, 12, 13])
    h.submit(h.handle("b", (5,), lease_s=2.0), [14])
    h.submit(h.handle("c", (6,), lease_s=2.0), [15])
    h.manager.step()  # a in flight, b and c queued
    h.clock.advance(1.0)
    h.manager.step()
    assert h.notices_at_prefill() == [(NoticeKind.HEARTBEAT, ("b", "c"), h.clock() + 10.0)]
    h.clock.advance(1.4)  # past the handles' own lease (2.0 - 0.5): alive through heartbeats
    h.manager.step()
    assert [h.manager.state_of(r) for r in "abc"] == [S.TRANSFERRING, S.QUEUED, S.QUEUED]
    assert h.manager.stats().heartbeats_sent == 2 and h.outcomes == []


def test_read_error_fails_only_that_transfer() -> None:
    h = Harness()
    h.submit(h.handle("bad", (1,)), [10])
    h.submit(h.handle("good", (2,)), [11])
    h.manager.step()
    h.fabric.fail("bad")
    h.fabric.complete("good")
    h.manager.step()
    assert sorted(h.states()) == [("bad", S.FAILED, TransferError), ("good", S.DONE, None)]


def test_lost_peer_fails_every_transfer_from_it_and_forgets_it() -> None:
    h = Harness()
    h.submit(h.handle("a", (1, 2, 3)), [10, 11, 12])
    h.submit(h.handle("b", (4, 5)), [13, 14])
    h.manager.step()
    h.fabric.kill("P")
    h.manager.step()
    assert sorted(h.states()) == [("a", S.FAILED, PeerLost), ("b", S.FAILED, PeerLost)]
    assert "P" not in h.manager.peers and h.manager.load().in_flight_blocks == 0
    h.submit(h.handle("c", (6,)), [15])
    assert h.states()[-1] == ("c", S.FAILED, UnknownPeer)


def test_lost_peer_with_several_reads_in_flight_fails_each_exactly_once() -> None:
    h = Harness()
    h.submit(h.handle("a", (1, 2)), [10, 11])
    h.submit(h.handle("b", (3, 4)), [12, 13])
    h.manager.step()
    assert h.manager.load().in_flight_transfers == 2
    h.fabric.kill("P")
    h.manager.step()
    h.manager.step()
    assert sorted(h.states()) == [("a", S.FAILED, PeerLost), ("b", S.FAILED, PeerLost)]
    assert h.manager.load().in_flight_blocks == 0


def test_cancel_fails_queued_and_in_flight_transfers_once() -> None:
    h = Harness()
    h.submit(h.handle("a", (1, 2, 3, 4)), [10, 11, 12, 13])
    h.submit(h.handle("b", (5,)), [14])
    h.manager.step()
    assert h.manager.cancel("b") and h.manager.cancel("a")
    assert not h.manager.cancel("a") and not h.manager.cancel("nope")
    assert h.states() == [("b", S.FAILED, TransferCancelled), ("a", S.FAILED, TransferCancelled)]


def test_unpullable_submissions_fail_at_once_without_touching_state() -> None:
    h = Harness()
    h.submit(h.handle("a", (1,)), [10])
    other = dataclasses.replace(h.handle("x", (2,)), compat_hash="0" * 32)
    h.submit(other, [11])
    h.submit(dataclasses.replace(h.handle("y", (3,)), agent_name="Q"), [12])
    h.submit(h.handle("a", (4,)), [13])  # duplicate of an active request
    assert h.states() == [
        ("x", S.FAILED, HandshakeError),
        ("y", S.FAILED, UnknownPeer),
        ("a", S.FAILED, TransferError),
    ]
    assert h.outcomes[2].plan.local_block_ids == (13,)
    assert h.manager.state_of("a") is S.QUEUED


def test_fully_reused_prefix_is_done_without_a_read() -> None:
    h = Harness()
    handle = h.handle("r", (1, 2))
    h.manager.submit(handle, plan_transfer(handle, [], SPEC.block_nbytes, num_reused=2))
    assert h.states() == [("r", S.DONE, None)]
    assert h.notices_at_prefill() == [(NoticeKind.DONE, ("r",), 0.0)]
    assert h.manager.stats().blocks_reused == 2


def test_close_cancels_everything() -> None:
    h = Harness()
    h.submit(h.handle("a", (1,)), [10])
    h.manager.step()
    h.submit(h.handle("b", (2,)), [11])
    h.manager.close()
    assert sorted(h.states()) == [
        ("a", S.FAILED, TransferCancelled),
        ("b", S.FAILED, TransferCancelled),
    ]


def test_a_raising_callback_does_not_break_the_manager() -> None:
    h = Harness(auto_complete=True)
    calls: list[str] = []

    def boom(outcome: TransferOutcome) -> None:
        calls.append(outcome.request_id)
        raise RuntimeError("worker bug")

    h.manager._on_done = boom
    h.submit(h.handle("a", (1,)), [10])
    h.submit(h.handle("b", (2,)), [11])
    h.manager.step()
    h.manager.step()
    assert calls == ["a", "b"] and not h.manager.has_work


@pytest.mark.parametrize("queued", [0, 2])
def test_step_asks_for_busy_polling_only_while_reads_are_in_flight(queued: int) -> None:
    h = Harness()
    assert h.manager.step() == CONFIG.idle_tick_s
    h.submit(h.handle("a", (1, 2, 3, 4)), [10, 11, 12, 13])
    for i in range(queued):
        h.submit(h.handle(f"q{i}", (5 + i,)), [20 + i])
    assert h.manager.step() == CONFIG.busy_poll_s


def test_transfer_time_counts_the_post_itself() -> None:
    # a backend may move bytes inside start_read (NIXL posts, a synchronous copy): that time
    # is transfer time, not queue wait
    h = Harness()
    start_read = h.decode.start_read

    def slow_post(plan, notif):  # type: ignore[no-untyped-def]
        h.clock.advance(0.5)
        return start_read(plan, notif)

    h.decode.start_read = slow_post  # type: ignore[method-assign]
    h.submit(h.handle("r", (5, 6)), [20, 21])
    h.manager.step()
    h.clock.advance(0.25)
    assert h.fabric.complete("r")
    h.manager.step()
    out = h.outcomes[0]
    assert (out.transfer_s, out.queue_wait_s) == (0.75, 0.0)
