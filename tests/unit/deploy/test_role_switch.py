"""Role switches in the controller, without Ray (tests/unit/deploy/controller_fakes.py): each
refusal names what is wrong and changes nothing; a switch records the new role where routers,
the planner and a restarted controller read it; a rebalance switches where one role shrinks
while the other grows, and restarts where asked or where the shapes differ; the planner's
drain-one-role-add-the-other becomes a switch."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
from controller_fakes import controller, no_ray_kill  # noqa: F401

from deploy.control.cluster_controller import Controller
from deploy.control.cluster_spec import ClusterSpec
from deploy.control.worker_registry import Registered
from engine.config import EngineConfig
from planner.core import PlannerMemory, Role, RoleDecision, ScalingDecision, apply_decision
from planner.loop import ControllerActuator
from vocabulary.worker_api import RoleSwitchRefused, WorkerRole, WorkerState

P, D, S = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.SPLIT


def pd(*counts: int) -> Controller:
    """prefill-0.. then decode-N.. workers, ready and idle."""
    n_prefill, n_decode = counts
    roles = [P] * n_prefill + [D] * n_decode
    prefix = {P: "prefill", D: "decode"}
    return controller(*((f"{prefix[r]}-{i}", r, 0) for i, r in enumerate(roles)))


def unchanged(c: Controller, roles: dict[str, WorkerRole]) -> None:
    for wid, role in roles.items():
        w = c.workers[wid]
        assert (w.role, w.state, w.switching_to) == (role, WorkerState.READY, None), wid
        assert not any(call.startswith("switch_role") for call in w.handle.calls), wid


@pytest.mark.parametrize(
    ("worker_id", "role", "message"),
    [
        ("prefill-7", "decode", "worker_id: unknown worker 'prefill-7'"),
        ("prefill-0", "decoder", "role: one of prefill, decode, split, got 'decoder'"),
        ("prefill-0", "colocated",
         "role: this cluster runs prefill, decode, split workers, not colocated"),
        ("decode-2", "decode", "decode-2 is a decode worker already"),
    ],
)  # fmt: skip
def test_a_switch_naming_a_wrong_worker_or_role_is_refused(
    worker_id: str, role: str, message: str
) -> None:
    c = pd(2, 1)
    with pytest.raises(RoleSwitchRefused) as e:
        asyncio.run(c.switch(worker_id, role, 5.0))
    assert str(e.value) == message
    unchanged(c, {"prefill-0": P, "prefill-1": P, "decode-2": D})


def test_a_draining_or_switching_worker_is_refused_and_left_as_it_is() -> None:
    c = pd(2, 1)
    c.workers["prefill-1"].state = WorkerState.DRAINING
    with pytest.raises(RoleSwitchRefused, match=r"^prefill-1 is draining: only a ready worker "
                       r"switches \(`pdserve undrain prefill-1` first\)$"):  # fmt: skip
        asyncio.run(c.switch("prefill-1", "decode", 5.0))
    assert c.workers["prefill-1"].state is WorkerState.DRAINING
    c.workers["prefill-1"].state, c.workers["prefill-1"].switching_to = WorkerState.DRAINING, S
    with pytest.raises(RoleSwitchRefused, match=r"^prefill-1 is switching to split already$"):
        asyncio.run(c.switch("prefill-1", "decode", 5.0))
    assert c.workers["prefill-1"].handle.calls == []


def test_the_last_worker_of_a_role_is_refused_unless_forced_or_it_still_decodes() -> None:
    c = pd(1, 1)
    with pytest.raises(RoleSwitchRefused) as e:
        asyncio.run(c.switch("prefill-0", "decode", 5.0))
    assert str(e.value) == (
        "prefill-0 is the last ready prefill worker: switching it would leave none (add one "
        "first, or pass force)"
    )
    with pytest.raises(RoleSwitchRefused, match="last ready decode worker"):
        asyncio.run(c.switch("decode-1", "prefill", 5.0))
    unchanged(c, {"prefill-0": P, "decode-1": D})
    assert asyncio.run(c.switch("decode-1", "split", 5.0)).switched  # it decodes still
    assert asyncio.run(c.switch("prefill-0", "decode", 5.0, force=True)).switched


def test_a_shape_the_other_role_does_not_run_is_refused_naming_the_options() -> None:
    c = pd(2, 1)
    c.spec = dataclasses.replace(c.spec, prefill_tp=2)
    with pytest.raises(RoleSwitchRefused) as e:
        asyncio.run(c.switch("prefill-1", "decode", 5.0))
    assert str(e.value) == (
        "prefill-1 cannot switch to decode in place: prefill_tp/prefill_pp 2/1 "
        "(prefill_pp_layers []) differ from decode_tp/decode_pp 1/1 (decode_pp_layers []): a "
        "switch keeps a worker's ranks (`pdserve rebalance --restart` stops and starts "
        "workers instead)"
    )
    with pytest.raises(RoleSwitchRefused, match="a split worker runs on one device"):
        asyncio.run(c.switch("prefill-1", "split", 5.0))
    unchanged(c, {"prefill-0": P, "prefill-1": P, "decode-2": D})


def test_a_switch_records_the_new_role_for_routers_the_planner_and_metrics() -> None:
    c = pd(2, 1)
    for w in c.workers.values():
        w.info = w.worker_id  # type: ignore[assignment]
    before = c.list_workers_if_changed(None)
    assert before is not None
    done = asyncio.run(c.switch("prefill-1", "decode", 5.0))
    assert done.switched and done.info.role is D
    w = c.workers["prefill-1"]
    assert (w.role, w.state, w.info) == (D, WorkerState.READY, done.info)
    assert w.handle.calls == ["switch_role decode"]
    after = c.list_workers_if_changed(before.signature)  # routers refresh their entry
    assert after is not None and after.signature[1] == ("prefill-1", 1.0, "decode")
    snaps = asyncio.run(c.worker_snapshots())
    assert [(s.worker_id, s.role) for s in snaps] == [
        ("prefill-0", Role.PREFILL), ("prefill-1", Role.DECODE), ("decode-2", Role.DECODE)
    ]  # fmt: skip
    assert c.metrics.switches.labels("prefill", "decode", "true")._value.get() == 1
    assert any("switching prefill-1 from prefill to decode" in e for e in c.recent_events())


def test_a_switch_whose_requests_outlast_the_timeout_leaves_the_worker_in_its_role() -> None:
    c = controller(("prefill-0", P, 0), ("prefill-1", P, 3), ("decode-2", D, 0))
    done = asyncio.run(c.switch("prefill-1", "decode", 0.0))
    assert not done.switched and done.requests_at_start == 3
    w = c.workers["prefill-1"]
    assert (w.role, w.state, w.switching_to) == (P, WorkerState.READY, None)
    assert c.metrics.switches.labels("prefill", "decode", "false")._value.get() == 1


def test_a_worker_switching_is_a_starting_worker_of_its_new_role_to_the_planner() -> None:
    c = pd(2, 1)
    w = c.workers["prefill-1"]
    w.state, w.switching_to = WorkerState.DRAINING, D
    (snap,) = [s for s in asyncio.run(c.worker_snapshots()) if s.worker_id == "prefill-1"]
    assert (snap.role, snap.ready_at_s, snap.draining) == (Role.DECODE, None, False)


def test_drain_and_undrain_refuse_a_worker_that_is_switching() -> None:
    from router.control import DrainRefused

    c = pd(2, 1)
    c.workers["prefill-1"].state, c.workers["prefill-1"].switching_to = WorkerState.DRAINING, D
    with pytest.raises(DrainRefused, match="prefill-1 is switching to decode"):
        asyncio.run(c.drain("prefill-1", stop=True, timeout_s=1.0))
    with pytest.raises(DrainRefused, match="prefill-1 is switching to decode"):
        asyncio.run(c.undrain("prefill-1"))


# ---- rebalance ------------------------------------------------------------------------------


def test_rebalance_switches_the_youngest_worker_of_the_shrinking_role() -> None:
    c = pd(2, 1)
    report = asyncio.run(c.rebalance(1, 2, 5.0))
    assert (report.switched, report.started, report.stopped) == (("prefill-1",), (), ())
    assert report.message == "now 1 prefill + 2 decode (switched ['prefill-1'] in place)"
    assert [w.role for w in c.workers.values()] == [P, D, D]
    report = asyncio.run(c.rebalance(1, 2, 5.0))
    assert report.message == "now 1 prefill + 2 decode (nothing to change)"


def with_started_workers(c: Controller) -> list[str]:
    """Workers `c` creates register with fake handles that start at once."""
    created: list[str] = []

    def create(role: WorkerRole) -> Registered:
        from controller_fakes import DECODE, FakeHandle

        worker_id = f"{role.value}-new{len(created)}"
        handle = FakeHandle(worker_id, role)
        handle._start = lambda: handle._switch_role(role, 0.0).info  # type: ignore[attr-defined]
        created.append(worker_id)
        c.workers[worker_id] = Registered(None, role, worker_id, handle, DECODE)
        return c.workers[worker_id]

    c._create_worker = create  # type: ignore[method-assign]
    return created


@pytest.mark.parametrize("restart", [True, False])
def test_rebalance_restarts_when_asked_or_when_the_shapes_differ(restart: bool) -> None:
    c = pd(2, 1)
    if not restart:
        c.spec = dataclasses.replace(c.spec, prefill_tp=2)
    created = with_started_workers(c)
    report = asyncio.run(c.rebalance(1, 2, 5.0, restart=restart))
    assert (report.switched, report.stopped, report.started) == (
        (),
        ("prefill-1",),
        ("decode-new0",),
    )
    assert created == ["decode-new0"]
    assert report.message == (
        "now 1 prefill + 2 decode (by restart: stopped ['prefill-1']; started ['decode-new0'])"
    )


def test_plan_switches_moves_only_as_many_as_the_growing_role_lacks() -> None:
    from deploy.control.rebalance import plan_switches, youngest_ready

    c = pd(3, 1)
    targets = {P: 1, D: 2}
    to_stop = {role: youngest_ready(c, role, n) for role, n in targets.items()}
    plan = plan_switches(c, targets, to_stop)
    assert {wid: role for wid, (_, role) in plan.items()} == {"prefill-2": D}
    assert [w.worker_id for w in to_stop[P]] == ["prefill-1"]  # drained and stopped


def test_switch_roles_of_a_colocated_cluster_leave_out_prefill() -> None:
    spec = ClusterSpec(engine=EngineConfig(model_dir="unused"), colocated=True)
    assert spec.switch_roles == (WorkerRole.COLOCATED, WorkerRole.SPLIT)


# ---- the planner ----------------------------------------------------------------------------


class SwitchingRecorder:
    def __init__(self, refuse: Sequence[str] = ()) -> None:
        self.calls: list[tuple[str, Role, object]] = []
        self.refuse = set(refuse)

    def add_workers(self, role: Role, count: int) -> None:
        self.calls.append(("add", role, count))

    def drain_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        self.calls.append(("drain", role, tuple(worker_ids)))

    def stop_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        self.calls.append(("stop", role, tuple(worker_ids)))

    def switch_workers(self, role: Role, worker_ids: Sequence[str]) -> list[str]:
        self.calls.append(("switch", role, tuple(worker_ids)))
        return [w for w in worker_ids if w not in self.refuse]


def decision(prefill: RoleDecision, decode: RoleDecision) -> ScalingDecision:
    return ScalingDecision(tick=3, prefill=prefill, decode=decode, memory=PlannerMemory())


def test_planner_drain_of_one_role_and_add_of_the_other_become_switches() -> None:
    act = SwitchingRecorder(refuse=["p3"])
    apply_decision(
        decision(
            RoleDecision(Role.PREFILL, drain=("p1", "p2", "p3"), stop=("p0",)),
            RoleDecision(Role.DECODE, add=2),
        ),
        act,
    )
    assert act.calls == [
        ("switch", Role.DECODE, ("p1", "p2")),  # as many as decode adds
        ("stop", Role.PREFILL, ("p0",)),
        ("drain", Role.PREFILL, ("p3",)),
    ]
    act = SwitchingRecorder(refuse=["d1"])
    apply_decision(
        decision(RoleDecision(Role.PREFILL, add=1), RoleDecision(Role.DECODE, drain=("d1",))),
        act,
    )
    assert act.calls == [  # refused: drained and replaced as before
        ("switch", Role.PREFILL, ("d1",)),
        ("add", Role.PREFILL, 1),
        ("drain", Role.DECODE, ("d1",)),
    ]


def test_the_controller_actuator_switches_through_the_controller() -> None:
    c = pd(2, 1)

    async def scenario() -> list[str]:
        actuator = ControllerActuator(c, WorkerRole.DECODE, None)
        switched = actuator.switch_workers(Role.DECODE, ["prefill-1", "decode-2"])
        await asyncio.sleep(0.05)
        return switched

    assert asyncio.run(scenario()) == ["prefill-1"]  # decode-2 is a decode worker already
    assert c.workers["prefill-1"].role is D
    assert any("no switch (decode-2 is a decode worker already)" in e for e in c.recent_events())
