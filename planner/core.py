"""The planner's pure core: one tick of cluster measurements in, one scaling decision out.

Per role, each tick (the first rule that applies wins):

1. bounds: below `min_workers` add up to it; above `max_workers` drain down to it;
2. cooldown: no change within `cooldown_ticks` of the role's last change;
3. scale up when the role is behind: its latency percentile (TTFT for prefill, TPOT for decode)
   over the SLO, the queue per prefill worker over its bound (prefill), or the token rate needing
   more workers than there are (the prefill:decode rate match, when capacities are configured);
4. scale down by one when the role is comfortably ahead: latency under `scale_down_ratio` of
   the SLO (or no samples), an empty queue, the token rate fitting in one worker fewer, no worker
   still warming up and no drain already under way.

Samples from a worker's first `cold_start_s` are excluded (cold caches, compilation). Scaling
down never stops a worker: it *drains* the least busy ones (stop admitting, finish in-flight
work); a draining worker is listed in `stop` only once it has no in-flight work. Every decision
carries its reasons; `Planner` logs them. Actuation (creating, draining and stopping actors,
asking Ray's autoscaler for nodes) sits behind the `ScalingActuator` protocol; one that can
switch a worker's role in place (`SwitchingActuator`) gets a role that drains while the other
adds as switches instead (`apply_decision`).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from vocabulary.numeric import percentile

log = logging.getLogger(__name__)


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RoleBounds:
    min_workers: int = 1
    """Never fewer active workers of this role."""
    max_workers: int = 8
    """Never more active workers of this role."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"min_workers/max_workers: need 0 <= min <= max, got "
                f"{self.min_workers}/{self.max_workers}"
            )


@dataclass(frozen=True)
class PlannerConfig:
    """SLOs, bounds and thresholds of the planner (one per cluster)."""

    ttft_slo_ms: float = 500.0
    """Target time to first token; prefill is scaled on it."""
    tpot_slo_ms: float = 50.0
    """Target time per output token after the first; decode is scaled on it."""
    slo_percentile: float = 90.0
    """Percentile of the samples compared with the SLOs, in (0, 100]."""
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    cooldown_ticks: int = 3
    """Ticks after a role changed before it may change again (bounds are enforced anyway)."""
    cold_start_s: float = 30.0
    """Samples taken within this long of their worker's start are ignored."""
    min_samples: int = 10
    """Fewer usable samples than this and the role's percentile is not used."""
    scale_up_ratio: float = 1.0
    """Scale up when the percentile exceeds SLO * scale_up_ratio."""
    scale_down_ratio: float = 0.5
    """Scale down only when the percentile is below SLO * scale_down_ratio."""
    max_queue_per_prefill_worker: float = 8.0
    """Scale prefill up when queued requests per active prefill worker exceed this."""
    prefill_capacity_tokens_per_s: float | None = None
    """Prompt tokens/s one prefill worker sustains (profiled); None disables rate matching."""
    decode_capacity_tokens_per_s: float | None = None
    """Output tokens/s one decode worker sustains (profiled); None disables rate matching."""
    target_utilization: float = 0.7
    """Rate matching sizes each role to run at this fraction of its capacity."""
    max_step: int = 2
    """Most workers added to one role in one tick."""

    def __post_init__(self) -> None:
        if not 0 < self.slo_percentile <= 100:
            raise ValueError(f"slo_percentile: must be in (0, 100], got {self.slo_percentile}")
        if self.ttft_slo_ms <= 0 or self.tpot_slo_ms <= 0:
            raise ValueError("ttft_slo_ms/tpot_slo_ms: must be > 0")
        if not 0 < self.scale_down_ratio < self.scale_up_ratio:
            raise ValueError("scale_down_ratio: must be in (0, scale_up_ratio)")
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization: must be in (0, 1]")
        if self.max_step < 1 or self.cooldown_ticks < 0 or self.min_samples < 1:
            raise ValueError("max_step and min_samples must be >= 1, cooldown_ticks >= 0")

    def bounds(self, role: Role) -> RoleBounds:
        return self.prefill if role is Role.PREFILL else self.decode

    def slo_ms(self, role: Role) -> float:
        return self.ttft_slo_ms if role is Role.PREFILL else self.tpot_slo_ms

    def capacity(self, role: Role) -> float | None:
        if role is Role.PREFILL:
            return self.prefill_capacity_tokens_per_s
        return self.decode_capacity_tokens_per_s


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    age_s: float
    """Seconds since the worker became ready."""
    inflight_requests: int = 0
    inflight_transfers: int = 0
    draining: bool = False
    ready: bool = True
    """Serving (False while it starts: counted as active, age 0, not yet taking requests)."""

    @property
    def busy(self) -> bool:
        return self.inflight_requests > 0 or self.inflight_transfers > 0


@dataclass(frozen=True)
class LatencySample:
    """One request's TTFT (prefill worker) or TPOT (decode worker)."""

    worker_id: str
    at_s: float
    """When it was measured, on the same clock as `TickInput.now_s`."""
    value_ms: float


@dataclass(frozen=True)
class TickInput:
    """Everything the planner sees at one tick."""

    tick: int
    now_s: float
    prefill_workers: tuple[WorkerView, ...]
    decode_workers: tuple[WorkerView, ...]
    ttft_samples: tuple[LatencySample, ...] = ()
    tpot_samples: tuple[LatencySample, ...] = ()
    ttft_percentile_ms: float | None = None
    """Already-computed TTFT percentile (at `slo_percentile`, cold starts excluded by the
    caller), used when there are no samples; None: not reported."""
    tpot_percentile_ms: float | None = None
    """As `ttft_percentile_ms`, for TPOT."""
    queue_depth: int = 0
    """Requests waiting for prefill (admission queue + prefill queues)."""
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens per second arriving (demand on prefill)."""
    decode_tokens_per_s: float = 0.0
    """Output tokens per second generated (demand on decode)."""
    arrival_rps: float = 0.0
    """Requests per second since the last tick (the predictive planner's forecast input)."""
    mean_prompt_tokens: float = 0.0
    """Mean prompt tokens of those requests (0: none)."""
    mean_output_tokens: float = 0.0
    """Mean output tokens of those requests (0: none)."""

    def workers(self, role: Role) -> tuple[WorkerView, ...]:
        return self.prefill_workers if role is Role.PREFILL else self.decode_workers

    def samples(self, role: Role) -> tuple[LatencySample, ...]:
        return self.ttft_samples if role is Role.PREFILL else self.tpot_samples

    def reported_percentile_ms(self, role: Role) -> float | None:
        return self.ttft_percentile_ms if role is Role.PREFILL else self.tpot_percentile_ms

    def demand_tokens_per_s(self, role: Role) -> float:
        return self.prefill_tokens_per_s if role is Role.PREFILL else self.decode_tokens_per_s


@dataclass(frozen=True)
class PlannerMemory:
    """What the planner remembers between ticks: when each role last changed."""

    last_change_tick: tuple[tuple[Role, int], ...] = ()

    def last_change(self, role: Role) -> int | None:
        return dict(self.last_change_tick).get(role)

    def changed(self, role: Role, tick: int) -> PlannerMemory:
        kept = tuple((r, t) for r, t in self.last_change_tick if r is not role)
        return PlannerMemory(tuple(sorted((*kept, (role, tick)), key=lambda rt: rt[0].value)))


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    add: int = 0
    """Workers to start."""
    drain: tuple[str, ...] = ()
    """Workers to drain: stop admitting, finish in-flight work."""
    stop: tuple[str, ...] = ()
    """Draining workers that now have no in-flight work: safe to stop."""
    reasons: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        """True when the role's active size changes (adds or new drains)."""
        return self.add > 0 or bool(self.drain)


@dataclass(frozen=True)
class ScalingDecision:
    tick: int
    prefill: RoleDecision
    decode: RoleDecision
    memory: PlannerMemory
    """Pass to the next `plan` call."""

    def describe(self) -> str:
        """One line: what changes and why (what `Planner` logs)."""
        parts = []
        for d in (self.prefill, self.decode):
            acts = []
            if d.add:
                acts.append(f"+{d.add}")
            if d.drain:
                acts.append("drain " + ",".join(d.drain))
            if d.stop:
                acts.append("stop " + ",".join(d.stop))
            parts.append(f"{d.role.value}: {' '.join(acts) or 'hold'} ({'; '.join(d.reasons)})")
        return f"tick {self.tick}: " + " | ".join(parts)


def warm_samples(
    samples: Sequence[LatencySample], workers: Sequence[WorkerView], now_s: float, cold_s: float
) -> list[float]:
    """Values of samples not taken in their worker's cold start (unknown workers are kept)."""
    started = {w.worker_id: now_s - w.age_s for w in workers}
    return [
        s.value_ms
        for s in samples
        if s.worker_id not in started or s.at_s - started[s.worker_id] >= cold_s
    ]


def plan(
    tick: TickInput, config: PlannerConfig, memory: PlannerMemory | None = None
) -> ScalingDecision:
    """Decide both roles for one tick. Pure: the result depends on the arguments only."""
    memory = memory or PlannerMemory()
    decisions = {}
    for role in Role:
        decision = _plan_role(role, tick, config, memory)
        if decision.changes:
            memory = memory.changed(role, tick.tick)
        decisions[role] = decision
    return ScalingDecision(tick.tick, decisions[Role.PREFILL], decisions[Role.DECODE], memory)


def _plan_role(
    role: Role, tick: TickInput, config: PlannerConfig, memory: PlannerMemory
) -> RoleDecision:
    workers = tick.workers(role)
    active = [w for w in workers if not w.draining]
    stop = tuple(w.worker_id for w in workers if w.draining and not w.busy)
    n = len(active)
    bounds = config.bounds(role)
    reasons: list[str] = [f"{w} drained, no in-flight work: stop" for w in stop]

    def decide(add: int = 0, drain: tuple[str, ...] = ()) -> RoleDecision:
        return RoleDecision(role, add=add, drain=drain, stop=stop, reasons=tuple(reasons))

    if n < bounds.min_workers:
        reasons.append(f"{n} active < min {bounds.min_workers}")
        return decide(add=bounds.min_workers - n)
    if n > bounds.max_workers:
        reasons.append(f"{n} active > max {bounds.max_workers}")
        return decide(drain=pick_drain(active, n - bounds.max_workers))

    last = memory.last_change(role)
    if last is not None and tick.tick - last < config.cooldown_ticks:
        reasons.append(f"cooldown: changed at tick {last}")
        return decide()

    slo = config.slo_ms(role)
    metric = "TTFT" if role is Role.PREFILL else "TPOT"
    values = warm_samples(tick.samples(role), workers, tick.now_s, config.cold_start_s)
    p = percentile(values, config.slo_percentile) if len(values) >= config.min_samples else None
    if not tick.samples(role):
        p = tick.reported_percentile_ms(role)
    p_name = f"{metric} p{config.slo_percentile:g}"
    needed = _rate_needed(role, tick, config)

    # Scale up: the largest step any signal asks for.
    up: list[tuple[int, str]] = []
    if p is not None and p > slo * config.scale_up_ratio:
        up.append((max(1, math.ceil(n * (p / slo - 1.0))), f"{p_name} {p:.0f} ms > SLO {slo:g} ms"))
    if role is Role.PREFILL and n and tick.queue_depth / n > config.max_queue_per_prefill_worker:
        up.append(
            (1, f"queue {tick.queue_depth} > {config.max_queue_per_prefill_worker:g} per worker")
        )
    if n == 0 and (tick.queue_depth > 0 or tick.demand_tokens_per_s(role) > 0):
        up.append((1, "work arriving and no active worker"))
    if needed is not None and needed > n:
        up.append((needed - n, _rate_reason(role, tick, config, needed)))
    if up:
        reasons.extend(reason for _, reason in up)
        room = bounds.max_workers - n
        if room <= 0:
            reasons.append(f"at max {bounds.max_workers}")
            return decide()
        return decide(add=min(max(step for step, _ in up), config.max_step, room))

    # Scale down: only when every signal says there is slack.
    if n <= bounds.min_workers:
        reasons.append(_steady(p_name, p, len(values)))
        return decide()
    blockers = []
    if p is not None and p >= slo * config.scale_down_ratio:
        blockers.append(f"{p_name} {p:.0f} ms >= {config.scale_down_ratio:g} x SLO")
    if tick.queue_depth > 0:
        blockers.append(f"queue {tick.queue_depth}")
    if needed is not None and needed >= n:
        blockers.append(f"rate needs {needed}")
    if any(w.age_s < config.cold_start_s for w in active):
        blockers.append("a worker is warming up")
    if any(w.draining for w in workers):
        blockers.append("a drain is under way")
    if blockers:
        reasons.append(_steady(p_name, p, len(values)) + "; no scale-down: " + ", ".join(blockers))
        return decide()
    drain = pick_drain(active, 1)
    reasons.append(f"slack: {_steady(p_name, p, len(values))}, queue 0")
    return decide(drain=drain)


def _rate_needed(role: Role, tick: TickInput, config: PlannerConfig) -> int | None:
    capacity = config.capacity(role)
    if capacity is None:
        return None
    demand = tick.demand_tokens_per_s(role)
    return math.ceil(demand / (capacity * config.target_utilization))


def _rate_reason(role: Role, tick: TickInput, config: PlannerConfig, needed: int) -> str:
    capacity = config.capacity(role)
    demand = tick.demand_tokens_per_s(role)
    return (
        f"rate match: {demand:.0f} tok/s needs {needed} workers at "
        f"{config.target_utilization:.0%} of {capacity:g} tok/s"
    )


def _steady(p_name: str, p: float | None, n_samples: int) -> str:
    if p is None:
        return f"{p_name} n/a ({n_samples} warm samples)"
    return f"{p_name} {p:.0f} ms"


def pick_drain(active: Sequence[WorkerView], count: int) -> tuple[str, ...]:
    """The least busy workers, youngest first among equals (least prefix cache to lose)."""
    ranked = sorted(
        active, key=lambda w: (w.inflight_requests + w.inflight_transfers, w.age_s, w.worker_id)
    )
    return tuple(w.worker_id for w in ranked[:count])


class ScalingActuator(Protocol):
    """What the controller actor implements to carry out decisions."""

    def add_workers(self, role: Role, count: int) -> None: ...

    def drain_workers(self, role: Role, worker_ids: Sequence[str]) -> None: ...

    def stop_workers(self, role: Role, worker_ids: Sequence[str]) -> None: ...


@runtime_checkable
class SwitchingActuator(ScalingActuator, Protocol):
    """An actuator that can also move a worker to the other role in place (a role switch:
    no restart, no model load)."""

    def switch_workers(self, role: Role, worker_ids: Sequence[str]) -> Sequence[str]:
        """Switch these workers (of the other role) to `role`; returns those it switches
        (the rest are drained, and workers of `role` started, as without a switch)."""
        ...


class Planner:
    """The pure core with its memory threaded through, logging every decision."""

    def __init__(self, config: PlannerConfig, memory: PlannerMemory | None = None) -> None:
        self.config = config
        self.memory = memory or PlannerMemory()

    def tick(self, tick: TickInput) -> ScalingDecision:
        decision = plan(tick, self.config, self.memory)
        self.memory = decision.memory
        log.info("planner %s", decision.describe())
        return decision

    def apply(self, decision: ScalingDecision, actuator: ScalingActuator) -> None:
        apply_decision(decision, actuator)


def apply_decision(decision: ScalingDecision, actuator: ScalingActuator) -> None:
    """Hand a decision to the actuator: stops first, then drains, then adds. When one role
    drains while the other adds and the actuator switches roles (`SwitchingActuator`), the
    drained workers switch to the growing role in place instead, as many as it adds."""
    drain = {d.role: d.drain for d in (decision.prefill, decision.decode)}
    add = {d.role: d.add for d in (decision.prefill, decision.decode)}
    if isinstance(actuator, SwitchingActuator):
        for shrink, grow in (
            (decision.prefill, decision.decode),
            (decision.decode, decision.prefill),
        ):
            movers = shrink.drain[: grow.add]
            if movers:
                switched = set(actuator.switch_workers(grow.role, movers))
                drain[shrink.role] = tuple(w for w in shrink.drain if w not in switched)
                add[grow.role] -= len(switched)
    for d in (decision.prefill, decision.decode):
        if d.stop:
            actuator.stop_workers(d.role, d.stop)
        if drain[d.role]:
            actuator.drain_workers(d.role, drain[d.role])
        if add[d.role]:
            actuator.add_workers(d.role, add[d.role])
