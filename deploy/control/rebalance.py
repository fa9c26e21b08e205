"""Drain and rebalance: how the controller (deploy/control/cluster_controller.py) takes a worker out
of service without losing a request, and moves capacity between roles.

A drained worker stops admitting, finishes its in-flight requests and leases, and only then
stops (or stays DRAINED, idle, until undrained); a drain refuses, unless forced, to leave a role
with no ready worker. A rebalance takes the youngest workers of a shrinking role (least
prefix cache to lose): where the other role grows, they switch to it in place
(deploy/control/role_switch.py: no restart, no model load), unless asked to `restart` or the
two roles' workers differ in shape; the rest are drained and stopped (their devices freed)
before the growing role starts new workers. A worker whose requests outlast the timeout goes
back into service and the rebalance stops there. These functions act on the controller's
registry; its actor methods call them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import ray

from deploy.control import role_switch
from deploy.control.worker_actors import rebalance_shortfall
from deploy.control.worker_registry import LISTED_STATES, WANTED_STATES, Registered, same_role
from router.control import DrainRefused, DrainReport, RebalanceReport
from vocabulary.waits import wait_within
from vocabulary.worker_api import WorkerInfo, WorkerRole, WorkerState

if TYPE_CHECKING:
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.controller_metrics import ControllerMetrics
    from planner.loop import PlannerLoop


class Controller(Protocol):
    """What drain and rebalance act on: the controller actor's registry, the spec its workers
    are made from, and its own steps for starting and stopping one (the controller actor,
    deploy/control/cluster_controller.py, is the one implementation)."""

    workers: dict[str, Registered]
    spec: ClusterSpec
    planner: PlannerLoop | None
    metrics: ControllerMetrics
    _lock: asyncio.Lock

    def _log(self, message: str) -> None: ...

    def _create_worker(self, role: WorkerRole) -> Registered: ...

    async def _await_ready(self, w: Registered) -> WorkerInfo: ...

    async def _stop(self, w: Registered) -> None: ...


async def drain(
    ctl: Controller, worker_id: str, stop: bool, timeout_s: float, force: bool = False
) -> DrainReport:
    """Stop admitting on a worker and let its running requests finish (up to
    `timeout_s`); with `stop`, stop it then (past the timeout that cuts what still runs:
    those streams end with UNAVAILABLE). Refuses, unless `force`, a drain that would
    leave the worker's role with no ready worker."""
    w = ctl.workers.get(worker_id)
    if w is None:
        raise DrainRefused(f"unknown worker {worker_id!r}")
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise DrainRefused(f"timeout_s: must be a finite number >= 0, got {timeout_s}")
    if w.state not in LISTED_STATES:
        raise DrainRefused(f"{worker_id} is {w.state.value}: only a ready worker can be drained")
    if w.switching_to is not None:
        raise DrainRefused(f"{worker_id} is switching to {w.switching_to.value}: drain it after")
    if w.state is WorkerState.READY and not force:
        others = [
            o for o in ctl.workers.values()
            if o is not w and o.state is WorkerState.READY and same_role(o.role, w.role)
        ]  # fmt: skip
        if not others:
            raise DrainRefused(
                f"draining {worker_id} would leave no ready {w.role.value} worker "
                "(requests would fail); add one first, or pass force to drain anyway"
            )
    at_start = await inflight(ctl, w)
    w.state = WorkerState.DRAINING
    ctl._log(f"draining {worker_id} ({at_start} requests in flight, {timeout_s:g}s)")
    drained = bool(await w.handle.drain.remote(timeout_s))
    left = 0 if drained else await inflight(ctl, w)
    if drained and not stop:
        w.state = WorkerState.DRAINED
        msg = (
            f"{worker_id} drained ({at_start} requests finished); idle and not admitting "
            f"(`pdserve undrain {worker_id}` puts it back)"
        )
    elif drained:
        await ctl._stop(w)
        msg = f"{worker_id} drained ({at_start} requests finished) and stopped"
    elif stop:
        await ctl._stop(w)
        msg = (
            f"{worker_id}: {left} of {at_start} requests were still running after "
            f"{timeout_s:g}s and were ended (UNAVAILABLE); stopped"
        )
    else:
        msg = (
            f"{worker_id} still has {left} requests in flight after {timeout_s:g}s; "
            "it stays draining (not admitting)"
        )
    ctl._log(msg)
    return DrainReport(
        drained, msg, at_start, left if stop else 0, stop and w.state is WorkerState.STOPPED
    )


async def undrain(ctl: Controller, worker_id: str) -> str:
    """Put a draining or drained (not stopped) worker back into service (not one that is
    switching role: its switch undrains it, or not, itself)."""
    w = ctl.workers.get(worker_id)
    if w is None:
        raise DrainRefused(f"unknown worker {worker_id!r}")
    if w.switching_to is not None:
        raise DrainRefused(f"{worker_id} is switching to {w.switching_to.value}")
    if w.state not in (WorkerState.DRAINING, WorkerState.DRAINED):
        raise DrainRefused(f"{worker_id} is {w.state.value}, not draining or drained")
    await w.handle.undrain.remote()
    w.state = WorkerState.READY
    ctl._log(f"{worker_id} undrained: admitting again")
    return f"{worker_id} is ready again"


async def inflight(ctl: Controller, w: Registered) -> int:
    try:
        load = await wait_within(w.handle.load.remote(), 2.0)
    except Exception:
        return 0
    return int(load.requests_held)


def num_wanted(workers: Iterable[Registered], role: WorkerRole) -> int:
    """How many of `workers` count towards `role`'s size (starting or ready, or switching to
    it)."""
    return sum(1 for w in workers if w.wanted_as is role)


def youngest_ready(ctl: Controller, role: WorkerRole, keep: int) -> list[Registered]:
    """The ready workers of `role` beyond the first `keep`, youngest first (least prefix
    cache to lose; ids sort as strings, "prefill-10" < "prefill-9", so by creation)."""
    current = [w for w in ctl.workers.values() if w.role is role and w.state is WorkerState.READY]
    ordered = sorted(current, key=lambda w: w.started_at, reverse=True)
    return ordered[: max(len(current) - keep, 0)]


def refuse_unplaceable(
    ctl: Controller,
    targets: dict[WorkerRole, int],
    to_stop: dict[WorkerRole, list[Registered]],
    switches: dict[str, tuple[Registered, WorkerRole]],
) -> None:
    """Raise DrainRefused when the new workers could never be placed on this Ray (the
    workers in `switches` stay, counted in their new role)."""
    leaving = {w.worker_id for ws in to_stop.values() for w in ws}
    staying = [w for w in ctl.workers.values() if w.worker_id not in leaving]
    roles = {w.worker_id: switches[w.worker_id][1] if w.worker_id in switches else w.role
             for w in staying}  # fmt: skip
    starting = []
    for role, n in targets.items():
        have = sum(1 for w in staying if roles[w.worker_id] is role and w.state in WANTED_STATES)
        starting += [(role.value, ctl.spec.worker_asks(role))] * max(n - have, 0)
    why = rebalance_shortfall(
        [(w.role.value, w.placement) for w in staying], starting, ray.cluster_resources()
    )
    if why is not None:
        raise DrainRefused(why)


def plan_switches(
    ctl: Controller, targets: dict[WorkerRole, int], to_stop: dict[WorkerRole, list[Registered]]
) -> dict[str, tuple[Registered, WorkerRole]]:
    """Workers of a shrinking role that switch to a growing one in place instead of stopping
    while another starts: as many as both roles need, of a shape the other role's workers
    share (`ClusterSpec.switch_refusal`). They leave `to_stop`; by worker id."""
    plan: dict[str, tuple[Registered, WorkerRole]] = {}
    for role, leaving in to_stop.items():
        for other, n in targets.items():
            moving = sum(1 for _, r in plan.values() if r is other)
            short = n - num_wanted(ctl.workers.values(), other) - moving
            if other is role or short <= 0 or ctl.spec.switch_refusal(role, other) is not None:
                continue
            plan.update((w.worker_id, (w, other)) for w in leaving[:short])
            del leaving[:short]
    return plan


async def rebalance(
    ctl: Controller, prefill: int, decode: int, timeout_s: float, restart: bool = False
) -> RebalanceReport:
    """Reach `prefill` prefill and `decode` decode workers, draining before stopping.

    Where one role shrinks while the other grows, its workers switch role in place (drain,
    flip, admit as the other role: deploy/control/role_switch.py), unless `restart` or their
    shape differs; the rest of a shrinking role is drained and stopped (freeing its devices),
    then growing roles start new workers. A worker is never stopped with requests in flight.
    """
    async with ctl._lock:
        targets = {WorkerRole.PREFILL: prefill, ctl.spec.decode_role: decode}
        to_stop = {role: youngest_ready(ctl, role, n) for role, n in targets.items()}
        switches = {} if restart else plan_switches(ctl, targets, to_stop)
        if ctl.spec.fixed_capacity:
            refuse_unplaceable(ctl, targets, to_stop, switches)
        stopped: list[str] = []
        switched: list[str] = []

        def stopped_early(why: str) -> RebalanceReport:
            return RebalanceReport((), tuple(stopped), tuple(switched), f"rebalance stopped: {why}")

        for w, role in switches.values():
            result = await role_switch.run_switch(ctl, w, role, timeout_s)
            if not result.switched:
                return stopped_early(result.message)
            switched.append(w.worker_id)
        for role in targets:
            for w in to_stop[role]:
                # Not cut: a worker whose requests outlast the timeout goes back to work
                # and the rebalance stops there ("no request is lost").
                report = await drain(ctl, w.worker_id, stop=False, timeout_s=timeout_s,
                                          force=True)  # fmt: skip
                if not report.drained:
                    with contextlib.suppress(Exception):
                        await w.handle.undrain.remote()
                    w.state = WorkerState.READY
                    left = await inflight(ctl, w)
                    return stopped_early(
                        f"{w.worker_id} still had {left} requests in flight after "
                        f"{timeout_s:g}s; it is back in service"
                    )
                await ctl._stop(w)
                stopped.append(w.worker_id)
        new: list[Registered] = []
        for role, n in targets.items():
            have = num_wanted(ctl.workers.values(), role)
            new += [ctl._create_worker(role) for _ in range(max(n - have, 0))]
        if ctl.planner is not None:  # room for the new workers on an autoscaling cluster
            ctl.planner.actuator.sync_resources()
        infos = await asyncio.gather(*(ctl._await_ready(w) for w in new))
        started = tuple(i.worker_id for i in infos)
        how = [f"switched {switched} in place"] if switched else []
        how += [f"{verb} {ids}" for verb, ids in (("stopped", stopped), ("started", list(started)))
                if ids]  # fmt: skip
        if started and stopped:
            how[-2] = f"by restart: {how[-2]}"
        msg = f"now {prefill} prefill + {decode} {ctl.spec.decode_role.value}"
        msg += f" ({'; '.join(how)})" if how else " (nothing to change)"
        ctl._log(f"rebalance: {msg}")
        return RebalanceReport(started, tuple(stopped), tuple(switched), msg)
