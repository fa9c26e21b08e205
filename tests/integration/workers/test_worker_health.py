"""A worker whose engine fails every step (a sticky device error) reports itself unhealthy
through its health check, so the controller replaces it instead of routing to it forever."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from workers_harness import SICK_STEP_ERRORS, Workers

from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerUnhealthy
from worker_runtime.runtime import StepFailed


def test_a_worker_whose_steps_keep_failing_fails_its_health_check(workers: Workers) -> None:
    handle = workers.sick  # max_consecutive_step_errors=SICK_STEP_ERRORS; broken for good here
    try:
        assert ray.get(handle.ping.remote(), timeout=10) == "ready"

        def break_the_device(actor: Any) -> None:
            def execute(batch: Any) -> Any:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            actor.runtime.engine.runner.execute = execute

        ray.get(handle.__ray_call__.remote(break_the_device), timeout=10)
        sampling = SamplingParams(temperature=0.0, max_tokens=4)
        for i in range(SICK_STEP_ERRORS):
            req = PrefillRequest(f"r{i}", (5, 6, 7, 8), sampling)
            with pytest.raises(StepFailed, match="illegal memory access"):
                ray.get(handle.prefill.remote(req), timeout=30)
        with pytest.raises(
            WorkerUnhealthy, match=f"{SICK_STEP_ERRORS} engine steps failed in a row"
        ):
            ray.get(handle.ping.remote(), timeout=10)
    finally:
        ray.kill(handle)
