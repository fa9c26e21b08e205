"""One transfer's failure stays with that transfer: bad request ids and raising backends."""

from __future__ import annotations

from collections import Counter

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
from kv_transfer import manager as manager_module
from kv_transfer.config import BudgetConfig, KVTransferConfig
from kv_transfer.manager import TransferManager, TransferOutcome, TransferState
from kv_transfer.plan import plan_transfer
from kv_transfer.protocol import NoticeKind, decode_notice
from vocabulary.transfer_errors import TransferCancelled, TransferError, TransferTimeout

CONFIG = KVTransferConfig(
    budget=BudgetConfig(max_inflight_blocks=8, max_inflight_bytes=1 << 30),
    transfer_timeout_s=5.0,
    heartbeat_interval_s=1.0,
    lease_extension_s=10.0,
    lease_safety_margin_s=0.5,
)
S = TransferState
BAD_ID = "bad\x1fid"


class Harness:
    """A manager on loopback agent "D" pulling one-block transfers from agent "P"."""

    def __init__(self, auto_complete: bool = True) -> None:
        self.clock = FakeClock()
        self.fabric = LoopbackFabric(auto_complete=auto_complete)
        self.prefill_cache = filled_cache(seed=1)
        self.decode_cache = KVCache(SPEC)
        self.prefill = LoopbackBackend(self.fabric, "P", self.prefill_cache)
        self.decode = LoopbackBackend(self.fabric, "D", self.decode_cache)
        self.outcomes: list[TransferOutcome] = []
        self.via_on_failed: list[str] = []  # request ids whose blocks went back to the worker

        def on_failed(outcome: TransferOutcome) -> None:
            self.via_on_failed.append(outcome.request_id)
            self.outcomes.append(outcome)

        self.manager = TransferManager(
            self.decode, CONFIG, COMPAT, self.outcomes.append, on_failed, self.clock
        )
        self.decode.add_peer("P", b"P", self.prefill.memory_region())
        self.manager.add_peer("P")
        self.notices: list[tuple[NoticeKind, tuple[str, ...]]] = []

    def submit(self, rid: str, remote: int, local: int, num_blocks: int = 1) -> None:
        blocks = tuple(range(remote, remote + num_blocks))
        handle = make_handle(rid, blocks, lease_deadline=self.clock() + 30.0)
        plan = plan_transfer(handle, list(range(local, local + num_blocks)), SPEC.block_nbytes)
        self.manager.submit(handle, plan)

    def step(self) -> None:
        """One step, then the invariants every step must leave behind."""
        self.manager.step()
        for t in self.manager._queued.values():
            assert t.state is S.QUEUED and t.xfer is None
        for t in self.manager._transferring.values():
            assert t.state is S.TRANSFERRING and t.xfer is not None
        for n in self.prefill.get_notifs():
            notice = decode_notice(n.message)
            assert notice is not None
            self.notices.append((notice.kind, notice.request_ids))

    def run_until_idle(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not self.manager.has_work:
                return
            self.step()
        raise AssertionError(f"transfers still active after {max_steps} steps")

    def outcome(self, rid: str) -> TransferOutcome:
        (out,) = [o for o in self.outcomes if o.request_id == rid]
        return out

    def assert_idle_with_no_budget_held(self, reads_left: int = 0) -> None:
        load = self.manager.load()
        assert (load.in_flight_transfers, load.in_flight_blocks, load.in_flight_bytes) == (0, 0, 0)
        assert load.queued_transfers == 0 and not self.manager.has_work
        assert len(self.decode.reads) == reads_left  # the others released or aborted


def test_request_id_with_separator_fails_alone_and_transfers_around_it_complete() -> None:
    h = Harness()
    before = [f"before-{i}" for i in range(20)]
    after = [f"after-{i}" for i in range(20)]
    for i, rid in enumerate(before):
        h.submit(rid, remote=i, local=i)
    h.step()  # some of `before` in flight, the rest queued, when the bad id arrives
    h.submit(BAD_ID, remote=40, local=50)
    for i, rid in enumerate(after):
        h.submit(rid, remote=20 + i, local=20 + i)
    h.run_until_idle()

    assert Counter(o.request_id for o in h.outcomes) == Counter([*before, BAD_ID, *after])
    bad = h.outcome(BAD_ID)
    assert bad.state is S.FAILED and type(bad.error) is TransferError
    assert str(bad.error) == (
        "request 'bad\\x1fid' cannot be pulled: request id 'bad\\x1fid' is empty or contains \\x1f"
    )
    assert bad.plan.local_block_ids == (50,)  # what on_failed hands back to the worker
    assert h.via_on_failed == [BAD_ID]
    assert torch.equal(h.decode_cache.tensor[:40], h.prefill_cache.tensor[:40])
    assert h.manager.state_of(BAD_ID) is None  # rejected: it never entered the tables
    h.assert_idle_with_no_budget_held()
    stats = h.manager.stats()
    assert (stats.transfers_done, stats.transfers_failed, stats.unexpected_errors) == (40, 1, 0)


def test_queued_id_that_cannot_be_encoded_fails_at_heartbeat_and_others_are_kept_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(auto_complete=False)
    h.submit("big", remote=0, local=0, num_blocks=8)  # fills the budget: the rest stays queued
    h.step()
    with monkeypatch.context() as m:  # an id that got past submit's check (defence in depth)
        m.setattr(manager_module, "_notice_id_problem", lambda rid: None, raising=False)
        h.submit("q0", remote=10, local=10)
        h.submit(BAD_ID, remote=11, local=11)
        h.submit("q1", remote=12, local=12)
    h.clock.advance(CONFIG.heartbeat_interval_s)
    h.step()

    bad = h.outcome(BAD_ID)
    assert bad.state is S.FAILED and type(bad.error) is TransferError
    assert str(bad.error).startswith(
        "request bad\x1fid: encoding its heartbeat raised ValueError: request id"
    )
    assert h.notices == [(NoticeKind.HEARTBEAT, ("q0", "q1"))]
    states = [h.manager.state_of(r) for r in ("big", "q0", "q1")]
    assert states == [S.TRANSFERRING, S.QUEUED, S.QUEUED]
    h.fabric.auto_complete = True
    h.fabric.complete("big")
    h.run_until_idle()
    assert sorted((o.request_id, o.state) for o in h.outcomes) == [
        (BAD_ID, S.FAILED),
        ("big", S.DONE),
        ("q0", S.DONE),
        ("q1", S.DONE),
    ]
    h.assert_idle_with_no_budget_held()


def test_id_that_cannot_be_encoded_at_start_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness()
    with monkeypatch.context() as m:
        m.setattr(manager_module, "_notice_id_problem", lambda rid: None, raising=False)
        for i, rid in enumerate(["a", BAD_ID, "b"]):
            h.submit(rid, remote=i, local=i)
    h.run_until_idle()

    bad = h.outcome(BAD_ID)
    assert bad.state is S.FAILED and isinstance(bad.error.__cause__, ValueError)
    assert str(bad.error).startswith("request bad\x1fid: starting its read raised ValueError")
    assert [(o.request_id, o.state) for o in h.outcomes if o.request_id != BAD_ID] == [
        ("a", S.DONE),
        ("b", S.DONE),
    ]
    h.assert_idle_with_no_budget_held()


def test_unexpected_backend_exceptions_fail_only_their_own_transfer() -> None:
    h = Harness()
    h.fabric.raise_once("start_read", "r03", RuntimeError("nic on fire"))
    h.fabric.raise_once("poll", "r07", KeyError(7))
    h.fabric.raise_once("release", "r11", RuntimeError("double free"))
    rids = [f"r{i:02d}" for i in range(24)]
    for i, rid in enumerate(rids):
        h.submit(rid, remote=i, local=i)
    h.run_until_idle()  # every step returns (none raises)

    assert Counter(o.request_id for o in h.outcomes) == Counter(rids)  # one outcome each
    failed = {o.request_id: str(o.error) for o in h.outcomes if o.state is not S.DONE}
    assert failed == {
        "r03": "request r03: starting its read raised RuntimeError: nic on fire",
        "r07": "request r07: polling its read raised KeyError: 7",
        "r11": "request r11: releasing its finished read raised RuntimeError: double free",
    }
    for rid in failed:
        out = h.outcome(rid)
        assert out.state is S.FAILED and type(out.error) is TransferError
        assert out.plan.local_block_ids == (int(rid[1:]),)
    assert isinstance(h.outcome("r07").error.__cause__, KeyError)  # type: ignore[union-attr]
    assert sorted(h.via_on_failed) == ["r03", "r07", "r11"]
    aborts = sorted(ids[0] for kind, ids in h.notices if kind is NoticeKind.ABORT)
    assert aborts == ["r03", "r07", "r11"]
    dones = sorted(ids[0] for kind, ids in h.notices if kind is NoticeKind.DONE)
    assert dones == sorted(set(rids) - {"r03"})  # r07, r11: the reads themselves had landed
    h.assert_idle_with_no_budget_held()
    stats = h.manager.stats()
    assert (stats.transfers_done, stats.transfers_failed, stats.unexpected_errors) == (21, 3, 3)


def test_descriptor_count_raising_is_only_missing_telemetry() -> None:
    h = Harness()
    h.fabric.raise_once("descriptor_count", "a", RuntimeError("no telemetry"))
    h.submit("a", remote=0, local=0)
    h.submit("b", remote=1, local=1)
    h.run_until_idle()
    assert [(o.request_id, o.state, o.posted_descriptors) for o in h.outcomes] == [
        ("a", S.DONE, None),
        ("b", S.DONE, 1),
    ]
    assert h.manager.stats().unexpected_errors == 1


def test_abort_that_raises_still_ends_the_transfer_once_with_its_own_reason() -> None:
    h = Harness(auto_complete=False)
    h.submit("slow", remote=0, local=0)
    h.submit("other", remote=1, local=1)
    h.step()
    h.fabric.raise_once("abort", "slow", RuntimeError("abort broken"))
    h.manager.cancel("other")  # a normal abort next to it
    h.clock.advance(CONFIG.transfer_timeout_s)
    h.step()
    h.step()
    assert [(o.request_id, o.state, type(o.error)) for o in h.outcomes] == [
        ("other", S.FAILED, TransferCancelled),
        ("slow", S.EXPIRED, TransferTimeout),
    ]
    h.assert_idle_with_no_budget_held(reads_left=1)  # the broken backend still holds "slow"'s
    assert h.manager.stats().unexpected_errors == 1


def test_heartbeat_send_raising_is_contained_and_the_next_beat_goes_out() -> None:
    h = Harness(auto_complete=False)
    h.submit("big", remote=0, local=0, num_blocks=8)
    h.submit("q", remote=10, local=10)
    h.step()
    real_send = h.decode.send_notif
    calls = {"n": 0}

    def flaky_send(agent_name: str, message: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("socket gone")
        real_send(agent_name, message)

    h.decode.send_notif = flaky_send  # type: ignore[method-assign]
    h.clock.advance(CONFIG.heartbeat_interval_s)
    h.step()  # the beat raises: logged and counted, nothing fails
    h.clock.advance(CONFIG.heartbeat_interval_s)
    h.step()
    assert h.outcomes == [] and h.notices == [(NoticeKind.HEARTBEAT, ("q",))]
    assert h.manager.stats().unexpected_errors == 1
