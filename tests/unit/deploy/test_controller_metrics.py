"""The controller's series: the registry by role and state, each worker's state and how long
it has been in it (drains included), whether it answers pings, and lifecycle counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from deploy.control.controller_metrics import ControllerMetrics
from deploy.control.worker_registry import Registered as _Worker
from vocabulary.worker_api import ActorPlacement, WorkerRole, WorkerState


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    assert got is not None, (name, labels)
    return got


def worker(worker_id: str, role: WorkerRole, state: WorkerState) -> _Worker:
    w = _Worker(None, role, worker_id, object(), ActorPlacement())
    w.state = state
    return w


def test_registry_series_follow_the_workers_and_their_states() -> None:
    workers = [
        worker("prefill-0", WorkerRole.PREFILL, WorkerState.READY),
        worker("decode-1", WorkerRole.DECODE, WorkerState.READY),
        worker("decode-2", WorkerRole.DECODE, WorkerState.STARTING),
    ]
    metrics = ControllerMetrics(lambda: list(workers), ("prefill", "decode"))
    r = metrics.registry
    assert value(r, "pdserve_controller_workers", role="decode", state="ready") == 1
    assert value(r, "pdserve_controller_workers", role="decode", state="starting") == 1
    assert value(r, "pdserve_controller_workers", role="prefill", state="draining") == 0
    assert value(r, "pdserve_controller_worker_state", worker="decode-2", role="decode",
                 state="starting") == 1  # fmt: skip
    assert value(r, "pdserve_controller_worker_draining_seconds", worker="decode-1",
                 role="decode") == 0  # fmt: skip
    assert value(r, "pdserve_controller_worker_up", worker="decode-1", role="decode") == 1

    workers[1].state = WorkerState.DRAINING
    workers[1].failures = 1
    time.sleep(0.05)
    draining = value(r, "pdserve_controller_worker_draining_seconds", worker="decode-1",
                     role="decode")  # fmt: skip
    assert 0.05 <= draining < 5
    assert value(r, "pdserve_controller_worker_up", worker="decode-1", role="decode") == 0
    workers[1].state = WorkerState.DRAINING  # the same state again: the clock goes on
    assert value(r, "pdserve_controller_worker_state_seconds", worker="decode-1",
                 role="decode") >= draining  # fmt: skip
    workers.pop(1)
    assert r.get_sample_value(
        "pdserve_controller_worker_up", {"worker": "decode-1", "role": "decode"}
    ) is None  # fmt: skip


def test_lifecycle_counters_start_at_zero_for_every_role_and_reason() -> None:
    metrics = ControllerMetrics(list, ("prefill", "colocated"))
    r = metrics.registry
    for reason in ("stopped", "dead", "unhealthy", "start_failed"):
        assert value(r, "pdserve_controller_workers_removed_total", role="colocated",
                     reason=reason) == 0  # fmt: skip
    metrics.removed.labels("colocated", "dead").inc()
    assert value(r, "pdserve_controller_workers_removed_total", role="colocated",
                 reason="dead") == 1  # fmt: skip
    assert value(r, "pdserve_controller_workers", role="colocated", state="ready") == 0
    assert metrics.url == ""  # not served until `serve`
