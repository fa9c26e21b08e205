"""`capacity_shortfall`: which workers a Ray with fixed resources could never place."""

from __future__ import annotations

from deploy.control.worker_actors import capacity_shortfall
from vocabulary.worker_api import ActorPlacement

GPU = ActorPlacement(num_gpus=1.0, num_cpus=1.0)
HALF_GPU = ActorPlacement(num_gpus=0.5, num_cpus=1.0)
CPU_SLOT = ActorPlacement()  # half a CPU


def test_workers_that_fit_are_accepted() -> None:
    assert capacity_shortfall([("prefill", GPU), ("decode", GPU)], {"GPU": 2, "CPU": 32}) is None
    assert (
        capacity_shortfall([("prefill", HALF_GPU), ("decode", HALF_GPU)], {"GPU": 1, "CPU": 2})
        is None
    )
    assert capacity_shortfall([("decode", CPU_SLOT)] * 4, {"CPU": 2}) is None
    assert capacity_shortfall([], {}) is None


def test_missing_gpus_are_named_with_what_each_role_asks() -> None:
    why = capacity_shortfall([("prefill", GPU), ("decode", GPU)], {"GPU": 1, "CPU": 16})
    assert why == (
        "the workers need 2 GPU (decode 1, prefill 1) but this Ray has 1: on 1 GPU(s) run "
        "colocated workers (--colocated --decode 1)"
    )
    assert str(capacity_shortfall([("decode", GPU)], {"CPU": 8})).endswith(
        "need 1 GPU (decode 1) but this Ray has 0: start fewer workers, or give each a "
        "smaller share (placement)"
    )


def test_cpus_and_custom_resources_count_too() -> None:
    assert "need 2.5 CPU (decode 1, prefill 1.5) but this Ray has 2" in str(
        capacity_shortfall([("prefill", CPU_SLOT)] * 3 + [("decode", CPU_SLOT)] * 2, {"CPU": 2})
    )
    tagged = ActorPlacement(num_cpus=0.0, resources=(("prefill", 1.0),))
    assert "need 2 prefill (prefill 2) but this Ray has 1" in str(
        capacity_shortfall([("prefill", tagged)] * 2, {"CPU": 8, "prefill": 1})
    )
    free = ActorPlacement(num_cpus=0.0)
    assert capacity_shortfall([("decode", free)] * 50, {"CPU": 1}) is None
