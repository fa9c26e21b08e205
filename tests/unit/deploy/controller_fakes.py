"""A controller over fake worker handles, for tests of its logic without Ray:
`handle.method.remote(...)` returns an awaitable, as a Ray actor handle does inside an async
actor; `FakeHandle` answers drain, undrain, shutdown, load and switch_role as a worker would."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.control.cluster_controller import Controller
from deploy.control.cluster_spec import ClusterSpec
from deploy.control.worker_registry import Registered
from engine.config import EngineConfig
from vocabulary.engine_io import EngineLoad
from vocabulary.worker_api import (
    ActorPlacement,
    RoleSwitch,
    WorkerInfo,
    WorkerLoad,
    WorkerRole,
    WorkerState,
)

PREFILL = ActorPlacement(num_cpus=0, resources=(("prefill", 1.0),))
DECODE = ActorPlacement(num_cpus=0, resources=(("decode", 1.0),))


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        async def call() -> Any:
            return self.fn(*args)

        return asyncio.ensure_future(call())


class FakeHandle:
    def __init__(self, worker_id: str, role: WorkerRole, inflight: int = 0) -> None:
        self.worker_id, self.role, self.inflight = worker_id, role, inflight
        self.calls: list[str] = []
        self.state = WorkerState.READY

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self, f"_{name}"))

    def _drain(self, timeout_s: float) -> bool:
        self.calls.append("drain")
        self.state = WorkerState.DRAINING
        return self.inflight == 0

    def _undrain(self) -> None:
        self.calls.append("undrain")
        self.state = WorkerState.READY

    def _shutdown(self) -> None:
        self.calls.append("shutdown")

    def _load(self) -> WorkerLoad:
        self.calls.append("load")
        engine = EngineLoad(0, 0, 0, 10, 10, 0, 0, 0, 0, 0)
        return WorkerLoad(self.worker_id, self.role, self.state, engine, self.inflight, 0)

    def _switch_role(self, role: WorkerRole, timeout_s: float) -> RoleSwitch:
        """Switches when it holds nothing, else stays (its requests outlast any timeout)."""
        self.calls.append(f"switch_role {role.value}")
        switched = self.inflight == 0
        if switched:
            self.role = role
        info = WorkerInfo(self.worker_id, self.role, "", "", "", "tiny", 16, 64, 256, 32)
        message = f"{self.worker_id} {'switched' if switched else 'still busy'}"
        return RoleSwitch(switched, info, message, self.inflight, 0.01, 0.02)


@pytest.fixture(autouse=True)
def no_ray_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray.kill` would start a local Ray in this process (it auto-initializes)."""
    monkeypatch.setattr("deploy.control.cluster_controller.ray.kill", lambda handle: None)


def controller(*workers: tuple[str, WorkerRole, int]) -> Controller:
    """A controller (not an actor) whose registry holds these ready (id, role, in flight)."""
    c = Controller(ClusterSpec(engine=EngineConfig(model_dir="unused")))
    for i, (worker_id, role, inflight) in enumerate(workers):
        placement = PREFILL if role is WorkerRole.PREFILL else DECODE
        w = Registered(None, role, worker_id, FakeHandle(worker_id, role, inflight), placement)
        w.state, w.started_at, w.ready_at = WorkerState.READY, float(i), 1000.0 + i
        c.workers[worker_id] = w
    return c
