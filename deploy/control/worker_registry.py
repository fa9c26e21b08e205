"""One entry of the controller's worker registry, and the state sets the controller and the
rebalance logic (deploy/control/rebalance.py) agree on."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.cluster_view import RegistrySignature
from vocabulary.worker_api import ActorPlacement, WorkerInfo, WorkerRole, WorkerState


@dataclass
class Registered:
    """A worker the controller created or adopted: its actor, role, state and health."""

    info: WorkerInfo | None
    role: WorkerRole
    worker_id: str
    handle: Any
    placement: ActorPlacement
    state: WorkerState = WorkerState.STARTING
    failures: int = 0
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    """Wall-clock time start() returned."""
    switching_to: WorkerRole | None = None
    """The role it is switching to (deploy/control/role_switch.py); None when not switching."""
    state_since: float = field(default_factory=time.monotonic)
    """Monotonic time `state` last changed (kept by `__setattr__`; for the metrics)."""

    @property
    def wanted_as(self) -> WorkerRole | None:
        """The role it counts towards: its own while starting or ready, the one it is switching
        to while it switches; None while draining, drained or stopped."""
        if self.switching_to is not None:
            return self.switching_to
        return self.role if self.state in WANTED_STATES else None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and getattr(self, "state", None) is not value:
            object.__setattr__(self, "state_since", time.monotonic())
        object.__setattr__(self, name, value)


LISTED_STATES = (WorkerState.READY, WorkerState.DRAINING, WorkerState.DRAINED)
"""Workers routers keep in view (and the health check pings)."""
WANTED_STATES = (WorkerState.STARTING, WorkerState.READY)
"""Workers that count towards a role's size."""


def same_role(a: WorkerRole, b: WorkerRole) -> bool:
    return a is b or (a.decodes and b.decodes)


def listed(workers: Mapping[str, Registered]) -> list[Registered]:
    """The workers routers keep in view: started ones in `LISTED_STATES`, in registry order."""
    return [w for w in workers.values() if w.info and w.state in LISTED_STATES]


def signature(workers: Iterable[Registered]) -> RegistrySignature:
    """Which incarnations `workers` are, in which roles. A replacement has a new id; an id
    given out again (after a controller restart) belongs to a worker with a new `started_at`;
    a role switch changes the role: so the signature changes whenever the (info, handle) pairs
    routers are given would."""
    return tuple((w.worker_id, w.started_at, w.role.value) for w in workers)
