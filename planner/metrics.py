"""The planner's Prometheus series: its ticks, each role's decision and the workers it moved.

`PlannerLoop` calls `observe` once per tick (planner/loop.py); the controller serves the
registry (deploy/control/controller_metrics.py). Every series is created at once for both roles and
every action, so a dashboard shows zeros rather than nothing while the planner only holds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.core import Role, RoleDecision, ScalingDecision, TickInput

ACTIONS = ("add", "drain", "stop", "hold")


class PlannerMetrics:
    """Series of one planner loop, registered in the controller's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.ticks = Counter("pdserve_planner_ticks", "Planner ticks that decided", registry=r)
        self.decisions = Counter(
            "pdserve_planner_decisions",
            "Planner decisions per role and tick, by action (hold: nothing to change)",
            ["role", "action"],
            registry=r,
        )
        self.workers = Counter(
            "pdserve_planner_worker_changes",
            "Workers the planner started, drained or stopped",
            ["role", "action"],
            registry=r,
        )
        self.active = Gauge(
            "pdserve_planner_active_workers",
            "Workers of the role the planner counted as active (not draining) at its last tick",
            ["role"],
            registry=r,
        )
        self.queue = Gauge(
            "pdserve_planner_queue_depth", "Requests waiting for prefill at the last tick",
            registry=r,
        )  # fmt: skip
        for role in Role:
            self.active.labels(role.value)
            for action in ACTIONS:
                self.decisions.labels(role.value, action)
                if action != "hold":
                    self.workers.labels(role.value, action)

    def observe(self, tick: TickInput, decision: ScalingDecision) -> None:
        self.ticks.inc()
        self.queue.set(tick.queue_depth)
        for d in (decision.prefill, decision.decode):
            role = d.role.value
            self.active.labels(role).set(sum(not w.draining for w in tick.workers(d.role)))
            for action, count in _actions(d):
                self.decisions.labels(role, action).inc()
                if action != "hold":
                    self.workers.labels(role, action).inc(count)


def _actions(d: RoleDecision) -> list[tuple[str, int]]:
    acts = [("add", d.add), ("drain", len(d.drain)), ("stop", len(d.stop))]
    taken = [(action, n) for action, n in acts if n]
    return taken or [("hold", 0)]
