"""Drain and rebalance: how the controller (deploy/control/cluster_controller.py) takes a worker out
of service without losing a request, and moves capacity between roles.

A drained worker stops admitting, finishes its in-flight requests and leases, and only then
stops (or stays DRAINED, idle, until undrained); a drain refuses, unless forced, to leave a role
with no ready worker. A rebalance drains and stops the youngest workers of a shrinking role
first (least prefix cache to lose, and their devices freed), then starts the growing role's;
a worker whose requests outlast the timeout goes back into service and the rebalance stops
there. These functions act on the controller's registry; its actor methods call them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import ray

from deploy.control.worker_actors import rebalance_shortfall
from deploy.control.worker_registry import LISTED_STATES, WANTED_STATES, Registered, same_role
from router.control import DrainRefused, DrainReport
from vocabulary.waits import wait_within
from vocabulary.worker_api import WorkerInfo, WorkerRole, WorkerState

if TYPE_CHECKING:
    from deploy.control.cluster_spec import ClusterSpec
    from planner.loop import PlannerLoop


class Controller(Protocol):
    """What drain and rebalance act on: the controller actor's registry, the spec its workers
    are made from, and its own steps for starting and stopping one (the controller actor,
    deploy/control/cluster_controller.py, is the one implementation)."""

    workers: dict[str, Registered]
    spec: ClusterSpec
    planner: PlannerLoop | None
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


async def inflight(ctl: Controller, w: Registered) -> int:
    try:
        load = await wait_within(w.handle.load.remote(), 2.0)
    except Exception:
        return 0
    return int(load.inflight_requests + load.leases_held)


def num_wanted(workers: Iterable[Registered], role: WorkerRole) -> int:
    """How many of `workers` count towards `role`'s size (starting or ready)."""
    return sum(1 for w in workers if w.role is role and w.state in WANTED_STATES)


def youngest_ready(ctl: Controller, role: WorkerRole, keep: int) -> list[Registered]:
    """The ready workers of `role` beyond the first `keep`, youngest first (least prefix
    cache to lose; ids sort as strings, "prefill-10" < "prefill-9", so by creation)."""
    current = [w for w in ctl.workers.values() if w.role is role and w.state is WorkerState.READY]
    ordered = sorted(current, key=lambda w: w.started_at, reverse=True)
    return ordered[: max(len(current) - keep, 0)]


def refuse_unplaceable(
    ctl: Controller, targets: dict[WorkerRole, int], to_stop: dict[WorkerRole, list[Registered]]
) -> None:
    """Raise DrainRefused when the new workers could never be placed on this Ray."""
    leaving = {w.worker_id for ws in to_stop.values() for w in ws}
    staying = [w for w in ctl.workers.values() if w.worker_id not in leaving]
    starting = []
    for role, n in targets.items():
        have = num_wanted(staying, role)
        starting += [(role.value, ctl.spec.worker_asks(role))] * max(n - have, 0)
    why = rebalance_shortfall(
        [(w.role.value, w.placement) for w in staying], starting, ray.cluster_resources()
    )
    if why is not None:
        raise DrainRefused(why)


async def rebalance(
    ctl: Controller, prefill: int, decode: int, timeout_s: float
) -> tuple[list[str], list[str], str]:
    """Reach `prefill` prefill and `decode` decode workers, draining before stopping.

    Shrinking roles are drained and stopped first (freeing their devices), then growing
    roles start new workers; a worker is never stopped with requests in flight.
    """
    async with ctl._lock:
        targets = {WorkerRole.PREFILL: prefill, ctl.spec.decode_role: decode}
        to_stop = {role: youngest_ready(ctl, role, n) for role, n in targets.items()}
        if ctl.spec.fixed_capacity:
            refuse_unplaceable(ctl, targets, to_stop)
        stopped: list[str] = []
        started: list[str] = []
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
                    msg = (
                        f"rebalance stopped: {w.worker_id} still had {left} requests in "
                        f"flight after {timeout_s:g}s; it is back in service"
                    )
                    return started, stopped, msg
                await ctl._stop(w)
                stopped.append(w.worker_id)
        new: list[Registered] = []
        for role, n in targets.items():
            have = num_wanted(ctl.workers.values(), role)
            new += [ctl._create_worker(role) for _ in range(max(n - have, 0))]
        if ctl.planner is not None:  # room for the new workers on an autoscaling cluster
            ctl.planner.actuator.sync_resources()
        infos = await asyncio.gather(*(ctl._await_ready(w) for w in new))
        started += [i.worker_id for i in infos]
        msg = f"now {prefill} prefill + {decode} {ctl.spec.decode_role.value}"
        ctl._log(f"rebalance: {msg} (started {started}, stopped {stopped})")
        return started, stopped, msg
