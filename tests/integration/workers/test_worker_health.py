"""A worker whose engine fails every step (a sticky device error) reports itself unhealthy
through its health check, so the controller replaces it instead of routing to it forever."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import ray
from workers_harness import PLACEMENT, START_TIMEOUT_S, worker_config

from deploy.control.worker_actors import create_worker
from kv_transfer.config import KVTransferConfig
from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole, WorkerUnhealthy
from worker_runtime.runtime import StepFailed


def test_a_worker_whose_steps_keep_failing_fails_its_health_check(
    ray_cluster: None, tiny_model_dir: Path
) -> None:
    config = dataclasses.replace(
        worker_config(tiny_model_dir, "sick", WorkerRole.PREFILL, None),
        max_consecutive_step_errors=2,
    )
    handle: Any = create_worker(config, KVTransferConfig(), PLACEMENT)
    try:
        ray.get(handle.start.remote(), timeout=START_TIMEOUT_S)
        assert ray.get(handle.ping.remote(), timeout=10) == "ready"

        def break_the_device(actor: Any) -> None:
            def execute(batch: Any) -> Any:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            actor.runtime.engine.runner.execute = execute

        ray.get(handle.__ray_call__.remote(break_the_device), timeout=10)
        sampling = SamplingParams(temperature=0.0, max_tokens=4)
        for i in range(2):
            req = PrefillRequest(f"r{i}", (5, 6, 7, 8), sampling)
            with pytest.raises(StepFailed, match="illegal memory access"):
                ray.get(handle.prefill.remote(req), timeout=30)
        with pytest.raises(WorkerUnhealthy, match="2 engine steps failed in a row"):
            ray.get(handle.ping.remote(), timeout=10)
    finally:
        ray.kill(handle)
