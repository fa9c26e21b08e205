"""The prefill lane of a split engine (`EngineMode.SPLIT`): one KV pool, two loops.

A split engine prefills on a lane of its own while its decode loop (the engine's own
scheduler and runner, CUDA graphs) runs on; each loop launches on its own stream, in its own
partition of the GPU's SMs where the driver has green contexts (engine/core/sm_split.py).
Lifecycle of a request:

    1. queued       `LLMEngine.add_request` puts it in the lane's scheduler (WAITING)
    2. prefilling   the lane runs chunked-prefill batches (never a decode) on the prefill
                    stream, one step in flight at a time; the engine polls that step between
                    its decode steps and never waits for it
    3. handed over  its last chunk sampled the first token: the request (RUNNING, with its
                    blocks and its adapter slot) leaves the lane's scheduler and joins the
                    decode scheduler's running list, a change of ownership: no block is
                    copied, allocated or freed
    4. decoding     the decode loop runs it to its end like any running request

A request whose first token ends it (eos, max_tokens=1) finishes in the lane; a decode
request preempted for blocks comes back to the head of the lane's queue to be recomputed.

Blocks (the rule `tests/unit/engine/test_split_engine.py` holds at pool exhaustion): the lane
takes blocks only while the pool keeps free one block per running decode request plus
`EngineConfig.split_decode_headroom_blocks`, when it admits a prompt and when a long
prompt's next chunk grows (`Scheduler.reserve`); the decode loop grows from the free blocks
alone and, short of them, preempts its own newest request. So the decode loop never waits
for a prefill step, and the lane never holds blocks the decode loop is about to grow into.

Streams: a block the decode loop gives back while its step is in flight may still be written
by that step, so when the decode loop's latest step has given blocks back, the prefill stream
waits (on the device, not the host) for it before the next prefill step (an unconditional
wait idled the prefill partition for half a decode step per prefill step); the lane's own
frees (an abort of a request in its step in flight) wait until that step has completed.
Each loop schedules on its own stream, so the host tier's copies a schedule makes (onboards
into fresh blocks, copies out of blocks it evicts) run in order with the step that reads or
overwrites those blocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.core.overlap import InflightStep
from engine.core.request import Request, RequestStatus
from engine.core.runner import ModelRunner
from engine.core.sampler import Sampler
from engine.core.scheduler import Scheduler
from engine.core.sm_split import SMSplit
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache import KVCache
from engine.lora.lora_registry import LoraRegistry
from engine.modeling.llama import LlamaModel
from vocabulary.engine_io import RequestOutput, SplitStatus
from vocabulary.model_config import ModelConfig
from vocabulary.split_policy import (
    BandwidthCurve,
    DecodeLoad,
    SplitGovernor,
    SplitModel,
    StepCorrection,
    choose_decode_sms,
)

log = logging.getLogger(__name__)


class LaneHost(Protocol):
    """What the lane needs of its engine (`LLMEngine`): the decode loop's scheduler and
    latest step, and the engine's own launch, read and final-output steps."""

    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    block_pool: BlockPool
    loras: LoraRegistry
    model: LlamaModel
    kv_cache: KVCache
    scheduler: Scheduler
    runner: ModelRunner
    _latest_launch: InflightStep | None

    def _launch(
        self, batch: ScheduledBatch, previous: InflightStep | None, lane: PrefillLane | None = ...
    ) -> InflightStep: ...

    def _complete(
        self, step: InflightStep, scheduler: Scheduler | None = ...
    ) -> list[RequestOutput]: ...

    def _final_output(self, request: Request) -> RequestOutput: ...


class PrefillLane:
    """The prefill loop's scheduler, runner, sampler and step in flight, over the engine's
    pool; `hand_over` moves a prefilled request to the decode loop's scheduler."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        streams: SMSplit,
        adaptive: Adaptive | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.streams = streams
        self.adaptive = adaptive
        """Sizes the decode partition step by step (None: a fixed split, or none)."""
        self.inflight: InflightStep | None = None
        self.pending_aborts: list[str] = []
        """Requests aborted while in the step in flight: freed once it has completed."""
        self.num_handoffs = 0
        self._handoff_s: deque[float] = deque(maxlen=1024)

    @classmethod
    def build(cls, engine: LaneHost, device: torch.device, streams: SMSplit) -> PrefillLane:
        """The prefill loop of `engine`: its own scheduler (leaving the decode loop room to
        grow) and eager runner over the engine's pool, on `streams` (both loops')."""
        config = engine.config
        headroom = config.split_decode_headroom_blocks
        scheduler = Scheduler(
            engine.block_pool,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_model_len=engine.max_model_len,
            adapters=engine.loras.cache,
            reserve=lambda: engine.scheduler.num_running + headroom,
        )
        runner = ModelRunner(
            engine.model, engine.kv_cache, replace(config, cuda_graphs=False), engine.loras.weights
        )
        sampler = Sampler(config.seed + 1, device, engine.model_config.vocab_size)
        adaptive = None
        if streams.partitioned and not config.split_decode_sms:
            # The decode loop's CUDA graphs run on the partition they were captured in
            # (engine/core/cuda_graphs.py): one set per share the split may move to, each
            # replayed when the decode loop runs on that share's stream.
            graphs = engine.runner.graphs
            try:
                for share in streams.all_shares()[1:]:
                    with streams.decode_on(share):
                        if graphs is not None:
                            graphs.capture()
            except Exception:  # (out of memory, a partition the graphs fail on): stay fixed
                log.warning(
                    "split engine: capturing decode graphs for every SM share failed; the "
                    "split stays at %d decode SMs", streams.decode_share, exc_info=True,
                )  # fmt: skip
                return cls(scheduler, runner, sampler, streams, None)
            curve = BandwidthCurve(streams.decode_bytes_per_s())
            spec = engine.kv_cache.spec
            adaptive = Adaptive(
                SplitModel(engine.model.weight_bytes, curve),
                spec.block_nbytes // spec.block_size,
                config.split_tpot_target_ms / 1e3,
                SplitGovernor(config.split_resize_interval_s),
            )
        return cls(scheduler, runner, sampler, streams, adaptive)

    def advance(self, engine: LaneHost) -> list[RequestOutput]:
        """The prefill loop's turn (never waits for the device): read its step if it has
        finished and hand its prefilled requests to the decode loop, then launch its next
        step (on CPU, where a step runs as it is launched, read at once)."""
        if self.adaptive is not None:
            self.adaptive.apply(self.streams, engine.scheduler, self.has_work())
        outputs: list[RequestOutput] = []
        if self.inflight is not None:
            if not self.step_done():
                return outputs
            outputs += self._read(engine)
        with self.streams.prefill():
            # the schedule's host-tier copies (onboards, copies at eviction) are queued on the
            # prefill stream, after a decode step that may still write a block given back and
            # before the step that reads or overwrites their blocks
            self.wait_for(engine._latest_launch)
            decision = self.scheduler.schedule()
            if decision.batch.chunks:
                self.inflight = engine._launch(decision.batch, None, self)
        for request in decision.finished:
            outputs.append(engine._final_output(request))
        if decision.batch.chunks and self.step_done():
            outputs += self._read(engine)
        return outputs

    def _read(self, engine: LaneHost) -> list[RequestOutput]:
        assert self.inflight is not None
        step, self.inflight = self.inflight, None
        self.apply_pending_aborts()
        outputs = engine._complete(step, self.scheduler)
        self.hand_over(step.sampled, engine.scheduler)
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight is not None

    def step_done(self) -> bool:
        """The step in flight has finished on the device (never waits)."""
        return self.inflight is not None and self.inflight.is_done()

    def abort(self, request_id: str) -> bool:
        """Abort a request of the lane; one in the step in flight is freed after it."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        if self.inflight is not None and request in self.inflight.requests:
            self.pending_aborts.append(request_id)
            return True
        return self.scheduler.abort(request_id)

    def apply_pending_aborts(self) -> None:
        for request_id in self.pending_aborts:
            self.scheduler.abort(request_id)
        self.pending_aborts.clear()

    def wait_for(self, decode_step: InflightStep | None) -> None:
        """Order the prefill stream's next work (the schedule's copies, the step) after the
        decode loop's latest step on the device when that step may still write a block one
        of its requests gave back (finished, aborted, preempted), which the lane may now be
        given; otherwise the prefill partition starts at once (every earlier decode step has
        been read, so has finished)."""
        if decode_step is not None and decode_step.released_blocks():
            decode_step.order_before_current_stream()

    def hand_over(self, requests: tuple[Request, ...], decode: Scheduler) -> None:
        """Move every prefilled request among `requests` that is still running (its first
        token appended, no prompt token left) to the decode scheduler."""
        for request in requests:
            if (
                request.status is not RequestStatus.RUNNING
                or request.request_id not in self.scheduler.requests
                or request.num_pending_tokens != 1
                or request.num_output_placeholders
            ):
                continue
            started = time.perf_counter()
            self.scheduler.running.remove(request)
            del self.scheduler.requests[request.request_id]
            decode.running.append(request)
            decode.requests[request.request_id] = request
            self._handoff_s.append(time.perf_counter() - started)
            self.num_handoffs += 1

    def take_back(self, decode: Scheduler) -> None:
        """Queue the decode scheduler's preempted requests at the head of the lane (their
        order kept) to be recomputed here."""
        while decode.waiting:
            request = decode.waiting.pop()
            del decode.requests[request.request_id]
            self.scheduler.waiting.appendleft(request)
            self.scheduler.requests[request.request_id] = request

    def observe_decode_step(self, seconds: float) -> None:
        """The engine's step that ran a decode batch took `seconds` (the adaptive split
        learns the decode steps' slowdown beside a prefill from it)."""
        if self.adaptive is not None:
            self.adaptive.observe(seconds)

    def status(self) -> SplitStatus:
        times = list(self._handoff_s)
        mean = sum(times) / len(times) * 1e6 if times else 0.0
        status = self.streams.status(self.num_handoffs, (mean, max(times, default=0.0) * 1e6))
        if self.adaptive is not None:
            status = replace(status, decode_slowdown=self.adaptive.correction.factor)
        return status


def schedulers(decode: Scheduler, lane: PrefillLane | None) -> tuple[Scheduler, ...]:
    """An engine's schedulers: its own, and a split engine's lane's (which admits prompts)."""
    return (decode,) if lane is None else (decode, lane.scheduler)


@dataclass
class Adaptive:
    """The adaptive split (vocabulary/split_policy.py) of a partitioned split engine."""

    model: SplitModel
    kv_bytes_per_token: int
    tpot_s: float
    governor: SplitGovernor
    correction: StepCorrection = field(default_factory=StepCorrection)
    _pending: tuple[DecodeLoad, int] | None = None
    """The load and decode share of the step now running, when it runs beside a prefill."""

    def apply(self, streams: SMSplit, decode: Scheduler, prefill_waiting: bool) -> None:
        tokens = sum(r.num_computed_tokens for r in decode.running)
        load = DecodeLoad(len(decode.running), tokens * self.kv_bytes_per_token, prefill_waiting)
        model = replace(self.model, slowdown=self.correction.factor)
        wanted = choose_decode_sms(load, streams.shares, streams.total_sms, model, self.tpot_s)
        new = self.governor.decide(wanted, time.monotonic())
        if new is not None:
            streams.resize(new)
        busy = prefill_waiting and load.running > 0 and streams.decode_share < streams.total_sms
        self._pending = (load, streams.decode_share) if busy else None

    def observe(self, seconds: float) -> None:
        """A decode step measured: learn its slowdown when it ran beside a prefill."""
        if self._pending is not None:
            load, sms = self._pending
            self.correction.observe(seconds, self.model.step_s(load, sms))
            self._pending = None
