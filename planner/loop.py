"""The planner's shell in the controller: measure, decide (the pure core), actuate.

Each tick (`PlannerSettings.interval_s`):

1. measure: every worker's load (polled by the controller), and from every router the TTFT/TPOT
   samples of the last `sample_window_s` plus its admission queue;
2. decide: `build_tick` turns those into a `TickInput`, and the planner of `mode` into a
   `ScalingDecision` (pure: `Planner.tick`, planner/core.py, or `PredictivePlanner.tick`,
   planner/predictive.py, with the reactive rules as its guard), recorded with its reasons
   (and to a replayable trace);
3. actuate through `ControllerActuator` (the `ScalingActuator`): start workers of a role with
   the role's placement, drain workers (they stop admitting and finish in-flight work), stop a
   drained worker once the planner sees it idle; when one role shrinks while the other grows,
   switch the shrinking role's workers to the other role in place instead (no restart:
   deploy/control/role_switch.py; a switching worker counts as a starting one of its new
   role); and keep Ray's autoscaler asked, through
   `ray.autoscaler.sdk.request_resources`, for room for every worker the planner wants (the
   request shrinks again on scale-down, so idle nodes can go).

A tick is skipped while a rebalance runs (the operator's target wins). Starting workers count
as active (age 0, warming up), so a pending worker waiting for a node is not asked for twice.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from planner.core import (
    LatencySample,
    Planner,
    PlannerConfig,
    Role,
    RoleBounds,
    ScalingDecision,
    TickInput,
    WorkerView,
)
from planner.metrics import PlannerMetrics
from planner.perf_profile import PerfProfile, load_perf_profile
from planner.predictive import PlannerMode, PredictiveConfig, PredictivePlanner
from planner.replay import TraceWriter
from router.metrics import Arrivals
from vocabulary.worker_api import WorkerLoad, WorkerRole

if TYPE_CHECKING:
    from router.router_server import RouterSignals
    from vocabulary.worker_api import ActorPlacement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannerSettings:
    """The controller's planner loop: off unless `enabled` (`pdserve up --planner`)."""

    enabled: bool = False
    interval_s: float = 5.0
    """Seconds between ticks."""
    sample_window_s: float = 30.0
    """Latency samples older than this are not used (idle roles then show no samples)."""
    request_resources: bool = True
    """Ask Ray's autoscaler for room for every wanted worker (no effect without one)."""
    trace_path: str | None = None
    """Append every TickInput to this JSONL file (on the controller's node), for
    `python -m planner.replay`."""
    config: PlannerConfig = field(default_factory=PlannerConfig)
    """SLOs, bounds per role and thresholds of the pure core."""
    mode: str = PlannerMode.REACTIVE.value
    """`reactive`: the rules of planner/core.py; `predictive`: worker targets from a profile
    at a forecast load, set a worker's start-up ahead, the reactive rules as a guard
    (planner/predictive.py)."""
    predictive: PredictiveConfig = field(default_factory=PredictiveConfig)
    """The predictive planner's profile, lead time, forecast and corrections."""
    switch_timeout_s: float = 300.0
    """Seconds a worker the planner moves from a shrinking role to a growing one in place
    (a role switch) may take to drain; past them it stays in its role."""

    def __post_init__(self) -> None:
        known = [m.value for m in PlannerMode]
        if self.mode not in known:
            raise ValueError(f"mode: one of {', '.join(known)}, got {self.mode!r}")

    @property
    def kind(self) -> PlannerMode:
        return PlannerMode(self.mode)

    @property
    def mode_text(self) -> str:
        """`reactive`, or `predictive` with its profile and lead time (the status line's)."""
        if self.kind is not PlannerMode.PREDICTIVE:
            return self.mode
        p = self.predictive
        return f"predictive: profile {p.profile}, start-up {p.startup_s:g}s ahead"


@dataclass(frozen=True)
class WorkerSnapshot:
    """One registered worker as the controller sees it at a tick."""

    worker_id: str
    role: Role
    ready_at_s: float | None
    """Wall-clock time it became ready; None while starting."""
    draining: bool
    load: WorkerLoad | None
    """None while starting, or when its load call failed this tick."""


@dataclass(frozen=True)
class PlannerRecord:
    """One decision as logged: when, what, and whether anything was asked of the actuator."""

    at_s: float
    tick: int
    acted: bool
    text: str


def planner_role(role: WorkerRole) -> Role:
    return Role.PREFILL if role is WorkerRole.PREFILL else Role.DECODE


def build_tick(
    tick: int,
    now_s: float,
    workers: Sequence[WorkerSnapshot],
    signals: Sequence[RouterSignals],
    prefill_tokens_per_s: float = 0.0,
    since_s: float | None = None,
    arrived: Arrivals | None = None,
) -> TickInput:
    """The planner's input from one round of measurements (pure).

    Queue depth is the routers' admission queues plus the prefill workers' waiting requests
    (decode workers' in colocated mode). Output tokens/s is estimated from the decode workers:
    running requests x 1000 / TPOT (the worker's median TPOT in the window, else the cluster's).
    The arrival rate and mean prompt length are those of the requests the routers received
    since `since_s` (`arrived`; None: not known); the mean output length that of the requests
    that finished since then (their TTFT samples; those of the whole window when none did).
    """
    views: dict[Role, list[WorkerView]] = {Role.PREFILL: [], Role.DECODE: []}
    has_prefill = any(w.role is Role.PREFILL for w in workers)
    queue = sum(s.queued_requests for s in signals)
    ttft = [s for sig in signals for s in sig.samples.ttft]
    tpot = [s for sig in signals for s in sig.samples.tpot]
    all_tpot = [s.value_ms for s in tpot if s.value_ms > 0]
    decode_rate = 0.0
    for w in workers:
        load = w.load
        age = 0.0 if w.ready_at_s is None else max(0.0, now_s - w.ready_at_s)
        inflight = transfers = 0
        if load is not None:
            inflight = load.inflight_requests
            if w.role is Role.PREFILL:
                transfers = load.leases_held
            else:
                transfers = load.transfer.in_flight_transfers + load.transfer.queued_transfers
            if w.role is Role.PREFILL or not has_prefill:
                queue += load.engine.num_waiting
            if w.role is Role.DECODE and load.engine.num_running:
                own = [s.value_ms for s in tpot if s.worker_id == w.worker_id and s.value_ms > 0]
                typical = statistics.median(own or all_tpot) if (own or all_tpot) else 0.0
                if typical > 0:
                    decode_rate += load.engine.num_running * 1000.0 / typical
        views[w.role].append(
            WorkerView(
                worker_id=w.worker_id,
                age_s=age,
                inflight_requests=inflight,
                inflight_transfers=transfers,
                draining=w.draining,
                ready=w.ready_at_s is not None,
            )
        )
    finished = [s for s in ttft if s.output_tokens and (since_s is None or s.at_s > since_s)]
    finished = finished or [s for s in ttft if s.output_tokens]
    span = now_s - since_s if since_s is not None else 0.0
    got = arrived if arrived is not None and span > 0 else Arrivals()
    return TickInput(
        tick=tick,
        now_s=now_s,
        prefill_workers=tuple(sorted(views[Role.PREFILL], key=lambda v: v.worker_id)),
        decode_workers=tuple(sorted(views[Role.DECODE], key=lambda v: v.worker_id)),
        ttft_samples=tuple(LatencySample(s.worker_id, s.at_s, s.value_ms) for s in ttft),
        tpot_samples=tuple(LatencySample(s.worker_id, s.at_s, s.value_ms) for s in tpot),
        queue_depth=queue,
        prefill_tokens_per_s=prefill_tokens_per_s,
        decode_tokens_per_s=decode_rate,
        arrival_rps=got.requests / span if got.requests else 0.0,
        mean_prompt_tokens=got.prompt_tokens / got.requests if got.requests else 0.0,
        mean_output_tokens=statistics.fmean(s.output_tokens for s in finished) if finished else 0.0,
    )


def resource_bundles(placements: Sequence[ActorPlacement]) -> list[dict[str, float]]:
    """One autoscaler bundle per worker: its CPUs, GPUs and custom resources (zeros left out)."""
    bundles = []
    for p in placements:
        bundle = {"CPU": p.num_cpus, "GPU": p.num_gpus, **dict(p.resources)}
        bundles.append({k: float(v) for k, v in sorted(bundle.items()) if v})
    return [b for b in bundles if b]


class ResourceRequester:
    """Keeps Ray's autoscaler asked for room for a set of workers (`request_resources` is a
    floor on cluster capacity that replaces the previous one; an empty list releases it)."""

    def __init__(self, request: Callable[..., None] | None = None) -> None:
        if request is None:
            from ray.autoscaler.sdk import request_resources

            request = request_resources
        self._request = request
        self.bundles: list[dict[str, float]] | None = None
        """What was asked last (None: nothing yet)."""

    def update(self, placements: Sequence[ActorPlacement]) -> bool:
        """Ask for room for exactly these workers; returns whether the request changed."""
        bundles = resource_bundles(placements)
        if bundles == self.bundles:
            return False
        self._request(bundles=bundles)
        self.bundles = bundles
        return True

    def release(self) -> None:
        if self.bundles:
            self._request(bundles=[])
            self.bundles = []


class PlannerHost(Protocol):
    """What the planner loop needs from the controller actor."""

    @property
    def rebalancing(self) -> bool: ...

    async def worker_snapshots(self) -> list[WorkerSnapshot]: ...

    async def router_signals(self, since_s: float) -> list[RouterSignals]: ...

    def spawn_worker(self, role: WorkerRole) -> str: ...

    def begin_switch(self, worker_id: str, role: WorkerRole) -> bool: ...

    def begin_drain(self, worker_id: str) -> None: ...

    def stop_when_drained(self, worker_id: str) -> None: ...

    def wanted_placements(self) -> list[ActorPlacement]: ...

    def record_event(self, message: str) -> None: ...


class ControllerActuator:
    """`ScalingActuator` over the controller: starts return at once (the worker starts in the
    background, as a pending actor until a node with its resources exists)."""

    def __init__(
        self, host: PlannerHost, decode_role: WorkerRole, resources: ResourceRequester | None
    ) -> None:
        self.host = host
        self.decode_role = decode_role
        self.resources = resources

    def _worker_role(self, role: Role) -> WorkerRole:
        return WorkerRole.PREFILL if role is Role.PREFILL else self.decode_role

    def add_workers(self, role: Role, count: int) -> None:
        started = [self.host.spawn_worker(self._worker_role(role)) for _ in range(count)]
        self.host.record_event(f"planner: starting {role.value} worker(s) {started}")
        self.sync_resources()

    def drain_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        for worker_id in worker_ids:
            self.host.begin_drain(worker_id)
        self.host.record_event(f"planner: draining {role.value} worker(s) {list(worker_ids)}")
        self.sync_resources()

    def stop_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        for worker_id in worker_ids:
            self.host.stop_when_drained(worker_id)

    def switch_workers(self, role: Role, worker_ids: Sequence[str]) -> list[str]:
        """Switch workers of the other role to `role` in place (`SwitchingActuator`): they
        drain, flip and admit as `role` in the background; those the host refuses (another
        shape, not ready) are left to be drained and replaced."""
        switched = [w for w in worker_ids if self.host.begin_switch(w, self._worker_role(role))]
        if switched:
            self.host.record_event(f"planner: switching worker(s) {switched} to {role.value}")
        return switched

    def sync_resources(self) -> None:
        """Ask the autoscaler for room for the starting and ready workers (not the draining)."""
        if self.resources is None:
            return
        try:
            if self.resources.update(self.host.wanted_placements()):
                self.host.record_event(f"planner: request_resources {self.resources.bundles}")
        except Exception as e:  # no autoscaler API here: scaling still works within the nodes
            log.warning("request_resources failed: %s", e)


class PlannerLoop:
    """Runs the pure planner on a timer inside the controller and applies its decisions."""

    def __init__(
        self,
        settings: PlannerSettings,
        host: PlannerHost,
        decode_role: WorkerRole,
        resources: ResourceRequester | None = None,
        clock: Callable[[], float] = time.time,
        metrics: PlannerMetrics | None = None,
        profile: PerfProfile | None = None,
    ) -> None:
        """`profile`: the predictive planner's model (default: read from
        `settings.predictive.profile`)."""
        config = settings.config
        if decode_role is not WorkerRole.DECODE:  # colocated or split: no prefill role to scale
            config = replace(config, prefill=RoleBounds(0, 0))
        self.settings = replace(settings, config=config)
        self.host = host
        self.planner: Planner | PredictivePlanner = Planner(config)
        if settings.kind is PlannerMode.PREDICTIVE:
            if profile is None:
                if settings.predictive.profile is None:
                    raise ValueError("planner.predictive.profile: required in predictive mode")
                profile = load_perf_profile(Path(settings.predictive.profile))
            self.planner = PredictivePlanner(config, settings.predictive, profile)
        self.actuator = ControllerActuator(host, decode_role, resources)
        self.clock = clock
        self.metrics = metrics
        self.records: deque[PlannerRecord] = deque(maxlen=1000)
        self.ticks = 0
        self._last_tick_s: float | None = None
        self._arrived: Arrivals | None = None
        """The routers' arrival counters, summed, at the last tick."""
        self._prompt_tokens: dict[str, tuple[float, int]] = {}
        self._trace_file: IO[str] | None = None
        self._trace: TraceWriter | None = None
        if settings.trace_path:
            path = Path(settings.trace_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._trace_file = path.open("a")
            self._trace = TraceWriter(self._trace_file, config)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.tick_once()
            except Exception:
                log.exception("planner tick failed")

    async def tick_once(self) -> ScalingDecision | None:
        """Measure, decide, record, actuate; None when skipped (a rebalance is running)."""
        if self.host.rebalancing:
            return None
        now = self.clock()
        workers = await self.host.worker_snapshots()
        signals = await self.host.router_signals(now - self.settings.sample_window_s)
        rate = self._prefill_rate(now, workers)
        arrived = self._arrivals(signals)
        tick = build_tick(self.ticks, now, workers, signals, rate, self._last_tick_s, arrived)
        self.ticks += 1
        self._last_tick_s = now
        decision = self.planner.tick(tick)
        acted = any(d.add or d.drain or d.stop for d in (decision.prefill, decision.decode))
        record = PlannerRecord(now, tick.tick, acted, decision.describe())
        self.records.append(record)
        if self.metrics is not None:
            self.metrics.observe(tick, decision)
        if acted:
            log.info("planner %s", record.text)
        if self._trace is not None:
            self._trace.write(tick)
        self.planner.apply(decision, self.actuator)
        self.actuator.sync_resources()
        return decision

    def _arrivals(self, signals: Sequence[RouterSignals]) -> Arrivals | None:
        """What the routers received since the last tick (None at the first). A counter that
        went back (a router restarted) counts from 0."""
        total = Arrivals(
            sum(s.arrived.requests for s in signals), sum(s.arrived.prompt_tokens for s in signals)
        )
        last, self._arrived = self._arrived, total
        if last is None:
            return None
        if total.requests < last.requests or total.prompt_tokens < last.prompt_tokens:
            return total
        return Arrivals(total.requests - last.requests, total.prompt_tokens - last.prompt_tokens)

    def _prefill_rate(self, now: float, workers: Sequence[WorkerSnapshot]) -> float:
        """Prompt tokens/s over the prefill workers since the last tick (from their
        cumulative prefix-cache lookup counters, which count every prompt token)."""
        rate = 0.0
        seen: dict[str, tuple[float, int]] = {}
        for w in workers:
            if w.load is None or w.role is not Role.PREFILL:
                continue
            count = w.load.engine.num_cache_query_tokens
            seen[w.worker_id] = (now, count)
            prev = self._prompt_tokens.get(w.worker_id)
            if prev is not None and now > prev[0]:
                rate += max(0, count - prev[1]) / (now - prev[0])
        self._prompt_tokens = seen
        return rate

    def close(self) -> None:
        if self.actuator.resources is not None:
            try:
                self.actuator.resources.release()
            except Exception as e:
                log.warning("releasing the resource request failed: %s", e)
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None


def settings_from_dict(data: dict[str, Any]) -> PlannerSettings:
    """PlannerSettings from a config-file mapping: the loop's fields plus PlannerConfig's
    (role bounds as `prefill: {min_workers: 1, max_workers: 4}`)."""
    from planner.replay import config_with_overrides

    loop_fields = {"enabled", "interval_s", "sample_window_s", "request_resources", "trace_path"}
    loop = {k: v for k, v in data.items() if k in loop_fields}
    core = {k: v for k, v in data.items() if k not in {*loop_fields, "mode", "predictive"}}
    return PlannerSettings(
        **loop,
        config=config_with_overrides(PlannerConfig(), core),
        mode=data.get("mode", PlannerMode.REACTIVE.value),
        predictive=PredictiveConfig(**data.get("predictive", {})),
    )
