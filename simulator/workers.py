"""The simulated workers: one engine loop each, stepping through time taken from a profile.

A worker's role says which queues it serves:

- PREFILL: a FCFS queue of prompts, chunked at `max_num_batched_tokens` per step (several
  prompts share a step); a prompt whose last chunk ran samples its first token at the step's
  end and leaves for its decode worker (the hand-off, in simulator/cluster.py);
- DECODE: continuous batching of the requests handed to it (up to `max_num_seqs`), one token
  each per step; a prompt placed here to prefill locally is chunked into the same steps;
- COLOCATED: a DECODE worker that every prompt is placed on (no prefill pool);
- SPLIT: a prefill loop and a decode loop at once on one device (simulator/split.py).

Step time is `decode_step_s(batch, mean context)` plus `prefill_step_s(chunk tokens)` when the
step carries prefill, with the profile's serving overheads (`serving.decode_step_s` added to
the decode part, the prefill part times `serving.prefill_factor`).
KV blocks are counted per request (prompt + tokens so far, rounded up to blocks) against the
pool; admission's worst-case reservation keeps the pool from overflowing,
so preemption is not modelled (an overflow is counted in `kv_overflows`).
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loadtests.workload import PlannedRequest
from planner.perf_profile import PerfProfile
from router.placement import PrefillReason
from simulator.gaps import TokenGaps
from vocabulary.numeric import cdiv

RUN_STEPS = 64
"""The most decode steps one event applies (`SimWorker.plan_run`)."""


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    SPLIT = "split"


@dataclass
class SimRequest:
    """One request's way through the simulated cluster (times in seconds from the start)."""

    planned: PlannedRequest
    block_hashes: tuple[int, ...]
    """The prompt's block hashes (`block_hashes`), () once the request ended."""
    sent_s: float = 0.0
    cached_tokens: int = 0
    """Prompt tokens the placed prefill (or local) worker already held."""
    reserved_blocks: int = 0
    decode_worker: str = ""
    prefill_worker: str = ""
    """The worker that prefilled it (a prefill worker, or its decode worker)."""
    cached_by: dict[str, int] = field(default_factory=dict)
    """Between admission and placement in one event: worker id → leading prompt blocks it
    holds (workers holding none left out)."""
    placement: PrefillReason | None = None
    """Why it was prefilled where it was (None: never placed)."""
    remaining_prefill: int = 0
    context: int = 0
    """Tokens in the KV cache (prompt + generated)."""
    tokens: int = 0
    """Output tokens so far."""
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    token_times: list[float] | None = None
    """Every token's time, kept only when the simulation was asked to trace them
    (`Simulation(trace_tokens=True)`); the run's gaps are in `TokenGaps` either way."""
    handoff_s: float = 0.0
    decode_reserved: int = 0
    """Blocks its decode worker counts for it from placement until it runs there
    (`SimWorker.expect`)."""
    status: str = "OK"
    done_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.planned.prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.planned.max_tokens

    def emit_token(self, now: float, gaps: TokenGaps) -> None:
        """A token at `now` (its gap from the one before added to `gaps`)."""
        if self.tokens:
            gaps.add(now - self.last_token_s)
        else:
            self.first_token_s = now
        self.last_token_s = now
        self.tokens += 1
        if self.token_times is not None:
            self.token_times.append(now)


@dataclass
class DecodeRun:
    """Decode steps of one unchanged batch that one event applies: step i ends at `ends[i]`
    after `seconds[i]`; none but the last takes a new block or finishes a request, so no step
    before the last changes what the router reads. Work that reaches the worker during it cuts
    it at the step under way (simulator/cluster.py `_cut_run`)."""

    decodes: list[SimRequest]
    started_s: float
    seconds: list[float]
    ends: list[float]
    token: int = 0
    """Which scheduled event applies it (a cut schedules another)."""
    steps: int = 0
    """The steps that event applies."""

    def step_start(self, steps: int) -> float:
        """When its step `steps` (1-based) started: the end of the one before."""
        return self.ends[steps - 2] if steps >= 2 else self.started_s


class PrefixIndex:
    """Which workers hold each block hash: every worker's `PrefixCache` in one map, so the
    cached prefix of a prompt on every worker is one walk along its hashes (the router's Redis
    prefix index, exact: no staleness)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}

    def cached_blocks(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """worker id → leading blocks of `hashes` it holds (workers holding none left out)."""
        out: dict[str, int] = {}
        if not hashes:
            return out
        first = self.holders.get(hashes[0])
        if not first:
            return out
        live = set(first)
        n = 1
        for h in hashes[1:]:
            here = self.holders.get(h)
            still = live & here if here else set()
            for worker_id in live - still:
                out[worker_id] = n
            live = still
            if not live:
                return out
            n += 1
        for worker_id in live:
            out[worker_id] = n
        return out


class PrefixCache:
    """The block hashes a worker holds, least recently used evicted first (at most `capacity`);
    kept in step with the shared `PrefixIndex`."""

    def __init__(self, capacity: int, owner: str = "", index: PrefixIndex | None = None) -> None:
        self.capacity = capacity
        self.owner = owner
        self.index = index or PrefixIndex()
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def cached_blocks(self, hashes: tuple[int, ...]) -> int:
        """Leading blocks of `hashes` held here."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def store(self, hashes: tuple[int, ...]) -> None:
        blocks, holders = self._blocks, self.index.holders
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                holders.setdefault(h, set()).add(self.owner)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            held = holders[h]
            held.discard(self.owner)
            if not held:
                del holders[h]


def block_hashes(token_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """A chain over the prompt's full blocks (tuple hashing of ints is not salted)."""
    chain: list[int] = []
    h = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, token_ids[start : start + block_size]))
        chain.append(h)
    return tuple(chain)


class StepTimes:
    """A worker's step times from its profile (`PerfProfile.decode_step_s`, `prefill_step_s`
    with the serving overheads), with what depends on the batch alone kept: the decode curve
    at each batch size, the prefill time at each (tokens, cached)."""

    def __init__(self, profile: PerfProfile) -> None:
        self.profile = profile
        self._curves: dict[int, tuple[list[int], list[float], float]] = {}
        self._overhead_s = profile.serving.decode_step_s
        self._prefill: dict[tuple[int, int], float] = {}

    def decode_s(self, batch_size: int, context_tokens: float) -> float:
        """`interpolate` along the batch size's curve, its arithmetic inlined (the simulator
        reads it once a step)."""
        curve = self._curves.get(batch_size)
        if curve is None:
            xs, ys = self.profile.decode_step_curve(batch_size)
            curve = self._curves[batch_size] = (xs, ys, min(ys))
        xs, ys, floor = curve
        last = len(xs) - 1
        if last == 0:
            return ys[0] + self._overhead_s
        i = bisect_left(xs, context_tokens)
        i = 1 if i < 1 else last if i > last else i
        x0, y0 = xs[i - 1], ys[i - 1]
        y = y0 + (ys[i] - y0) * (context_tokens - x0) / (xs[i] - x0)
        return (y if y > floor else floor) + self._overhead_s

    def prefill_s(self, tokens: int, cached: int) -> float:
        seconds = self._prefill.get((tokens, cached))
        if seconds is None:
            factor = self.profile.serving.prefill_factor
            seconds = self.profile.prefill_step_s(tokens, cached) * factor
            self._prefill[(tokens, cached)] = seconds
        return seconds


class SimWorker:
    """One worker's queues and KV pool; `plan_step` picks the next batch, `finish_step`
    applies it."""

    def __init__(
        self,
        worker_id: str,
        role: Role,
        profile: PerfProfile,
        kv_blocks: int,
        index: PrefixIndex | None = None,
        step_times: StepTimes | None = None,
        token_budget: int = 0,
        gaps: TokenGaps | None = None,
    ) -> None:
        """`token_budget`: prefill tokens per step (0: the profile's max_num_batched_tokens);
        `gaps`: where its requests' inter-token gaps are counted (the simulation's)."""
        header = profile.header
        self.gaps = gaps if gaps is not None else TokenGaps()
        self.worker_id = worker_id
        self.role = role
        self.profile = profile
        self.step_times = step_times or StepTimes(profile)
        self.block_size = header.block_size
        self.token_budget = token_budget or header.max_num_batched_tokens
        self.max_num_seqs = header.max_num_seqs
        self.total_blocks = kv_blocks
        self.used_blocks = 0
        self.kv_overflows = 0
        self.prefill_queue: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.arriving: list[SimRequest] = []
        """Handed off, joining the batch at the next step."""
        self.inflight_transfer_blocks = 0
        self.expected = 0
        """Requests placed here to decode that are not running yet (as the router counts its
        reservations: a local prefill, or a prefill and hand-off elsewhere)."""
        self.reserved_decode_blocks = 0
        """The blocks of the requests in `expected` (each its prompt + max_tokens), counted in
        its decode load until they run here, as the live router counts a reservation
        (`router/cluster_view.py:DecodeReservation`) until the worker's reports show the
        request: prompts placed while others prefill elsewhere spread over the decode workers
        instead of all going to the one whose blocks the hand-offs have not reached yet."""
        self.busy = False
        self.run: DecodeRun | None = None
        """The decode steps under way when several were planned at once (`plan_run`)."""
        self.busy_s = 0.0
        self.cache = PrefixCache(kv_blocks, worker_id, index)
        self.queued_prefill_tokens = 0
        """Prompt tokens in `prefill_queue` yet to compute (the load report's figure)."""
        self.dispatched_prefill_tokens = 0
        self.in_hop = 0
        """Requests placed here to prefill whose prompt has not reached the worker yet."""
        self.placed_prompt_tokens = 0
        """Prompt tokens of every request placed here to prefill (the engine's cache-query
        counter, the planner's prompt-token rate)."""
        self.handing_off = 0
        """Prefilled requests whose KV a decode worker is still pulling (leases held)."""
        """Uncached prompt tokens the router placed here that have not reached the worker yet
        (the router's hop): the live router counts them from placement on
        (`router/cluster_view.py:WorkerEntry.dispatched_prefill_tokens`)."""

    # ---- load, as the router sees it --------------------------------------------------------

    @property
    def routed_prefill_tokens(self) -> int:
        """The prefill queue as the router counts it (`WorkerEntry.queued_prefill_tokens`):
        the worker's figure plus what was dispatched to it, so prompts placed in one burst
        see each other and spread over the workers."""
        return self.queued_prefill_tokens + self.dispatched_prefill_tokens

    @property
    def free_blocks(self) -> int:
        return max(0, self.total_blocks - self.used_blocks)

    @property
    def active_blocks(self) -> int:
        """Blocks in use and reserved (the router's decode cost, with in-flight transfers)."""
        return self.used_blocks + self.reserved_decode_blocks

    def expect(self, r: SimRequest, blocks: int) -> None:
        """`r` was placed here to decode: counted until it runs (`started`)."""
        self.expected += 1
        r.decode_reserved = blocks
        self.reserved_decode_blocks += blocks

    def started(self, r: SimRequest) -> None:
        """`r` runs here (or ended before it could): no longer expected; its reservation goes
        (once: a preempted request comes back expected without one, as the router knows
        nothing of a preemption)."""
        self.expected -= 1
        self.reserved_decode_blocks -= r.decode_reserved
        r.decode_reserved = 0

    # ---- blocks -----------------------------------------------------------------------------

    def allocate(self, blocks: int) -> None:
        self.used_blocks += blocks
        if self.used_blocks > self.total_blocks:
            self.kv_overflows += 1

    def hold_prompt_blocks(self, r: SimRequest) -> None:
        """`r` was placed here to prefill: its cached prefix's blocks are held from now on."""
        self.allocate(self.blocks_for(r.context))

    def blocks_for(self, tokens: int) -> int:
        return cdiv(tokens, self.block_size)

    # ---- the loop ---------------------------------------------------------------------------

    def enqueue_prefill(self, r: SimRequest) -> None:
        self.prefill_queue.append(r)
        self.queued_prefill_tokens += r.remaining_prefill

    def has_work(self) -> bool:
        return bool(self.prefill_queue or self.running or self.arriving)

    def idle(self) -> bool:
        """Nothing queued, running, on its way here or lent to a hand-off: safe to stop."""
        return not (self.has_work() or self.in_hop or self.expected or self.handing_off
                    or self.inflight_transfer_blocks)  # fmt: skip

    def plan_step(self) -> tuple[float, list[tuple[SimRequest, int]], list[SimRequest]]:
        """(step seconds, prefill chunks (request, tokens), decoding requests) of the next
        step; the chunks are taken from the queue when the step is applied."""
        if self.arriving:
            for r in self.arriving:
                self.started(r)
            self.running.extend(self.arriving)
            self.arriving.clear()
        decodes = self.running[: self.max_num_seqs]
        chunks: list[tuple[SimRequest, int]] = []
        if self.prefill_queue:
            budget = self.token_budget - len(decodes)
            for r in self.prefill_queue:
                if budget <= 0 or len(decodes) + len(chunks) >= self.max_num_seqs:
                    break
                n = min(r.remaining_prefill, budget)
                chunks.append((r, n))
                budget -= n
        seconds = 0.0
        if decodes:
            context = sum([r.context for r in decodes]) / len(decodes)
            seconds += self.step_times.decode_s(len(decodes), context)
        if chunks:
            tokens = sum(n for _, n in chunks)
            cached = sum(r.cached_tokens for r, _ in chunks)
            seconds += self.step_times.prefill_s(tokens, cached)
        return seconds, chunks, decodes

    def finish_step(
        self,
        now: float,
        chunks: list[tuple[SimRequest, int]],
        decodes: list[SimRequest],
        started_s: float = -1.0,
        seconds: float = 0.0,
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply a step that ran from `started_s` for `seconds` and ended at `now`: (prompts
        whose prefill finished, requests that finished decoding). A finished prompt has its
        first token; on a decode or colocated worker it joins the batch here. A request whose
        last token came at `started_s` (it ran in the step before) has `seconds` as its gap.
        """
        gaps = self.gaps
        prefilled = []
        for r, n in chunks:
            r.remaining_prefill -= n
            self.queued_prefill_tokens -= n
            grow = self.blocks_for(r.context + n) - self.blocks_for(r.context)
            self.allocate(grow)
            r.context += n
            if r.remaining_prefill == 0:
                self.prefill_queue.remove(r)
                r.emit_token(now, gaps)
                self.cache.store(r.block_hashes)
                prefilled.append(r)
        finished = []
        block_size = self.block_size
        grow = 0
        followed = 0  # requests whose gap is this step
        for r in decodes:
            context = r.context
            if context % block_size == 0:  # the next token starts a block
                grow += 1
            r.context = context + 1
            if r.last_token_s == started_s:
                followed += 1
            else:
                gaps.add(now - r.last_token_s)
            r.last_token_s = now
            r.tokens += 1
            if r.token_times is not None:
                r.token_times.append(now)
            if r.tokens >= r.planned.max_tokens:
                finished.append(r)
        if grow:  # as `allocate` once per block: an overflow counted per block past the pool
            over = self.used_blocks + grow - self.total_blocks
            self.used_blocks += grow
            if over > 0:
                self.kv_overflows += min(grow, over)
        if followed:
            gaps.add_many(seconds, followed)
        for r in finished:
            self.running.remove(r)
            self.used_blocks -= self.blocks_for(r.context)
        if self.role is not Role.PREFILL:
            for r in prefilled:
                self.started(r)
                if r.tokens >= r.max_tokens:
                    self.used_blocks -= self.blocks_for(r.context)
                    finished.append(r)
                else:
                    self.running.append(r)
        return prefilled, finished

    def plan_run(
        self, started_s: float, first_s: float, decodes: list[SimRequest]
    ) -> DecodeRun | None:
        """The steps from the one planned (`plan_step`: `decodes` alone, `first_s` long,
        started at `started_s`) up to the first that finishes a request or takes a new block
        (it included; at most `RUN_STEPS`), each timed as `plan_step` would time it; None when
        that is the planned step alone, or the next steps may differ (a prompt queued here,
        requests beyond `max_num_seqs`)."""
        if self.role is Role.PREFILL or self.prefill_queue or len(decodes) < len(self.running):
            return None
        block_size = self.block_size
        k = RUN_STEPS
        for r in decodes:
            left = r.planned.max_tokens - r.tokens  # its last token's step
            block = -r.context % block_size + 1  # the step whose token starts a block
            m = left if left < block else block
            if m < k:
                if m <= 1:
                    return None
                k = m
        b = len(decodes)
        total = sum([r.context for r in decodes])
        decode_s = self.step_times.decode_s
        t = started_s + first_s
        seconds, ends = [first_s], [t]
        for i in range(1, k):
            step = decode_s(b, (total + i * b) / b)  # every context i tokens longer
            t = t + step
            seconds.append(step)
            ends.append(t)
        return DecodeRun(decodes, started_s, seconds, ends)

    def advance_run(self, run: DecodeRun, steps: int) -> None:
        """Apply the first `steps` - 1 steps of `run` (the last one is `finish_step`'s, with
        what it may allocate or finish): as many tokens to each request, their gaps."""
        n = steps - 1
        if n < 1:
            return
        gaps = self.gaps
        started, first, last = run.started_s, run.ends[0], run.ends[n - 1]
        followed = 0
        for r in run.decodes:
            if r.last_token_s == started:
                followed += 1
            else:
                gaps.add(first - r.last_token_s)
            r.last_token_s = last
            r.context += n
            r.tokens += n
            if r.token_times is not None:
                r.token_times.extend(run.ends[:n])
        if followed:
            gaps.add_many(run.seconds[0], followed)
        b = len(run.decodes)
        for step in run.seconds[1:n]:
            gaps.add_many(step, b)

    def release_prefill_blocks(self, r: SimRequest) -> None:
        """A prefill worker's blocks of `r` return once the decode worker pulled them."""
        self.used_blocks -= self.blocks_for(r.context)
