"""Fixtures for the worker-actor tests: real local Ray, real redis-server, NIXL over UCX on
loopback, the tiny checkpoint, and the transformers float32 reference.

The session's workers (two prefill, two decode, a fault-injecting decode, two decode
workers kept for one test each and the two that the health tests break) are created at once,
so their model loads overlap; each holds a 256-block pool and a quarter of a CPU.
Tests that count blocks use their own `cache_salt`, so earlier tests' prefix-cache entries
never change their numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from directory_scope import stop_with_directory
from workers_harness import (
    GATED_TRANSFER,
    PLACEMENT,
    SICK_STEP_ERRORS,
    START_TIMEOUT_S,
    STUCK_STALL_S,
    Workers,
    worker_config,
)

from deploy.control.worker_actors import create_worker
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import WorkerRole


@pytest.fixture(scope="session")
def workers(
    request: pytest.FixtureRequest, ray_cluster: None, tiny_model_dir: Path, redis_url: str
) -> Iterator[Workers]:
    import ray
    import ray.cloudpickle
    from gated_decode import GatedDecodeWorker, gated_module

    # The test-only actor class travels by value (Ray workers cannot import test modules).
    ray.cloudpickle.register_pickle_by_value(gated_module())
    transfer = KVTransferConfig(lease_s=30.0)  # generous: the CI machine is shared
    handles: dict[str, Any] = {}
    for wid, role in (
        ("p0", WorkerRole.PREFILL),
        ("p1", WorkerRole.PREFILL),
        ("d0", WorkerRole.DECODE),
        ("d1", WorkerRole.DECODE),
        ("victim", WorkerRole.DECODE),
        ("fresh", WorkerRole.DECODE),
    ):
        handles[wid] = create_worker(
            worker_config(tiny_model_dir, wid, role, redis_url), transfer, PLACEMENT
        )
    gated_config = worker_config(tiny_model_dir, "dgate", WorkerRole.DECODE, redis_url)
    handles["gated"] = (
        ray.remote(GatedDecodeWorker)
        .options(name="pdserve-worker-dgate", num_cpus=PLACEMENT.num_cpus, max_concurrency=4096)
        .remote(gated_config, GATED_TRANSFER, "pdserve-worker-dgate")
    )
    # test_worker_health and test_worker_stall break these two for good (no Redis: nothing
    # of theirs reaches the index the others use)
    sick = worker_config(tiny_model_dir, "sick", WorkerRole.PREFILL, None)
    handles["sick"] = create_worker(
        dataclasses.replace(sick, max_consecutive_step_errors=SICK_STEP_ERRORS),
        KVTransferConfig(),
        PLACEMENT,
    )
    stuck = worker_config(tiny_model_dir, "stuck", WorkerRole.DECODE, None)
    handles["stuck"] = create_worker(
        dataclasses.replace(stuck, stall_timeout_s=STUCK_STALL_S), KVTransferConfig(), PLACEMENT
    )
    ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    started_at = time.monotonic()

    def stop() -> None:
        for h in handles.values():
            with contextlib.suppress(Exception):  # killed by a test, or already gone
                ray.get(h.shutdown.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(h)

    stop_with_directory(request, stop)
    yield Workers(**handles, started_at=started_at)
    stop()
