"""The discrete-event simulation of a cluster: arrivals → admission → placement → prefill →
hand-off → decode, on simulated time, with the live system's own pure cores.

Lifecycle of a request (times in seconds from the start of the run):

1. arrives at its planned send time (a later turn of a conversation: when the turn before it
   ended, plus its think time, as the load driver sends it);
2. admission: `admission/policy.py:evaluate` over a `ClusterSnapshot` built from the simulated
   workers (the fields the router fills from worker load reports: total and free decode blocks,
   in-flight transfer blocks, queued prefill tokens, prefill throughput from the profile) and
   an `AdmissionLedger` of what the simulated router admitted. ADMIT goes on; QUEUE waits in
   FCFS order until a release admits it or its bounded wait ends (RESOURCE_EXHAUSTED);
   REJECT ends it with RESOURCE_EXHAUSTED;
3. placement: `router/placement.py:place` over candidates built from the simulated workers and
   their prefix caches (the index is exact here: no staleness), with the shape's local-prefill
   policy; the `cost` policy predicts with this profile (`PerfProfile.prefill_cost_model`);
4. prefill on the chosen worker (simulator/workers.py), `profile.serving.request_s` after the
   decision (the router's hop), first token at the step's end: TTFT. A prompt sent to a
   prefill worker counts in that worker's queue from the decision on, as the live router
   counts what it dispatched, so a burst placed within one hop spreads over the workers;
5. hand-off: `profile.handoff.seconds(blocks)` after the first token the request joins its
   decode worker's batch (the decode blocks are allocated when it starts). Prefill workers
   may step on a profile of their own (`prefill_profile`: another TP size of the model); the
   hand-off is still the decode profile's, whatever the two TP sizes: a TP a → TP b pull
   moves the same KV bytes (kv_transfer re-slices the heads between the layouts), and the
   pulling side's measured cost stands for it (an assumption: no run has timed a pull
   between unequal TP sizes against an equal one);
6. decode, one token per step, until max_tokens (outputs are exact: ignore_eos workloads);
7. release: the reservation returns, the admission queue is tried again.
"""

from __future__ import annotations

import bisect
import functools
import gc
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable

from admission.decision import Decision, DecisionKind
from admission.policy import evaluate
from admission.snapshot import (
    AdmissionLedger,
    AdmissionRequest,
    ClusterSnapshot,
)
from loadtests.workload import PlannedRequest
from planner.perf_profile import PerfProfile, check_same_worker
from router.placement import (
    NoWorkerError,
    Placement,
    PlacementConfig,
    place,
)
from simulator.gaps import TokenGaps
from simulator.overlap import Lane, SharedDevice
from simulator.shape import ClusterShape
from simulator.split import SplitWorker
from simulator.views import LoadViews
from simulator.workers import (
    DecodeRun,
    PrefixIndex,
    Role,
    SimRequest,
    SimWorker,
    StepTimes,
    block_hashes,
)
from vocabulary.numeric import cdiv

REJECTED = "RESOURCE_EXHAUSTED"
UNAVAILABLE = "UNAVAILABLE"
ARRIVAL_SEQ = -(1 << 62)
"""Planned arrivals' event sequence numbers start here (plus the request's index): below every
other event's, as if all had been scheduled first."""


class Simulation:
    """One run of a workload through a cluster of simulated workers."""

    def __init__(
        self,
        profile: PerfProfile,
        shape: ClusterShape,
        prefill_profile: PerfProfile | None = None,
        trace_tokens: bool = False,
    ) -> None:
        """Decode, colocated and split workers step on `profile`, prefill workers on
        `prefill_profile` (None: `profile`); each profile's TP size must be the shape's for
        its role, and the two must be of one model (`check_same_worker`). `trace_tokens`:
        keep every token's time on its request (`SimRequest.token_times`; memory grows with
        the tokens, for tests and small runs)."""
        self.profile = profile
        self.prefill_profile = prefill_profile or profile
        check_same_worker(profile, self.prefill_profile)
        for role, tp, made in (("prefill", shape.prefill_tp, self.prefill_profile),
                               ("decode", shape.decode_tp, profile)):  # fmt: skip
            if made.header.tensor_parallel_size != tp:
                raise ValueError(f"{role} workers of TP {tp} cannot step on a profile of TP "
                                 f"{made.header.tensor_parallel_size}")  # fmt: skip
        self.shape = shape
        self.block_size = profile.header.block_size
        blocks = profile.header.num_kv_blocks
        if shape.shared_device:
            blocks //= 2
        blocks = shape.kv_blocks or blocks
        self.index = PrefixIndex()
        self.gaps = TokenGaps()
        """Every inter-token gap of the run (the ITL samples)."""
        self.trace_tokens = trace_tokens
        self._kv_blocks = blocks
        self._step_times = StepTimes(profile)
        self._prefill_kv_blocks, self._prefill_step_times = blocks, self._step_times
        if prefill_profile is not None:
            own = prefill_profile.header.num_kv_blocks // (2 if shape.shared_device else 1)
            self._prefill_kv_blocks = shape.kv_blocks or own
            self._prefill_step_times = StepTimes(prefill_profile)
        self.token_budget = shape.chunk_tokens or profile.header.max_num_batched_tokens
        """A worker's prefill tokens per step."""
        largest = min(profile.largest_prefill_tokens(),
                      self.prefill_profile.largest_prefill_tokens())  # fmt: skip
        if shape.chunk_tokens > largest:
            raise ValueError(
                f"--chunk: {shape.chunk_tokens} tokens is past the profile's largest prefill "
                f"step ({largest} tokens): profile larger chunks (pdserve profile) to plan them"
            )

        def workers(prefix: str, role: Role, count: int) -> list[SimWorker]:
            return [self._new_worker(f"{prefix}{i}", role) for i in range(count)]

        self.prefill = workers("p", Role.PREFILL, shape.prefill)
        """The workers placement may choose (`serve`, `retire`)."""
        self.decode = workers("d", Role.DECODE, shape.decode)
        self.decode += workers("c", Role.COLOCATED, shape.colocated)
        self.decode += [self._split_worker(f"s{i}") for i in range(shape.split)]
        self._lanes: dict[str, Lane] = {}
        """Workers that share a device with another: their step lanes (simulator/overlap.py)."""
        if shape.shared_device:
            for p, d in zip(self.prefill, self.decode, strict=True):
                f = shape.shared_device_slowdown
                lanes = (Lane(p.worker_id, f), Lane(d.worker_id, f))
                SharedDevice(lanes, self.at, self._clock)
                self._lanes[p.worker_id], self._lanes[d.worker_id] = lanes
        self.workers = {w.worker_id: w for w in [*self.prefill, *self.decode]}
        """Every worker that exists: serving, starting (`add_worker`) or retired."""
        self._next_id = {Role.PREFILL: shape.prefill, Role.DECODE: shape.decode}
        self.throughput = self.prefill_profile.prefill_tokens_per_s()
        """Prefill workers' throughput (admission's prior)."""
        self.prefill_cost = profile.prefill_cost_model()
        """The `cost` policy's model: the decode profile's (a live router holds one)."""
        self._events: list[tuple[float, float, int, Callable[[], None]]] = []
        """(time, when it was scheduled, sequence, action): the order of scheduling breaks
        ties, and a decode run's step is scheduled as of when one event per step would have
        scheduled it (`_schedule_run`)."""
        self._scheduled_s = 0.0
        """When the event being handled was scheduled."""
        self._seq = itertools.count()
        self.now = 0.0
        self.queue: deque[tuple[SimRequest, float]] = deque()
        """Admission queue: (request, give-up time)."""
        self.reserved_blocks = 0
        self.admitted = 0
        self.requests: list[SimRequest] = []
        self.finished: list[SimRequest] = []
        """Requests in the order they ended (served or refused)."""
        self._followers: dict[int, list[PlannedRequest]] = {}
        """A turn's index → the turns planned to follow it (its conversation's next)."""
        self._turn_ends: dict[int, float] = {}
        """A conversation turn that ended before its next turn was planned (its index → when):
        a next turn is planned at its own send time, which may come after. A conversation's
        last turn stays here (a float a conversation)."""
        self._last_send_s = 0.0
        self._on_end: Callable[[SimRequest], None] | None = None
        self.events = 0
        """Events processed (the scale benchmark's count)."""
        self.placement_config = PlacementConfig(
            shape.uncached_block_weight,
            shape.thresholds.local_prefill_threshold_tokens,
            local_prefill_policy=shape.local_prefill,
            prefill_cost=self.prefill_cost,
            stall_weight=shape.stall_weight,
        )
        self.views = LoadViews(self.prefill, self.decode, self.throughput)
        """What the router sees of each worker, rebuilt for the workers an event touched."""

    # ---- the workers (a planner's actuation: simulator/autoscale.py) -------------------------

    def add_worker(self, role: Role) -> SimWorker:
        """A new worker of `role` (prefill or decode), not placed on until `serve`."""
        n = self._next_id[role]
        self._next_id[role] = n + 1
        worker = self._new_worker(f"{'p' if role is Role.PREFILL else 'd'}{n}", role)
        self.workers[worker.worker_id] = worker
        return worker

    def _new_worker(self, worker_id: str, role: Role) -> SimWorker:
        if role is Role.PREFILL:
            profile, blocks = self.prefill_profile, self._prefill_kv_blocks
            times = self._prefill_step_times
        else:
            profile, blocks, times = self.profile, self._kv_blocks, self._step_times
        return SimWorker(
            worker_id, role, profile, blocks, self.index, times, token_budget=self.token_budget,
            gaps=self.gaps,
        )  # fmt: skip

    def _split_worker(self, worker_id: str) -> SplitWorker:
        params = self.shape.split_params
        device = SharedDevice(SplitWorker.make_lanes(params), self.at, self._clock)
        return SplitWorker(
            worker_id, self.profile, self._kv_blocks, params, device, self.index,
            self._step_times, token_budget=self.token_budget, gaps=self.gaps,
        )  # fmt: skip

    def _clock(self) -> float:
        return self.now

    def serve(self, worker: SimWorker) -> None:
        """Placement and admission may choose `worker` from now on."""
        pool = self.prefill if worker.role is Role.PREFILL else self.decode
        if worker not in pool:
            pool.append(worker)
            self.views = LoadViews(self.prefill, self.decode, self.throughput)

    def retire(self, worker: SimWorker) -> None:
        """No new request goes to `worker`; what it holds runs to the end."""
        pool = self.prefill if worker.role is Role.PREFILL else self.decode
        if worker in pool:
            pool.remove(worker)
            self.views = LoadViews(self.prefill, self.decode, self.throughput)

    def remove(self, worker: SimWorker) -> None:
        """`worker` is stopped (retired and idle)."""
        self.retire(worker)
        del self.workers[worker.worker_id]

    # ---- the event loop ---------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None], scheduled_s: float | None = None) -> None:
        """Run `fn` at `t` (`scheduled_s`: as if scheduled then; default now)."""
        when = self.now if scheduled_s is None else scheduled_s
        heapq.heappush(self._events, (t, when, next(self._seq), fn))

    def run(
        self,
        planned: Iterable[PlannedRequest],
        on_end: Callable[[SimRequest], None] | None = None,
    ) -> list[SimRequest]:
        """Simulate `planned` (in send order, as `loadtests.workload.stream` and `generate`
        give it) to the end; the requests by index. It is pulled as simulated time reaches
        each send time, so a workload made lazily is never whole in memory. With `on_end`,
        each request goes to it as it ends (served or refused) and none is kept: the run
        returns [] and `requests` and `finished` stay empty."""
        self._on_end = on_end
        feed = iter(planned)
        upcoming = next(feed, None)
        events = self._events
        # The loop allocates many objects that live to the end of the run (requests, their
        # token times), and the collector's full passes over them cost more the longer the
        # run; it is back on afterwards.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while True:
                # every request due by the next event is in (a conversation's next turn
                # before the turn it follows can end: `_arrive_later`)
                while upcoming is not None and (not events or upcoming.send_at_s <= events[0][0]):
                    self._plan_arrival(upcoming)
                    upcoming = next(feed, None)
                if not events:
                    break
                self.now, self._scheduled_s, _, fn = heapq.heappop(events)
                self.events += 1
                fn()
        finally:
            if collecting:
                gc.enable()
        return sorted(self.requests, key=lambda r: r.planned.index)

    def _plan_arrival(self, p: PlannedRequest) -> None:
        if p.send_at_s < self._last_send_s:
            raise ValueError(f"planned requests out of send order at index {p.index}")
        self._last_send_s = p.send_at_s
        if p.after is None:
            # ordered as if every arrival had been scheduled at time 0 before any other event
            arrive: Callable[[], None] = functools.partial(self._arrive, p)
            heapq.heappush(self._events, (p.send_at_s, 0.0, ARRIVAL_SEQ + p.index, arrive))
            return
        ended = self._turn_ends.pop(p.after, None)
        if ended is None:
            self._followers.setdefault(p.after, []).append(p)
        else:
            self._arrive_later(p, ended)

    def _arrive_later(self, p: PlannedRequest, ended_s: float) -> None:
        """`p` follows a turn that ended at `ended_s`: it arrives its think time later (its
        planned send time at the earliest), as the load driver sends it."""
        at = max(p.send_at_s, ended_s + p.think_s)
        self.at(at, functools.partial(self._arrive, p), ended_s)

    # ---- router -----------------------------------------------------------------------------

    def _arrive(self, p: PlannedRequest) -> None:
        r = SimRequest(p, block_hashes(p.token_ids, self.block_size), sent_s=self.now)
        if self.trace_tokens:
            r.token_times = []
        if self._on_end is None:
            self.requests.append(r)
        decision = self._evaluate(r, waiting_ahead=len(self.queue))
        if decision.kind is DecisionKind.ADMIT:
            self._admit(r)
        elif decision.kind is DecisionKind.QUEUE:
            wait_s = decision.max_wait_ms / 1000.0
            self.queue.append((r, self.now + wait_s))
            self.at(self.now + wait_s, lambda: self._expire(r))
        else:
            self._end(r, REJECTED)

    def _evaluate(self, r: SimRequest, waiting_ahead: int) -> Decision:
        """Admission's decision for `r` now; leaves the prefix hits of `r` on every worker in
        `r.cached_by` for the placement that follows it in the same event."""
        r.cached_by = self.index.cached_blocks(r.block_hashes)
        best_cached = max(r.cached_by.values(), default=0)
        uncached = r.prompt_tokens - best_cached * self.block_size
        request = AdmissionRequest(r.planned.request_id, r.prompt_tokens, uncached, r.max_tokens)
        views = self.views.current()
        snapshot = ClusterSnapshot(
            prefill_workers=views.admission_prefill(),
            decode_workers=views.decode_loads,
            transfer_budget_blocks=self.shape.transfer_budget_blocks,
            router_inflight_requests=self.admitted,
            block_size=self.block_size,
        )
        ledger = AdmissionLedger(
            reserved_blocks=self.reserved_blocks,
            admitted_requests=self.admitted,
            waiting_requests=len(self.queue),
            waiting_ahead=waiting_ahead,
        )
        decision = evaluate(request, snapshot, self.shape.thresholds, ledger=ledger)
        r.reserved_blocks = decision.reserve_blocks
        return decision

    def _expire(self, r: SimRequest) -> None:
        for i, (queued, _) in enumerate(self.queue):
            if queued is r:
                del self.queue[i]
                self._end(r, REJECTED)
                return

    def _drain_queue(self) -> None:
        while self.queue:
            r, _ = self.queue[0]
            if self._evaluate(r, waiting_ahead=0).kind is not DecisionKind.ADMIT:
                return
            self.queue.popleft()
            self._admit(r)

    def _admit(self, r: SimRequest) -> None:
        self.admitted += 1
        self.reserved_blocks += r.reserved_blocks
        try:
            placement = self._place(r)
        except NoWorkerError:
            self._end(r, UNAVAILABLE)
            return
        r.decode_worker = placement.decode_worker_id
        r.prefill_worker = placement.prefill_worker_id or placement.decode_worker_id
        r.placement = placement.reason
        r.cached_by = {}
        target = self.workers[r.decode_worker]
        target.expect(r, cdiv(r.prompt_tokens + r.max_tokens, self.block_size))
        self.views.touch(target)
        worker = self.workers[placement.prefill_worker_id or placement.decode_worker_id]
        self.views.touch(worker)
        r.cached_tokens = placement.cached_blocks * self.block_size
        r.context = r.cached_tokens
        r.remaining_prefill = placement.uncached_tokens
        if r.remaining_prefill == 0:  # a fully cached prompt still computes its last token
            r.context -= 1
            r.remaining_prefill = 1
        worker.hold_prompt_blocks(r)
        # The live router counts a prompt sent to a prefill worker at once (`Orchestrator.
        # _prefill`), so requests placed within one hop see it; a local prefill it does not.
        dispatched = placement.uncached_tokens if placement.prefill_worker_id else 0
        worker.dispatched_prefill_tokens += dispatched
        worker.placed_prompt_tokens += r.prompt_tokens
        worker.in_hop += 1

        def queued() -> None:
            worker.dispatched_prefill_tokens -= dispatched
            worker.in_hop -= 1
            worker.enqueue_prefill(r)
            self.views.touch(worker)
            self._kick(worker)

        delay = self.profile.serving.request_s
        if delay > 0:
            self.at(self.now + delay, queued)
        else:
            queued()

    def _place(self, r: SimRequest) -> Placement:
        """`router.placement.place` over the workers that can win (simulator/views.py), with
        the prefix hits `_evaluate` found."""
        need = r.reserved_blocks
        prefill, decode = self.views.current().candidates(r.cached_by, need)
        return place(r.prompt_tokens, self.block_size, prefill, decode, self.placement_config, need)

    def _end(self, r: SimRequest, status: str) -> None:
        r.status = status
        r.done_s = self.now
        r.block_hashes = ()  # no cache reads them any more; a long run holds every request
        if self._on_end is None:
            self.finished.append(r)
        else:
            self._on_end(r)
        followers = self._followers.pop(r.planned.index, None)
        if followers is not None:
            for p in followers:
                self._arrive_later(p, self.now)
        elif r.planned.conversation is not None:  # its next turn, if any, is not planned yet
            self._turn_ends[r.planned.index] = self.now

    def _release(self, r: SimRequest) -> None:
        self.admitted -= 1
        self.reserved_blocks -= r.reserved_blocks
        self._end(r, "OK")
        self._drain_queue()

    # ---- workers ----------------------------------------------------------------------------

    def _kick(self, worker: SimWorker) -> None:
        """Start the worker's next step if it is idle and has work (a split worker's: each
        idle loop's)."""
        if worker.run is not None:
            self._cut_run(worker)
            return
        if isinstance(worker, SplitWorker):
            self._kick_split(worker)
            return
        if worker.busy or not worker.has_work():
            return
        # planning changes nothing the router reads (a request joining the batch moves from
        # `expected` to `running`): no touch
        seconds, chunks, decodes = worker.plan_step()
        if not chunks and not decodes:
            return
        worker.busy = True
        started = self.now
        lane = self._lanes.get(worker.worker_id)
        if lane is None:
            worker.busy_s += seconds
            run = None if chunks else worker.plan_run(started, seconds, decodes)
            if run is None:
                step = functools.partial(self._step_done, worker, chunks, decodes, started, seconds)
                self.at(started + seconds, step)
            else:
                worker.run = run
                self._schedule_run(worker, run, len(run.ends))
            return

        def done() -> None:
            worker.busy_s += self.now - lane.started_s
            self._step_done(worker, chunks, decodes, started, self.now - started)

        assert lane.device is not None
        lane.device.start(lane, seconds, done)

    # A decode run (simulator/workers.py `DecodeRun`): one event for steps that change nothing
    # the router reads before the last. It ends when one event per step would have, in the
    # same order among events at the same time (each scheduled as of its step's start), and
    # work that reaches its worker cuts it at the step under way, as that step's end would
    # have taken the work into the next.

    def _schedule_run(self, worker: SimWorker, run: DecodeRun, steps: int) -> None:
        run.token += 1
        run.steps = steps
        token = run.token
        self.at(run.ends[steps - 1], lambda: self._run_done(worker, run, steps, token),
                run.step_start(steps))  # fmt: skip

    def _run_done(self, worker: SimWorker, run: DecodeRun, steps: int, token: int) -> None:
        if run.token != token:  # cut: a later event applies it
            return
        worker.run = None
        for seconds in run.seconds[1:steps]:
            worker.busy_s += seconds
        worker.advance_run(run, steps)
        start = run.step_start(steps)
        self._step_done(worker, [], run.decodes, start, run.seconds[steps - 1])

    def _cut_run(self, worker: SimWorker) -> None:
        """Work reached `worker` during its run: the run ends with the step under way now, as
        one event per step orders this event and that step's end."""
        run = worker.run
        assert run is not None
        ends = run.ends
        steps = bisect.bisect_left(ends, self.now) + 1  # the first step ending now or later
        if ends[steps - 1] == self.now and self._scheduled_s >= run.step_start(steps):
            steps += 1  # that step's end would have come first: the next one is under way
        if steps < run.steps:  # never past an earlier cut: its work joins after that step
            self._schedule_run(worker, run, steps)

    def _kick_split(self, w: SplitWorker) -> None:
        device = w.device
        if not w.prefill_lane.busy:
            seconds, chunks = w.plan_prefill(self.now)
            if chunks:
                device.start(w.prefill_lane, seconds, lambda: self._prefill_done(w, chunks))
        if not w.decode_lane.busy:
            seconds, decodes = w.plan_decode(self.now)
            if decodes:
                started = self.now
                device.start(w.decode_lane, seconds,
                             lambda: self._decode_done(w, decodes, self.now - started))  # fmt: skip
        w.busy_s = device.busy_s
        self.views.touch(w)

    def _prefill_done(self, w: SplitWorker, chunks: list[tuple[SimRequest, int]]) -> None:
        _, finished = w.finish_prefill(self.now, chunks)
        self.views.touch(w)
        for r in finished:
            self._release(r)
        self._kick_split(w)

    def _decode_done(self, w: SplitWorker, decodes: list[SimRequest], seconds: float) -> None:
        finished = w.finish_decode(self.now, decodes, seconds)
        self.views.touch(w)
        for r in finished:
            self._release(r)
        self._kick_split(w)

    def _step_done(
        self,
        worker: SimWorker,
        chunks: list[tuple[SimRequest, int]],
        decodes: list[SimRequest],
        started_s: float,
        seconds: float,
    ) -> None:
        worker.busy = False
        used = worker.used_blocks
        prefilled, finished = worker.finish_step(self.now, chunks, decodes, started_s, seconds)
        # most decode steps change nothing the router reads (`views._state`): a block fills
        # every `block_size` tokens
        if chunks or finished or worker.used_blocks != used:
            self.views.touch(worker)
        for r in finished:
            self._release(r)
        if worker.role is Role.PREFILL:
            for r in prefilled:
                self._hand_off(worker, r)
        self._kick(worker)

    def _hand_off(self, source: SimWorker, r: SimRequest) -> None:
        target = self.workers[r.decode_worker]
        self.views.touch(target)
        self.views.touch(source)
        if r.max_tokens <= 1:
            source.release_prefill_blocks(r)
            target.started(r)
            self._release(r)
            return
        blocks = target.blocks_for(r.context)
        target.allocate(blocks)
        target.inflight_transfer_blocks += blocks
        source.handing_off += 1
        r.handoff_s = self.profile.handoff.seconds(blocks)

        def arrived() -> None:
            self.views.touch(target)
            self.views.touch(source)
            target.inflight_transfer_blocks -= blocks
            source.handing_off -= 1
            source.release_prefill_blocks(r)
            target.cache.store(r.block_hashes)
            target.arriving.append(r)
            self._kick(target)

        self.at(self.now + r.handoff_s, arrived)
