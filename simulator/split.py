"""The simulated split worker (engine mode `split`, `pdserve up --split N`): one engine, one KV
pool, a prefill loop and a decode loop running at once, each on its own SM partition of one
GPU (engine/core/prefill_lane.py, engine/core/sm_split.py).

Lifecycle of a request placed here:

    1. queued       in the prefill loop's FCFS queue (`prefill_queue`)
    2. prefilling   the prefill loop runs chunks of queued prompts (never a decode), one step
                    in flight at a time, taking blocks only while the pool keeps one free block
                    per running decode plus `SplitParams.headroom_blocks` free (the engine's rule)
    3. handed over  its last chunk sampled the first token: it joins the decode loop's batch
                    (a change of block ownership, ~2 µs measured: taken as free)
    4. decoding     one token per decode step until it ends; a decode step short of blocks
                    preempts the newest running request, which goes back to the head of the
                    prefill queue to be recomputed (the engine's rule)

How the SMs are split is the engine's own code (vocabulary/split_policy.py), asked before
each step of either loop: `choose_decode_sms` over the decode load, through a `SplitGovernor`
(at most one change per `resize_interval_s`) and with the decode steps' slowdown beside a
prefill learned by a `StepCorrection` from the simulated steps, as the engine learns it from
its measured ones. A fixed split (`decode_sms` > 0) never moves.

Step times, from the profile measured on the whole device (simulator/overlap.py runs the two
loops' steps side by side):

    decode step  = (profile decode step) x bw(total SMs) / bw(decode SMs)
                   [x decode_slowdown while a prefill step runs]  + serving decode overhead
    prefill step = (profile prefill step, serving factor applied) x total SMs / prefill SMs
                   [x prefill_slowdown while a decode step runs]

where bw is the `BandwidthCurve` the split decides with, and prefill SMs are the SMs the
decode partition leaves (every SM, shared, while decode holds the whole device: the engine's
unpartitioned pair).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from planner.perf_profile import PerfProfile
from simulator.gaps import TokenGaps
from simulator.overlap import Lane, SharedDevice
from simulator.workers import PrefixIndex, Role, SimRequest, SimWorker, StepTimes
from vocabulary.split_policy import (
    BandwidthCurve,
    DecodeLoad,
    SplitGovernor,
    SplitModel,
    StepCorrection,
    choose_decode_sms,
    decode_shares,
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}
"""Bytes per KV element by the profile header's dtype (the KV bytes a decode step reads)."""

HISTORY = 4096
"""How many split decisions `SplitWorker.decisions` keeps."""


@dataclass(frozen=True)
class SplitParams:
    """A split worker's partitions and what running side by side costs each loop.

    The defaults are the engine's config defaults (engine/config.py `split_*`) and the
    figures measured on an H100 (132 SMs) in docs/benchmarks.md, "Split worker"."""

    total_sms: int = 132
    """SMs of the device (H100 SXM and H200: 132)."""
    decode_sms: int = 0
    """The decode partition's SMs, fixed (engine `split_decode_sms`); 0: adaptive, among
    `vocabulary/split_policy.py:decode_shares` of the device (16-88 SMs of 132)."""
    tpot_target_s: float = 0.020
    """The decode step the adaptive split sizes its partition for (engine
    `split_tpot_target_ms`, 20 ms)."""
    resize_interval_s: float = 1.0
    """The least time between two changes of the split (engine `split_resize_interval_s`)."""
    headroom_blocks: int = 8
    """Blocks the prefill loop leaves free beyond one per running decode (engine
    `split_decode_headroom_blocks`)."""
    peak_bytes_s: float = 2649e9
    """The decode step's bandwidth on the whole device: an H100's decode GEMMs on all 132 SMs
    drew 2649 GB/s ("Split worker", alone at 132 SMs)."""
    knee: float = 0.45
    """The share of SMs from which decode bandwidth stops rising (`BandwidthCurve.saturating`,
    the policy's default shape): 2155 GB/s predicted at 48 SMs where 2193 was measured."""
    curve_points: tuple[tuple[int, float], ...] = ()
    """(SMs, bytes/s) of a measured curve (`python -m benchmarks sm_partition`) instead of the
    saturating shape; the last point is taken as the whole device's."""
    decode_slowdown: float = 1 / 0.74
    """Decode step time beside a prefill over alone at the same SMs: decode drew 0.72-0.76x
    of its alone bandwidth beside a matmul on the other SMs (H100; 1923 → 1388 GB/s at 32 SMs)."""
    prefill_slowdown: float = 1 / 0.82
    """Prefill step time beside decode over alone at the same SMs: the matmul kept 0.77-0.87x
    of its alone rate beside decode on the other SMs (H100)."""
    launch_s: float = 0.3e-3
    """The split model's fixed cost of a decode step (`SplitModel.launch_s`)."""
    weight_bytes: int = 0
    """Bytes a decode step streams besides the KV (0: inferred from the profile's smallest
    decode step at the whole device's bandwidth; the profile does not record them)."""

    def __post_init__(self) -> None:
        if self.total_sms < 2:
            raise ValueError(f"--split-total-sms: must be >= 2, got {self.total_sms}")
        if not 0 <= self.decode_sms < self.total_sms:
            raise ValueError(
                f"--split-decode-sms: must be in [0, {self.total_sms}) (0: adaptive), got "
                f"{self.decode_sms}"
            )
        if not self.tpot_target_s > 0:
            raise ValueError(f"--split-tpot-ms: must be > 0, got {self.tpot_target_s * 1e3}")
        if self.resize_interval_s < 0 or self.headroom_blocks < 0:
            raise ValueError(
                "--split-resize-interval / split headroom: must be >= 0, got "
                f"{self.resize_interval_s} and {self.headroom_blocks}"
            )
        for name in ("decode_slowdown", "prefill_slowdown"):
            if not getattr(self, name) >= 1:
                flag = "--split-" + name.replace("_", "-")
                raise ValueError(f"{flag}: must be >= 1, got {getattr(self, name)}")
        if not self.peak_bytes_s > 0 or not 0 < self.knee <= 1:
            raise ValueError(
                f"split curve: peak_bytes_s > 0 and 0 < knee <= 1, got {self.peak_bytes_s}, "
                f"{self.knee}"
            )

    def curve(self) -> BandwidthCurve:
        if self.curve_points:
            return BandwidthCurve(self.curve_points)
        return BandwidthCurve.saturating(self.total_sms, self.peak_bytes_s, self.knee)

    def shares(self) -> tuple[int, ...]:
        """The decode partitions the split moves among (one when fixed)."""
        return (self.decode_sms,) if self.decode_sms else decode_shares(self.total_sms)


@dataclass(frozen=True)
class SplitDecision:
    """One ask of the split policy: the load it saw, the slowdown it was told, what it wanted
    and the split in use after the governor."""

    at_s: float
    load: DecodeLoad
    slowdown: float
    wanted: int
    decode_sms: int


def kv_bytes_per_token(profile: PerfProfile) -> int:
    h = profile.header
    per = DTYPE_BYTES.get(h.dtype.removeprefix("torch."), 2)
    return 2 * h.num_layers * h.num_kv_heads * h.head_dim * per // h.tensor_parallel_size


def split_model(profile: PerfProfile, params: SplitParams) -> SplitModel:
    """The `SplitModel` the engine would build on this device: the weights' bytes given or
    inferred so that its step on the whole device is the profile's smallest decode step."""
    curve = params.curve()
    weight = params.weight_bytes
    if not weight:
        smallest = min(profile.decode, key=lambda p: (p.batch_size, p.context_tokens))
        kv = smallest.batch_size * smallest.context_tokens * kv_bytes_per_token(profile)
        alone = smallest.step_s - params.launch_s
        weight = max(0, round(alone * curve.at(params.total_sms)) - kv)
    return SplitModel(weight, curve, params.launch_s)


class SplitWorker(SimWorker):
    """A split worker's two loops over one pool; `plan_prefill` / `plan_decode` pick each
    loop's next step, `finish_prefill` / `finish_decode` apply it."""

    def __init__(
        self,
        worker_id: str,
        profile: PerfProfile,
        kv_blocks: int,
        params: SplitParams,
        device: SharedDevice,
        index: PrefixIndex | None = None,
        step_times: StepTimes | None = None,
        token_budget: int = 0,
        gaps: TokenGaps | None = None,
    ) -> None:
        """`device`: the lanes of `prefill_lane` and `decode_lane` (made with
        `make_lanes`)."""
        super().__init__(worker_id, Role.SPLIT, profile, kv_blocks, index, step_times,
                         token_budget, gaps)  # fmt: skip
        self.params = params
        self.device = device
        self.prefill_lane, self.decode_lane = device.lanes
        self.model = split_model(profile, params)
        self.kv_bytes_per_token = kv_bytes_per_token(profile)
        self.shares = params.shares()
        self.total_sms = params.total_sms
        self.governor = SplitGovernor(params.resize_interval_s)
        self.correction = StepCorrection()
        self.decode_sms = params.decode_sms or max(
            (s for s in self.shares if s <= self.total_sms // 2), default=self.total_sms // 2
        )
        """The decode partition in use (adaptive: starts at the largest share of at most half
        the device, as `engine/core/sm_split.py:SMSplit` does)."""
        self.decisions: deque[SplitDecision] = deque(maxlen=HISTORY)
        self.resizes = 0
        self.preemptions = 0
        self._full = self.model.curve.at(self.total_sms)
        self._holding: set[int] = set()
        """Requests (planned index) whose blocks the prefill loop took."""
        self._pending: tuple[DecodeLoad, int] | None = None

    @staticmethod
    def make_lanes(params: SplitParams) -> tuple[Lane, Lane]:
        return (Lane("prefill", params.prefill_slowdown), Lane("decode", params.decode_slowdown))

    # ---- blocks -----------------------------------------------------------------------------

    def hold_prompt_blocks(self, r: SimRequest) -> None:
        """The prefill loop takes a prompt's blocks when it first schedules it (under the
        headroom rule), not at placement."""

    def _reserve(self) -> int:
        return len(self.running) + self.params.headroom_blocks

    # ---- the split --------------------------------------------------------------------------

    def decide(self, now: float) -> int:
        """Ask the split policy before a step of either loop; the decode SMs in use after."""
        if self.params.decode_sms:
            return self.decode_sms
        tokens = sum(r.context for r in self.running)
        waiting = bool(self.prefill_queue) or self.prefill_lane.busy
        load = DecodeLoad(len(self.running), tokens * self.kv_bytes_per_token, waiting)
        slowdown = self.correction.factor
        model = replace(self.model, slowdown=slowdown)
        wanted = choose_decode_sms(load, self.shares, self.total_sms, model,
                                   self.params.tpot_target_s)  # fmt: skip
        new = self.governor.decide(wanted, now)
        if new is not None and new != self.decode_sms:
            self.decode_sms = new
            self.resizes += 1
        self.decisions.append(SplitDecision(now, load, slowdown, wanted, self.decode_sms))
        return self.decode_sms

    @property
    def prefill_sms(self) -> int:
        """The prefill partition's SMs (every SM, shared, while decode holds them all)."""
        left = self.total_sms - self.decode_sms
        return left if left > 0 else self.total_sms

    # ---- the prefill loop -------------------------------------------------------------------

    def plan_prefill(self, now: float) -> tuple[float, list[tuple[SimRequest, int]]]:
        """(seconds alone, chunks) of the prefill loop's next step, blocks taken; no chunk
        when nothing is queued or the pool cannot spare the first chunk's blocks."""
        chunks: list[tuple[SimRequest, int]] = []
        if not self.prefill_queue:
            return 0.0, chunks
        self.decide(now)
        budget = self.token_budget
        for r in self.prefill_queue:
            if budget <= 0 or len(chunks) >= self.max_num_seqs:
                break
            n = min(r.remaining_prefill, budget)
            held = self.blocks_for(r.context) if r.planned.index in self._holding else 0
            grow = self.blocks_for(r.context + n) - held
            if self.free_blocks - grow < self._reserve():
                break
            self.allocate(grow)
            self._holding.add(r.planned.index)
            chunks.append((r, n))
            budget -= n
        if not chunks:
            return 0.0, chunks
        tokens = sum(n for _, n in chunks)
        cached = sum(r.cached_tokens for r, _ in chunks)
        seconds = self.step_times.prefill_s(tokens, cached) * self.total_sms / self.prefill_sms
        return seconds, chunks

    def finish_prefill(
        self, now: float, chunks: list[tuple[SimRequest, int]]
    ) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply a prefill step that ended at `now`: (prompts prefilled, requests that ended
        with their first token). The prefilled join the decode batch."""
        prefilled, finished = [], []
        for r, n in chunks:
            r.remaining_prefill -= n
            self.queued_prefill_tokens -= n
            r.context += n
            if r.remaining_prefill == 0:
                self.prefill_queue.remove(r)
                self._holding.discard(r.planned.index)
                r.emit_token(now, self.gaps)
                self.cache.store(r.block_hashes)
                prefilled.append(r)
        for r in prefilled:
            self.started(r)
            if r.tokens >= r.max_tokens:
                self.used_blocks -= self.blocks_for(r.context)
                finished.append(r)
            else:
                self.running.append(r)
        return prefilled, finished

    # ---- the decode loop --------------------------------------------------------------------

    def plan_decode(self, now: float) -> tuple[float, list[SimRequest]]:
        """(seconds alone, decoding requests) of the decode loop's next step, their new blocks
        taken (preempting the newest requests when the pool is short)."""
        for r in self.arriving:
            self.started(r)
        self.running.extend(self.arriving)
        self.arriving.clear()
        if not self.running:
            return 0.0, []
        sms = self.decide(now)
        block_size = self.block_size
        while True:
            decodes = self.running[: self.max_num_seqs]
            need = sum(1 for r in decodes if r.context % block_size == 0)
            if need <= self.free_blocks or len(self.running) == 1:
                break
            self._preempt(self.running[-1])
        self.allocate(need)
        context = sum(r.context for r in decodes) / len(decodes)
        overhead = self.profile.serving.decode_step_s
        engine_s = self.step_times.decode_s(len(decodes), context) - overhead
        seconds = engine_s * self._full / self.model.curve.at(sms) + overhead
        beside = self.prefill_lane.busy or bool(self.prefill_queue)
        if beside and sms < self.total_sms:
            tokens = sum(r.context for r in self.running)
            load = DecodeLoad(len(self.running), tokens * self.kv_bytes_per_token, True)
            self._pending = (load, sms)
        else:
            self._pending = None
        return seconds, decodes

    def _preempt(self, r: SimRequest) -> None:
        """`r` gives its blocks back and is recomputed from its first token on (no cached
        prefix counted), at the head of the prefill queue."""
        self.running.remove(r)
        self.used_blocks -= self.blocks_for(r.context)
        r.remaining_prefill, r.context, r.cached_tokens = r.context, 0, 0
        self.prefill_queue.appendleft(r)
        self.queued_prefill_tokens += r.remaining_prefill
        self.expected += 1
        self.preemptions += 1

    def finish_decode(
        self, now: float, decodes: list[SimRequest], seconds: float
    ) -> list[SimRequest]:
        """Apply a decode step that ended at `now` after `seconds`: the requests that
        finished. A step planned while the prefill loop had work teaches the correction its
        slowdown (as the engine's `Adaptive.observe`)."""
        if self._pending is not None:
            load, sms = self._pending
            engine_s = seconds - self.profile.serving.decode_step_s
            self.correction.observe(engine_s, self.model.step_s(load, sms))
        self._pending = None
        finished = []
        for r in decodes:
            r.context += 1
            r.emit_token(now, self.gaps)
            if r.tokens >= r.max_tokens:
                finished.append(r)
        for r in finished:
            self.running.remove(r)
            self.used_blocks -= self.blocks_for(r.context)
        return finished
