"""Role switches: how the controller (deploy/control/cluster_controller.py) moves a worker to
another role without restarting it; the worker's part (drain, flip, admit as the new role) is
worker_runtime/role_host.py's.

`refuse_switch` checks, in this order, and raises `RoleSwitchRefused` naming what is wrong
(nothing changed): an unknown worker; a role that is not one (or that this cluster does not
run); the role the worker has; a worker that is not ready (starting, draining, drained, or
switching already); the last ready worker of its role, unless `force` (a switch between two
roles that both decode, e.g. decode to split, leaves the decode side as big as it was); and a
shape the new role's workers do not have (`ClusterSpec.switch_refusal`: ranks, placement).

`run_switch` then marks the worker switching in the registry (DRAINING, `switching_to`: the
planner counts it as a starting worker of the new role), waits for the worker's switch, and
records the new role and info (`Registered.role`, the registry signature changes, so routers
refresh; they see the role already in the worker's load). A worker whose requests outlast the
timeout goes back into service in its old role. A controller that restarts adopts the worker
in the role it reports (`Controller._adopt`); a worker that dies later is replaced in its
registry role, the new one.

The prefix index is left as it is: a switched worker keeps its KV pool and the prefix blocks
it caches, whose hashes do not name a role, so its Redis entries stay true and the router
counts them for the worker's new role (a prefill worker's cached prompts become a decode
worker's reusable prefix blocks, and the other way round).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from deploy.control.worker_registry import Registered, same_role
from router.errors import unwrap
from vocabulary.worker_api import RoleSwitch, RoleSwitchRefused, WorkerRole, WorkerState

if TYPE_CHECKING:
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.controller_metrics import ControllerMetrics


class SwitchHost(Protocol):
    """What a switch acts on: the controller's registry, spec, metrics and event log (the
    controller actor, deploy/control/cluster_controller.py)."""

    workers: dict[str, Registered]
    spec: ClusterSpec
    metrics: ControllerMetrics

    def _log(self, message: str) -> None: ...


def refuse_switch(
    ctl: SwitchHost, worker_id: str, role_name: str, force: bool = False
) -> tuple[Registered, WorkerRole]:
    """The worker and the role it may switch to now; `RoleSwitchRefused` otherwise (module
    docstring: what is refused, in order)."""
    w = ctl.workers.get(worker_id)
    if w is None:
        raise RoleSwitchRefused(f"worker_id: unknown worker {worker_id!r}")
    allowed = ctl.spec.switch_roles
    names = ", ".join(r.value for r in allowed)
    try:
        role = WorkerRole(role_name)
    except ValueError:
        raise RoleSwitchRefused(f"role: one of {names}, got {role_name!r}") from None
    if role not in allowed:
        raise RoleSwitchRefused(f"role: this cluster runs {names} workers, not {role.value}")
    if w.switching_to is not None:
        raise RoleSwitchRefused(f"{worker_id} is switching to {w.switching_to.value} already")
    if role is w.role:
        raise RoleSwitchRefused(f"{worker_id} is a {role.value} worker already")
    if w.state is not WorkerState.READY:
        raise RoleSwitchRefused(
            f"{worker_id} is {w.state.value}: only a ready worker switches"
            + (f" (`pdserve undrain {worker_id}` first)" if w.state is not WorkerState.STARTING
               else "")
        )  # fmt: skip
    if (
        not force
        and not same_role(role, w.role)
        and not any(
            o is not w and o.state is WorkerState.READY and same_role(o.role, w.role)
            for o in ctl.workers.values()
        )
    ):
        raise RoleSwitchRefused(
            f"{worker_id} is the last ready {w.role.value} worker: switching it would leave "
            f"none (add one first, or pass force)"
        )
    if (why := ctl.spec.switch_refusal(w.role, role)) is not None:
        raise RoleSwitchRefused(
            f"{worker_id} cannot switch to {role.value} in place: {why} "
            "(`pdserve rebalance --restart` stops and starts workers instead)"
        )
    return w, role


async def run_switch(
    ctl: SwitchHost, w: Registered, role: WorkerRole, timeout_s: float
) -> RoleSwitch:
    """Switch a worker that `refuse_switch` let through (module docstring)."""
    was = w.role
    w.switching_to, w.state = role, WorkerState.DRAINING
    ctl._log(f"switching {w.worker_id} from {was.value} to {role.value} ({timeout_s:g}s to drain)")
    try:
        result: RoleSwitch = await w.handle.switch_role.remote(role, timeout_s)
    except Exception as e:
        error = unwrap(e)
        ctl._log(f"switch of {w.worker_id} failed: {error}")
        if isinstance(error, RoleSwitchRefused):  # it serves its old role, as before
            w.state = WorkerState.READY
            raise error from None
        w.state = WorkerState.READY  # gone or broken: the health check replaces it (old role)
        raise
    finally:
        w.switching_to = None
    if result.switched:
        w.role, w.info = role, result.info
    w.state = WorkerState.READY
    ctl.metrics.switches.labels(was.value, role.value, str(result.switched).lower()).inc()
    ctl._log(result.message)
    return result


def begin_switch(
    ctl: SwitchHost,
    worker_id: str,
    role: WorkerRole,
    spawn: Callable[[Coroutine[Any, Any, Any]], None],
) -> bool:
    """Start a switch in the background (`spawn` runs it; the planner's, forced: its own
    bounds decide a role's size, as for its drains); False, logged, when it is refused."""
    try:
        w, new = refuse_switch(ctl, worker_id, role.value, force=True)
    except RoleSwitchRefused as e:
        ctl._log(f"planner: no switch ({e}); draining and starting instead")
        return False

    async def switch() -> None:
        with contextlib.suppress(Exception):  # run_switch logs the failure
            await run_switch(ctl, w, new, ctl.spec.planner.switch_timeout_s)

    spawn(switch())
    return True
