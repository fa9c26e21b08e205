"""Controller logic without Ray: registry states, the planner's host interface, and which
workers a rebalance drains, over fake worker handles (tests/unit/deploy/controller_fakes.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray
from controller_fakes import DECODE, PREFILL, FakeHandle, controller, no_ray_kill  # noqa: F401

from deploy.control.cluster_spec import WorkerPlacement
from deploy.control.worker_registry import Registered
from planner.core import Role
from router.control import DrainRefused
from vocabulary.worker_api import WorkerRole, WorkerState


def test_rebalance_drains_the_youngest_worker_not_the_largest_id_string() -> None:
    c = controller(
        ("prefill-9", WorkerRole.PREFILL, 0),
        ("prefill-10", WorkerRole.PREFILL, 0),  # created later: "prefill-10" < "prefill-9"
        ("decode-11", WorkerRole.DECODE, 0),
    )
    report = asyncio.run(c.rebalance(1, 1, 5.0))
    assert (report.started, report.stopped, report.switched) == ((), ("prefill-10",), ())
    assert list(c.workers) == ["prefill-9", "decode-11"]
    assert report.message == "now 1 prefill + 1 decode (stopped ['prefill-10'])"


def test_rebalance_with_a_busy_worker_undrains_it_and_stops() -> None:
    c = controller(
        ("prefill-0", WorkerRole.PREFILL, 0),
        ("prefill-1", WorkerRole.PREFILL, 2),
        ("decode-2", WorkerRole.DECODE, 0),
    )
    report = asyncio.run(c.rebalance(1, 1, 0.0))
    assert (report.started, report.stopped) == ((), ())
    assert report.message == (
        "rebalance stopped: prefill-1 still had 2 requests in flight after 0s; "
        "it is back in service"
    )
    w = c.workers["prefill-1"]
    assert w.state == WorkerState.READY
    assert [c for c in w.handle.calls if c != "load"] == ["drain", "undrain"]


def test_planner_drain_then_stop_only_once_idle() -> None:
    c = controller(("prefill-0", WorkerRole.PREFILL, 0), ("prefill-1", WorkerRole.PREFILL, 1))

    async def scenario() -> list[str]:
        c.begin_drain("prefill-1")
        assert c.workers["prefill-1"].state == WorkerState.DRAINING
        assert c.wanted_placements() == [PREFILL]  # the draining one needs no room
        c.stop_when_drained("prefill-1")  # still busy: stays
        await asyncio.sleep(0.01)
        assert "prefill-1" in c.workers
        c.workers["prefill-1"].handle.inflight = 0
        c.stop_when_drained("prefill-1")
        await asyncio.sleep(0.01)
        return list(c.workers)

    assert asyncio.run(scenario()) == ["prefill-0"]
    assert any("prefill-1 still has in-flight work; not stopped" in e for _, e in c.events)
    assert any("worker prefill-1 stopped" in e for _, e in c.events)


def test_worker_snapshots_carry_role_age_state_and_load() -> None:
    c = controller(("prefill-0", WorkerRole.PREFILL, 3), ("decode-1", WorkerRole.DECODE, 0))
    c.workers["decode-1"].state = WorkerState.DRAINING
    snaps = asyncio.run(c.worker_snapshots())
    assert [(s.worker_id, s.role, s.ready_at_s, s.draining) for s in snaps] == [
        ("prefill-0", Role.PREFILL, 1000.0, False),
        ("decode-1", Role.DECODE, 1001.0, True),
    ]
    assert snaps[0].load is not None and snaps[0].load.inflight_requests == 3


def test_events_are_numbered_and_read_incrementally() -> None:
    c = controller()
    c.record_event("one")
    c.record_event("two")
    seq, lines = c.events_since(0)
    assert seq == 2 and [line.split(" ", 1)[1] for line in lines] == ["one", "two"]
    c.record_event("three")
    seq, lines = c.events_since(seq)
    assert seq == 3 and lines[0].endswith("three")
    assert c.events_since(seq) == (3, [])


def test_health_check_removes_an_unhealthy_worker_at_once_and_a_silent_one_after_retries() -> None:
    from vocabulary.worker_api import WorkerUnhealthy

    c = controller(("prefill-0", WorkerRole.PREFILL, 0), ("decode-1", WorkerRole.DECODE, 0))
    c.spec = dataclasses.replace(c.spec, replace_dead=False, failure_threshold=2)

    def unhealthy() -> str:
        raise WorkerUnhealthy("worker prefill-0: 3 engine steps failed in a row (last: X)")

    def silent() -> str:
        raise TimeoutError("no answer")

    c.workers["prefill-0"].handle._ping = unhealthy
    c.workers["decode-1"].handle._ping = silent
    assert asyncio.run(c.check_health()) == ["prefill-0"]
    assert any("worker prefill-0 is unhealthy (worker prefill-0: 3 engine steps" in e
               for e in c.recent_events())  # fmt: skip
    assert asyncio.run(c.check_health()) == ["decode-1"]  # the second failed check
    assert c.workers == {}


# ---- drain and undrain (issue 14: draining cut live streams, drained workers vanished) --------


def test_draining_and_drained_workers_stay_listed_for_routers() -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0), ("decode-1", WorkerRole.DECODE, 0))
    for w in c.workers.values():
        w.info = object()  # type: ignore[assignment]
    c.workers["decode-0"].state = WorkerState.DRAINING
    c.workers["decode-1"].state = WorkerState.DRAINED
    assert len(c.list_workers()) == 2


def test_drain_without_stop_leaves_a_drained_worker_that_undrain_puts_back() -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0), ("decode-1", WorkerRole.DECODE, 0))
    report = asyncio.run(c.drain("decode-1", stop=False, timeout_s=0.0))
    assert report.drained and not report.stopped and report.requests_at_start == 0
    assert c.workers["decode-1"].state == WorkerState.DRAINED
    assert "undrain decode-1" in report.message
    assert asyncio.run(c.undrain("decode-1")) == "decode-1 is ready again"
    assert c.workers["decode-1"].state == WorkerState.READY
    assert c.workers["decode-1"].handle.calls[-1] == "undrain"


def test_drain_past_its_timeout_with_stop_reports_the_requests_it_cut() -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0), ("decode-1", WorkerRole.DECODE, 3))
    report = asyncio.run(c.drain("decode-1", stop=True, timeout_s=0.0))
    assert not report.drained and report.stopped
    assert (report.requests_at_start, report.requests_cut) == (3, 3)
    assert "3 of 3 requests were still running" in report.message
    assert "decode-1" not in c.workers


@pytest.mark.parametrize("timeout_s", [-5.0, float("nan"), float("inf")])
def test_drain_refuses_a_bad_timeout_and_changes_nothing(timeout_s: float) -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0), ("decode-1", WorkerRole.DECODE, 0))
    with pytest.raises(DrainRefused, match="timeout_s: must be a finite number >= 0"):
        asyncio.run(c.drain("decode-1", stop=True, timeout_s=timeout_s))
    assert (
        c.workers["decode-1"].state == WorkerState.READY
        and c.workers["decode-1"].handle.calls == []
    )


def test_drain_refuses_the_last_ready_worker_of_a_role_unless_forced() -> None:
    c = controller(("prefill-0", WorkerRole.PREFILL, 0), ("decode-1", WorkerRole.DECODE, 0))
    with pytest.raises(DrainRefused, match="would leave no ready decode worker"):
        asyncio.run(c.drain("decode-1", stop=False, timeout_s=1.0))
    assert c.workers["decode-1"].state == WorkerState.READY
    report = asyncio.run(c.drain("decode-1", stop=False, timeout_s=1.0, force=True))
    assert report.drained and c.workers["decode-1"].state == WorkerState.DRAINED


def test_undrain_refuses_a_ready_or_unknown_worker() -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0))
    with pytest.raises(DrainRefused, match="not draining or drained"):
        asyncio.run(c.undrain("decode-0"))
    with pytest.raises(DrainRefused, match="unknown worker"):
        asyncio.run(c.undrain("decode-9"))


def test_rebalance_beyond_a_fixed_ray_is_refused_before_anything_drains(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "deploy.control.cluster_controller.ray.cluster_resources", lambda: {"decode": 2.0}
    )
    c = controller(("prefill-0", WorkerRole.PREFILL, 0), ("decode-1", WorkerRole.DECODE, 0))
    placement = WorkerPlacement(prefill=PREFILL, decode=DECODE)
    c.spec = dataclasses.replace(c.spec, fixed_capacity=True, placement=placement)
    with pytest.raises(DrainRefused, match="rebalance would start 2 decode"):
        asyncio.run(c.rebalance(0, 3, 5.0))
    assert set(c.workers) == {"prefill-0", "decode-1"}
    assert all(w.handle.calls == [] for w in c.workers.values())


# ---- what routers are sent (router/cluster_view.py ControllerDirectory) ---------------------


def test_routers_are_sent_the_workers_only_when_the_listed_incarnations_change() -> None:
    c = controller(("prefill-0", WorkerRole.PREFILL, 0), ("decode-1", WorkerRole.DECODE, 0))
    for w in c.workers.values():
        w.info = w.worker_id  # type: ignore[assignment]
    first = c.list_workers_if_changed(None)
    assert first is not None and first.signature == (
        ("prefill-0", 0.0, "prefill"), ("decode-1", 1.0, "decode")
    )  # fmt: skip
    assert [info for info, _ in first.workers] == ["prefill-0", "decode-1"]
    assert c.list_workers_if_changed(first.signature) is None
    c.workers["decode-1"].state = WorkerState.DRAINING  # still listed: routers read its state
    assert c.list_workers_if_changed(first.signature) is None
    c.workers["decode-1"].state = WorkerState.DRAINED
    assert c.list_workers_if_changed(first.signature) is None
    # A worker registered under an id given out before (a restarted controller): a new start.
    old = c.workers["decode-1"]
    again = Registered("decode-1", old.role, "decode-1", FakeHandle("decode-1", old.role), DECODE)  # type: ignore[arg-type]
    again.state, again.started_at = WorkerState.READY, 5.0
    c.workers["decode-1"] = again
    second = c.list_workers_if_changed(first.signature)
    assert second is not None and second.signature == (
        ("prefill-0", 0.0, "prefill"), ("decode-1", 5.0, "decode")
    )  # fmt: skip
    assert second.workers[1][1] is again.handle
    # A starting worker is not listed; once ready it is, and a removed one is gone.
    c.workers["decode-2"] = Registered(None, WorkerRole.DECODE, "decode-2", None, DECODE)
    assert c.list_workers_if_changed(second.signature) is None
    c.workers["decode-2"].info, c.workers["decode-2"].state = "decode-2", WorkerState.READY  # type: ignore[assignment]
    third = c.list_workers_if_changed(second.signature)
    assert third is not None and [w for w, _, _ in third.signature] == [
        "prefill-0", "decode-1", "decode-2"
    ]  # fmt: skip
    del c.workers["prefill-0"]
    fourth = c.list_workers_if_changed(third.signature)
    assert fourth is not None and [w for w, _, _ in fourth.signature] == ["decode-1", "decode-2"]


def test_health_check_removal_changes_what_routers_are_sent() -> None:
    c = controller(("decode-0", WorkerRole.DECODE, 0), ("decode-1", WorkerRole.DECODE, 0))
    c.spec = dataclasses.replace(c.spec, replace_dead=False)
    for w in c.workers.values():
        w.info = w.worker_id  # type: ignore[assignment]
    c.workers["decode-0"].handle._ping = lambda: "pong"
    held = c.list_workers_if_changed(None)
    assert held is not None

    def died() -> str:
        raise ray.exceptions.RayActorError()

    c.workers["decode-1"].handle._ping = died
    assert asyncio.run(c.check_health()) == ["decode-1"]
    after = c.list_workers_if_changed(held.signature)
    assert after is not None and after.signature == (("decode-0", 0.0, "decode"),)
