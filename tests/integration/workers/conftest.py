"""Fixtures for the worker-actor tests: real local Ray, real redis-server, NIXL over UCX on
loopback, the tiny checkpoint, and the transformers float32 reference.

The session's workers (two prefill, two decode, a fault-injecting decode, two decode
workers kept for one test each and the two that the health tests break) are created at once,
so their model loads overlap; each holds a 256-block pool and a quarter of a CPU.
Tests that count blocks use their own `cache_salt`, so earlier tests' prefix-cache entries
never change their numbers.

The tensor- and pipeline-parallel workers that test_tp_workers and test_pp_workers share
(`parallel_workers`) are created at once when the first of them needs them and stop after the
last test that uses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from directory_scope import stop_after_last_user, stop_with_directory
from workers_harness import (
    GATED_TRANSFER,
    PLACEMENT,
    SICK_STEP_ERRORS,
    START_TIMEOUT_S,
    STUCK_STALL_S,
    ParallelWorkers,
    Workers,
    parallel_config,
    worker_config,
)

from deploy.control.worker_actors import create_worker, stop_worker
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


@pytest.fixture(scope="session")
def parallel_workers(
    request: pytest.FixtureRequest, ray_cluster: None, tiny_model_dir: Path, redis_url: str
) -> Iterator[ParallelWorkers]:
    import ray

    lease = KVTransferConfig(lease_s=30.0)  # generous: the CI machine is shared
    specs = {  # key: (worker id, role, tp, pp, transfer)
        "p_tp2": ("tp-p2", WorkerRole.PREFILL, 2, 1, lease),
        "p1": ("tp-p1", WorkerRole.PREFILL, 1, 1, lease),
        "d1": ("tp-d1", WorkerRole.DECODE, 1, 1, lease),
        "d_tp2": ("tp-d2", WorkerRole.DECODE, 2, 1, lease),
        "p_pp2": ("pp-p2", WorkerRole.PREFILL, 1, 2, lease),
        "d_pp2": ("pp-dpp2", WorkerRole.DECODE, 1, 2, lease),
        "pp_victim": ("pp-dead", WorkerRole.DECODE, 1, 2, KVTransferConfig()),
    }
    handles = {
        key: create_worker(
            parallel_config(tiny_model_dir, wid, role, redis_url, tp=tp, pp=pp), transfer,
            PLACEMENT,
        )
        for key, (wid, role, tp, pp, transfer) in specs.items()
    }  # fmt: skip

    stopped: list[bool] = []

    def stop() -> None:
        if stopped:
            return
        stopped.append(True)
        for key, h in handles.items():
            with contextlib.suppress(Exception):  # killed by a test, or already gone
                ray.get(h.shutdown.remote(), timeout=30)
            stop_worker(specs[key][0], h)

    stop_after_last_user(request, stop)
    try:
        infos = ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
        got = [(i.tp_size, i.pp_size) for i in infos]
        assert got == [(tp, pp) for _, _, tp, pp, _ in specs.values()], got
        assert {i.kv_layout for i in infos} == {"head_major_v1"}
        yield ParallelWorkers(**handles)
    finally:
        stop()
