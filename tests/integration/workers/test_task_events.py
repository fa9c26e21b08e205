"""pdserve's actors leave no task events in Ray's GCS: every method call of an actor would
otherwise be recorded there (up to 100,000 of them), and a serving cluster makes thousands a
minute; a 30-minute soak grew gcs_server by ~1.4 GB/hour with them (`python -m benchmarks soak`)."""

from __future__ import annotations

import sys
import time
from typing import Any

import ray
from workers_harness import Workers

from deploy.control.launch import controller_options
from deploy.control.worker_actors import NO_TASK_EVENTS

REPORT_WAIT_S = 3.0
"""Longer than Ray's task-event report interval (1 s)."""


class Probe:
    def ping(self) -> str:
        return "pong"


def method_events(actor: Any, method: str) -> int:
    """Task events the GCS holds for calls of `method` of `actor`."""
    from ray._private import state

    actor_id = actor._actor_id.binary()
    return sum(
        1
        for e in state.state._get_all_task_events()
        if e.HasField("task_info")
        and e.task_info.actor_id == actor_id
        and e.task_info.name.endswith(f".{method}")
    )


def test_a_worker_leaves_no_task_events_where_a_plain_actor_leaves_one_a_call(
    workers: Workers,
) -> None:
    assert controller_options("pdserve")["enable_task_events"] is False
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Probe, for the workers
    plain: Any = ray.remote(Probe).options(num_cpus=0).remote()
    worker = workers.p0  # made by create_worker, as every pdserve worker is
    try:
        for _ in range(5):
            assert ray.get(plain.ping.remote(), timeout=10) == "pong"
            assert ray.get(worker.ping.remote(), timeout=10) == "ready"
        time.sleep(REPORT_WAIT_S)
        assert method_events(plain, "ping") >= 5  # the GCS does record a plain actor's calls
        assert method_events(worker, "ping") == 0
    finally:
        ray.kill(plain)
    assert NO_TASK_EVENTS == {"enable_task_events": False}
