"""Rank 0's steps of a cross-step pipeline engine: up to G steps in flight on the stages.

With `EngineConfig.pipeline_schedule` = cross_step (and overlap scheduling on) `LLMEngine.step`
runs `PipelinedSteps.step`: read the oldest step in flight once G are, schedule the requests
that are not in flight (engine/core/decode_groups.py states the schedule: groups, admission,
prompt chunks, rebalancing, abort and preemption), launch the batch down the pipeline without
waiting for its tokens (`PPLeader.launch`: stage 0's part runs here, the step message and the
activations are left in flight), and read the oldest step when nothing could be launched.

A launched step's tokens are read into an `InflightStep` and postprocessed by the engine's
own `_complete`, so stop checks, detokenizing, structured output and the prefix cache behave
as with one stage; no placeholder is ever scheduled (a request in flight is not schedulable),
so stage 0 needs no sampled ids and a request's sampling rows carry no pending token. A
step's computed blocks enter the prefix cache when it is launched, not read: every later step
that may reuse them runs after it on every stage (each stage runs the steps in order), so a
request admitted while its prefix is in flight reuses it as with one stage.

Every launched step is read, in launch order (`drain` before close, a mode change or a KV
transfer's allocation when a step in flight may still write a block given back since).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.core.decode_groups import schedulable
from engine.core.overlap import InflightStep, sampling_rows
from engine.core.pp_runner import PendingStep, PPLeader
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.tracking import RequestTracking
from engine.kv.block_pool import BlockPool
from engine.structured.constrained import ConstrainedRequests
from engine.tp.tensor_parallel import TPGroupError, TPGroupState
from vocabulary.engine_io import RequestOutput
from vocabulary.step_stats import StepMeter


class PipelineHost(Protocol):
    """What the steps need of their engine (`LLMEngine`)."""

    config: EngineConfig
    scheduler: Scheduler
    block_pool: BlockPool
    tracking: RequestTracking
    constrained: ConstrainedRequests
    step_meter: StepMeter
    last_step_idle: bool

    def _complete(
        self, step: InflightStep, scheduler: Scheduler | None = ...
    ) -> list[RequestOutput]: ...

    def _final_output(self, request: Request) -> RequestOutput: ...


@dataclass(frozen=True)
class LaunchedStep:
    """A step in flight: its requests (chunk by chunk), those it samples, its tokens to come."""

    requests: tuple[Request, ...]
    sampled: tuple[Request, ...]
    pending: PendingStep

    def released_blocks(self) -> bool:
        """A request of the step gave its blocks back since it was launched."""
        return any(r.is_finished or r.status is RequestStatus.PREEMPTED for r in self.requests)


class PipelinedSteps:
    """Rank 0's loop over `leader`'s pipeline with up to `depth` steps in flight (the
    module docstring)."""

    def __init__(self, leader: PPLeader, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"steps in flight: must be >= 1, got {depth}")
        self.leader = leader
        self.depth = depth
        self.in_flight: deque[LaunchedStep] = deque()
        self.max_in_flight = 0
        """The most steps that were in flight at once (a check that the schedule fills)."""

    @property
    def busy(self) -> bool:
        """A launched step is not read yet."""
        return bool(self.in_flight)

    def step(self, engine: PipelineHost, started: float) -> list[RequestOutput]:
        """One `LLMEngine.step` (`started`: its perf_counter at entry): the outputs of the
        step read, if any, and of requests the scheduler ended."""
        outputs: list[RequestOutput] = []
        if len(self.in_flight) >= self.depth:
            outputs += self._read(engine)
        scheduler = engine.scheduler
        decision = scheduler.schedule(schedulable(scheduler.running, self.depth))
        for request in decision.finished:
            outputs.append(engine._final_output(request))
        batch = decision.batch
        if batch.chunks:
            shape = batch.shape(scheduler.requests)
            self.in_flight.append(self._launch(engine, batch))
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
            engine.step_meter.record(*shape, time.perf_counter() - started)
        elif self.in_flight:
            outputs += self._read(engine)
        engine.last_step_idle = not batch.chunks and not outputs and not self.in_flight
        return outputs

    def released_blocks(self) -> bool:
        """A step in flight may still write a block given back since it was launched."""
        return any(step.released_blocks() for step in self.in_flight)

    def drain(self, engine: PipelineHost) -> list[RequestOutput]:
        """Read every step in flight (their outputs, in order)."""
        outputs: list[RequestOutput] = []
        while self.in_flight:
            outputs += self._read(engine)
        return outputs

    def close(self, engine: PipelineHost) -> None:
        """Read what is in flight before the stages are told to return (nothing to read from
        a broken group: its ranks are gone or failing)."""
        if self.leader.group.state is not TPGroupState.OPEN:
            return
        with contextlib.suppress(TPGroupError):  # (broken now: `PPLeader.close` sends nothing)
            self.drain(engine)

    def _launch(self, engine: PipelineHost, batch: ScheduledBatch) -> LaunchedStep:
        scheduler = engine.scheduler
        requests = tuple(scheduler.requests[c.request_id] for c in batch.chunks)
        engine.block_pool.flush_host_tier()  # offloads queued beside this step
        chunks = [(r, c) for r, c in zip(requests, batch.chunks, strict=True) if c.sample]
        sampled, rows = sampling_rows(chunks, None, engine.tracking.generators)
        mask = None
        if engine.constrained:  # (every sampled request's newest token is read)
            mask = engine.constrained.mask([r.request_id for r in sampled])
        pending = self.leader.launch(batch, requests, rows, mask)
        for request in requests:  # (cached now: a later step reading them runs after this)
            scheduler.cache_computed_blocks(request)
        return LaunchedStep(requests, tuple(sampled), pending)

    def _read(self, engine: PipelineHost) -> list[RequestOutput]:
        launched = self.in_flight.popleft()
        tokens, prompt = launched.pending.receive()
        step = InflightStep(launched.requests, launched.sampled, tokens, prompt)
        return engine._complete(step)
