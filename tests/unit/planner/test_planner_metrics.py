"""The planner's series: one decision per role and tick, by action, and the workers moved."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from planner.core import PlannerConfig, RoleBounds, TickInput, WorkerView, plan
from planner.metrics import ACTIONS, PlannerMetrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    assert got is not None, (name, labels)
    return got


def test_every_role_and_action_is_exported_before_the_first_tick() -> None:
    registry = CollectorRegistry()
    PlannerMetrics(registry)
    for role in ("prefill", "decode"):
        for action in ACTIONS:
            assert value(registry, "pdserve_planner_decisions_total", role=role, action=action) == 0
    assert value(registry, "pdserve_planner_ticks_total") == 0


def test_a_tick_counts_each_roles_action_and_the_workers_it_moves() -> None:
    registry = CollectorRegistry()
    metrics = PlannerMetrics(registry)
    config = PlannerConfig(prefill=RoleBounds(2, 4), decode=RoleBounds(1, 1))
    tick = TickInput(
        tick=0,
        now_s=1000.0,
        prefill_workers=(WorkerView("prefill-0", age_s=100.0),),  # below min 2: add 1
        decode_workers=(
            WorkerView("decode-1", age_s=100.0),
            WorkerView("decode-2", age_s=100.0, draining=True),  # idle and draining: stop
        ),
        queue_depth=3,
    )
    decision = plan(tick, config)
    metrics.observe(tick, decision)
    assert value(registry, "pdserve_planner_ticks_total") == 1
    assert value(registry, "pdserve_planner_decisions_total", role="prefill", action="add") == 1
    assert value(registry, "pdserve_planner_decisions_total", role="decode", action="stop") == 1
    assert value(registry, "pdserve_planner_decisions_total", role="decode", action="hold") == 0
    assert value(registry, "pdserve_planner_worker_changes_total", role="prefill",
                 action="add") == 1  # fmt: skip
    assert value(registry, "pdserve_planner_active_workers", role="prefill") == 1
    assert value(registry, "pdserve_planner_active_workers", role="decode") == 1
    assert value(registry, "pdserve_planner_queue_depth") == 3

    held = plan(TickInput(1, 1001.0, tick.prefill_workers * 2, tick.decode_workers[:1]), config)
    metrics.observe(tick, held)
    assert value(registry, "pdserve_planner_decisions_total", role="decode", action="hold") == 1
