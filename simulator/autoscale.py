"""The simulator with the live planner in the loop: the controller's own `PlannerLoop`
(planner/loop.py: `build_tick`, the reactive or predictive core, `ControllerActuator`) ticks on
simulated time over a `PlannerHost` made of the simulated cluster, so a recorded trace replays
through the same decisions a real cluster's controller would make.

Lifecycle of a worker the planner asks for:

1. requested: `spawn_worker` creates it (it counts as active, age 0, from now on);
2. serving: `startup_s` later placement and admission may choose it;
3. draining: `begin_drain` takes it out of placement; what it holds runs to the end;
4. stopped: `stop_when_drained` stops it once idle (else it says so, and the planner asks
   again at a later tick).

A worker's seconds run from its request (the run's start for the initial ones) to its stop, or
to the end of the run (the last request's end). The routers' signals are one simulated
router's: TTFT and TPOT samples of the requests that finished in the window (as the live
router records them, at the request's end, with its output length), its admission queue and
in-flight count, and the requests that arrived (with their prompt tokens).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.workload import PlannedRequest
from planner.core import Role as PlannerRole
from planner.loop import PlannerLoop, PlannerSettings, WorkerSnapshot
from planner.perf_profile import PerfProfile
from router.metrics import Arrivals, RecentSamples, TimedSample
from router.router_server import RouterSignals
from simulator.cluster import Simulation
from simulator.report import to_record
from simulator.shape import ClusterShape
from simulator.workers import Role, SimRequest, SimWorker
from vocabulary.engine_io import EngineLoad
from vocabulary.transfer_load import TransferLoad
from vocabulary.worker_api import ActorPlacement, WorkerLoad, WorkerRole, WorkerState


@dataclass
class WorkerSpan:
    """One worker's life on simulated time (seconds from the start of the run)."""

    worker_id: str
    role: Role
    requested_s: float
    ready_s: float | None = None
    draining_s: float | None = None
    stopped_s: float | None = None

    def seconds(self, end_s: float) -> float:
        """From its request to its stop (or `end_s`)."""
        stop = end_s if self.stopped_s is None else min(self.stopped_s, end_s)
        return max(0.0, stop - self.requested_s)


@dataclass(frozen=True)
class ScalingRun:
    """A replay's requests, every worker's span and the planner's decisions."""

    requests: list[SimRequest]
    spans: tuple[WorkerSpan, ...]
    decisions: tuple[str, ...]
    """One line per tick (`ScalingDecision.describe`), at its simulated time."""
    end_s: float
    """When the last request ended."""

    def worker_seconds(self, role: Role | None = None) -> float:
        return sum(s.seconds(self.end_s) for s in self.spans if role in (None, s.role))


class SimHost:
    """The `PlannerHost` the planner loop drives: the simulated cluster, its one router's
    signals, and the spans of its workers."""

    def __init__(self, sim: Simulation, startup_s: float) -> None:
        self.sim = sim
        self.startup_s = startup_s
        self.spans: dict[str, WorkerSpan] = {}
        self.draining: set[str] = set()
        self.events: list[str] = []
        self._samples: deque[tuple[TimedSample, TimedSample | None]] = deque()
        self._seen = 0
        self._arrived = Arrivals()
        for w in sim.workers.values():
            self.spans[w.worker_id] = WorkerSpan(w.worker_id, w.role, 0.0, ready_s=0.0)

    # ---- PlannerHost ----------------------------------------------------------------------

    @property
    def rebalancing(self) -> bool:
        return False

    async def worker_snapshots(self) -> list[WorkerSnapshot]:
        return [self._snapshot(w) for w in self.sim.workers.values()]

    async def router_signals(self, since_s: float) -> list[RouterSignals]:
        self._take_finished()
        while self._samples and self._samples[0][0].at_s < since_s:
            self._samples.popleft()
        ttft = tuple(t for t, _ in self._samples)
        tpot = tuple(p for _, p in self._samples if p is not None)
        arrived = self.sim.requests
        for r in arrived[self._arrived.requests :]:
            self._arrived = self._arrived.plus(r.prompt_tokens)
        samples = RecentSamples(ttft, tpot)
        return [RouterSignals(samples, len(self.sim.queue), self.sim.admitted, self._arrived)]

    def spawn_worker(self, role: WorkerRole) -> str:
        sim = self.sim
        worker = sim.add_worker(Role.PREFILL if role is WorkerRole.PREFILL else Role.DECODE)
        span = WorkerSpan(worker.worker_id, worker.role, sim.now)
        self.spans[worker.worker_id] = span

        def ready() -> None:
            if worker.worker_id in sim.workers and worker.worker_id not in self.draining:
                span.ready_s = sim.now
                sim.serve(worker)

        sim.at(sim.now + self.startup_s, ready)
        return worker.worker_id

    def begin_switch(self, worker_id: str, role: WorkerRole) -> bool:
        """No role switch here: the simulated cluster drains the worker and starts another
        (a switch's drain and flip are not modelled), so the planner's figures stay those of
        restarts."""
        return False

    def begin_drain(self, worker_id: str) -> None:
        worker = self.sim.workers.get(worker_id)
        if worker is None or worker_id in self.draining:
            return
        self.draining.add(worker_id)
        self.spans[worker_id].draining_s = self.sim.now
        self.sim.retire(worker)

    def stop_when_drained(self, worker_id: str) -> None:
        worker = self.sim.workers.get(worker_id)
        if worker is None or worker_id not in self.draining:
            return
        if not worker.idle():
            self.record_event(f"{worker_id} still has in-flight work; not stopped")
            return
        self.spans[worker_id].stopped_s = self.sim.now
        self.draining.discard(worker_id)
        self.sim.remove(worker)

    def wanted_placements(self) -> list[ActorPlacement]:
        return []

    def record_event(self, message: str) -> None:
        self.events.append(f"{self.sim.now:8.1f}s {message}")

    # ---- what the controller would poll -----------------------------------------------------

    def _snapshot(self, w: SimWorker) -> WorkerSnapshot:
        span = self.spans[w.worker_id]
        role = PlannerRole.PREFILL if w.role is Role.PREFILL else PlannerRole.DECODE
        draining = w.worker_id in self.draining
        if span.ready_s is None and not draining:
            return WorkerSnapshot(w.worker_id, role, None, False, None)
        engine = EngineLoad(
            num_waiting=len(w.prefill_queue),
            num_running=len(w.running) + len(w.arriving),
            num_waiting_prefill_tokens=w.queued_prefill_tokens,
            num_free_blocks=w.free_blocks,
            num_total_blocks=w.total_blocks,
            num_handoff_blocks=0,
            num_transfer_blocks=w.inflight_transfer_blocks,
            num_cache_query_tokens=w.placed_prompt_tokens,
            num_cache_hit_tokens=0,
            num_preemptions=0,
        )
        inflight = (len(w.prefill_queue) + len(w.running) + len(w.arriving) + w.in_hop
                    + w.expected)  # fmt: skip
        load = WorkerLoad(
            worker_id=w.worker_id,
            role=WorkerRole.PREFILL if w.role is Role.PREFILL else WorkerRole.DECODE,
            state=WorkerState.DRAINING if draining else WorkerState.READY,
            engine=engine,
            inflight_requests=inflight,
            requests_done=0,
            transfer=TransferLoad(
                in_flight_transfers=1 if w.inflight_transfer_blocks else 0,
                in_flight_blocks=w.inflight_transfer_blocks,
            ),
            leases_held=w.handing_off,
        )
        return WorkerSnapshot(w.worker_id, role, span.ready_s, draining, load)

    def _take_finished(self) -> None:
        """The samples of the requests that ended since the last look (served ones only)."""
        finished = self.sim.finished
        for r in finished[self._seen :]:
            record = to_record(r, None)
            if not record.ok or record.ttft_ms is None:
                continue
            ttft = TimedSample(r.prefill_worker, r.done_s, record.ttft_ms, r.tokens)
            tpot = None
            if record.tpot_ms is not None:
                tpot = TimedSample(r.decode_worker, r.done_s, record.tpot_ms)
            self._samples.append((ttft, tpot))
        self._seen = len(finished)


def replay(
    profile: PerfProfile,
    shape: ClusterShape,
    planned: Sequence[PlannedRequest],
    settings: PlannerSettings,
    startup_s: float,
) -> ScalingRun:
    """`planned` through a cluster that starts as `shape` and that the planner of `settings`
    scales every `settings.interval_s`, its new workers serving `startup_s` after they are
    asked for (the predictive planner predicts with `profile`)."""
    sim = Simulation(profile, shape)
    host = SimHost(sim, startup_s)
    loop = PlannerLoop(settings, host, WorkerRole.DECODE, clock=lambda: sim.now, profile=profile)
    decisions: list[str] = []
    total = len(planned)
    events = asyncio.new_event_loop()

    def tick() -> None:
        decision = events.run_until_complete(loop.tick_once())
        if decision is not None:
            decisions.append(f"{sim.now:8.1f}s {decision.describe()}")
        if len(sim.finished) < total:
            sim.at(sim.now + settings.interval_s, tick)

    sim.at(settings.interval_s, tick)
    try:
        requests = sim.run(planned)
    finally:
        events.close()
    end_s = max((r.done_s for r in requests), default=0.0)
    return ScalingRun(requests, tuple(host.spans.values()), tuple(decisions), end_s)
