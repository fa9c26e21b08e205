"""A pipeline-parallel engine's steps: rank 0 schedules and samples, the stages run in turn.

A worker is S stages of T tensor-parallel ranks (rank = stage * T + tp rank,
engine/pp/pipeline_group.py); stage s holds layers [a_s, b_s) and their KV. The scheduler runs
once, on rank 0 (stage 0, TP rank 0), in `LLMEngine` as with one rank; its runner calls go
through a `PPLeader` (the `execute` / `keep_sampled` pair of `ModelRunner`). Every other rank
runs `run_stage`, which builds its part as rank 0 does (engine/core/rank_setup.py) and loops.

The schedule of one step (its batch cut into M micro-batches by tokens, a long prompt chunk
cut too: engine/pp/micro_batches.py):

    rank 0: check the batch (a malformed one fails here, before any rank starts: the group
            stays usable), send PPStepMessage(seq, micro-batches[, sampled ids]) to all
    stage s, for k in 0..M-1 (each TP rank of the stage alike):
        receive micro-batch k's (h, residual) from (s - 1, t)     [stage 0: embed the tokens]
        run the stage's layers over it (its KV written in its pool)
        send (h, residual) to (s + 1, t) without waiting          [last stage, t = 0: the
                                                                   logits to rank 0]
    rank 0: receive the logits of each micro-batch from the last stage; sample

So stage s works on micro-batch k while stage s + 1 works on k - 1 (GPipe's forward
schedule): of the M + S - 1 slots of a step each stage is busy M, and the bubble is (S - 1) /
(M + S - 1) of the step; `EngineConfig.pipeline_micro_batches` trades it against smaller
micro-batches. Decode micro-batches of one step are in flight together in the same way; the
next step's decodes wait for this step's sampled ids (rank 0 samples: its sampler holds every
request's generators, penalties, grammars and logprob settings; the last stage hands back
only the sampled rows' logits). Stage 0's other TP ranks get the sampled ids that placeholder
chunks read in the step message; later stages read no token ids.

Failures: a step that fails on any rank after rank 0 has sent it breaks the group
(`PPGroup.fail`: gloo fails every peer's pending op at once, a dead rank's peers too, and a
rank that misses a deadline, `EngineConfig.tp_timeout_s`); rank 0's `execute` raises
`TPGroupError`, the worker reports itself unhealthy and the controller replaces it (every
request ends or migrates; every stage's pool goes with its process). `PPLeader.close` sends
`StopMessage`: the other ranks return.

Every rank keeps the spans of its latest micro-batches (`StageLoop.trace`: step, micro-batch,
stage, start, end on the host's monotonic clock; on GPU they time the host's launches).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.core.rank_setup import build_rank
from engine.core.runner import ModelRunner, resolve_device, resolve_dtype
from engine.core.tp_runner import StopMessage
from engine.pp.micro_batches import logit_row_count, micro_batches
from engine.pp.pipeline_group import PPGroup
from engine.pp.pp_stage import PPStage
from engine.tp.tensor_parallel import TPGroupError, TPGroupState
from vocabulary.model_config import ModelConfig
from vocabulary.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TRACE_SPANS = 4096
"""Micro-batch spans each rank keeps (the latest)."""


@dataclass(frozen=True)
class PPStepMessage:
    """What every other rank needs to run step `seq` as rank 0 runs it."""

    seq: int
    micro_batches: tuple[ScheduledBatch, ...]
    sampled_for: tuple[str, ...] = ()
    """Stage 0's TP ranks: the requests whose sampled ids the placeholder chunks read."""
    sampled_ids: tuple[int, ...] = ()
    """Those ids, in `sampled_for` order."""


@dataclass(frozen=True)
class StageSpan:
    """One rank's run of one micro-batch: [start, end) on the monotonic clock (seconds)."""

    step: int
    micro_batch: int
    stage: int
    start: float
    end: float


class StageLoop:
    """One rank's part of each step (the module docstring's loop over micro-batches)."""

    def __init__(self, group: PPGroup, runner: ModelRunner) -> None:
        self.group = group
        self.runner = runner
        self.trace: collections.deque[StageSpan] = collections.deque(maxlen=TRACE_SPANS)
        cfg = runner.model.cfg
        self._hidden = cfg.hidden_size
        self._vocab = cfg.vocab_size

    def run(self, seq: int, batches: Sequence[ScheduledBatch]) -> None:
        """Run this rank's part of step `seq`; raises `TPGroupError` (the group broken) on any
        failure."""
        group, stage = self.group, self.group.stage
        sent: list[tuple[dist.Work, torch.Tensor]] = []
        try:
            for k, batch in enumerate(batches):
                carried = None
                if not stage.is_first:
                    buffer = torch.empty(
                        (2, batch.num_tokens, self._hidden),
                        dtype=self.runner.model.dtype,
                        device=self.runner.device,
                    )
                    carried = group.recv(buffer, group.rank_of(stage.rank - 1, group.tp_rank))
                start = time.perf_counter()
                out = self.runner.execute_stage(batch, carried)
                self.trace.append(StageSpan(seq, k, stage.rank, start, time.perf_counter()))
                if not stage.is_last:
                    dst = group.rank_of(stage.rank + 1, group.tp_rank)
                    sent.append((group.isend(out, dst), out))
                elif group.tp_rank == 0 and out.shape[0]:
                    sent.append((group.isend(out.contiguous(), 0), out))
            group.wait_sent([work for work, _ in sent])
        except TPGroupError:
            raise
        except Exception as e:
            raise group.fail(f"step {seq} failed: {e!r}") from e

    def logits_buffer(self, batch: ScheduledBatch) -> torch.Tensor:
        """Where rank 0 receives a micro-batch's logits."""
        rows = logit_row_count(batch)
        return torch.empty((rows, self._vocab), dtype=torch.float32, device=self.runner.device)


class PPLeader:
    """Rank 0's side of a pipeline engine: `execute` and `keep_sampled` as `ModelRunner`'s,
    each step run by every stage (module docstring)."""

    def __init__(self, group: PPGroup, runner: ModelRunner, num_micro_batches: int) -> None:
        if group.rank != 0 or group.stage.size < 2:
            raise ValueError(
                f"PPLeader runs on rank 0 of a pipeline of >= 2 stages, not rank {group.rank} "
                f"of {group.stage.size} stage(s)"
            )
        self.group = group
        self.runner = runner
        self.loop = StageLoop(group, runner)
        self.num_micro_batches = num_micro_batches
        self.num_steps = 0
        self._sampled: tuple[tuple[str, ...], torch.Tensor] | None = None

    @property
    def trace(self) -> collections.deque[StageSpan]:
        return self.loop.trace

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits of the sampled chunks, as `ModelRunner.execute`, once every stage
        has run the step. Raises ValueError for a malformed batch (nothing ran anywhere),
        `TPGroupError` when the group broke."""
        if not batch.chunks:
            return torch.empty((0, self.runner.model.cfg.vocab_size), device=self.runner.device)
        self.group.check()
        self.runner.check(batch)
        batches = micro_batches(batch, self.num_micro_batches)
        sampled_for: tuple[str, ...] = ()
        ids: tuple[int, ...] = ()
        placeholders = any(c.placeholder for c in batch.chunks)
        if self.group.tp_size > 1 and self._sampled is not None and placeholders:
            sampled_for = self._sampled[0]
            ids = tuple(int(i) for i in self._sampled[1].tolist())
        self.num_steps += 1
        seq = self.num_steps
        self.group.send_step(PPStepMessage(seq, batches, sampled_for, ids))
        self.loop.run(seq, batches)
        logits = []
        src = self.group.last_stage_rank
        for b in batches:
            buffer = self.loop.logits_buffer(b)
            if buffer.shape[0]:
                self.group.recv(buffer, src)
            logits.append(buffer)
        return torch.cat(logits)

    def keep_sampled(self, token_ids: torch.Tensor, request_ids: Sequence[str]) -> None:
        """As `ModelRunner.keep_sampled`; stage 0's other TP ranks get the ids with the next
        step that reads them."""
        self._sampled = (tuple(request_ids), token_ids.to(torch.int64))
        self.runner.keep_sampled(token_ids, request_ids)

    def close(self) -> None:
        """Tell the other ranks to return (idempotent; nothing to tell a broken group)."""
        if self.group.state is TPGroupState.OPEN:
            self.group.send_step(StopMessage())


def pipeline_stage(config: EngineConfig, rank: int) -> PPStage:
    """The stage worker rank `rank` of an engine of `config` serves (ValueError naming the
    numbers when the stages do not cut the model's layers as configured)."""
    num_layers = ModelConfig.from_pretrained(config.model_dir).num_layers
    tp = config.tensor_parallel_size
    return PPStage.of(
        num_layers, config.pipeline_parallel_size, rank // tp, config.pipeline_layer_partition
    )


def prepare_stage(config: EngineConfig, group: PPGroup) -> ModelRunner:
    """Build rank `group.rank`'s (> 0) part of a pipeline engine of `config` as rank 0 builds
    its own (engine/core/rank_setup.py: the start-up collectives), so it must run while rank
    0 builds its `LLMEngine`; the runner holds the rank's model and KV pool."""
    if group.rank == 0:
        raise ValueError("rank 0 of a pipeline runs LLMEngine")
    model_config = ModelConfig.from_pretrained(config.model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer.from_model_dir(Path(config.model_dir))
    runner = build_rank(config, model_config, device, dtype, tokenizer, pp=group).runner
    log.info("pipeline rank %d of %d: ready", group.rank, group.size)
    return runner


def serve_stage(loop: StageLoop, stop: Callable[[], bool] | None = None) -> int:
    """Run rank 0's steps on this rank (`loop`) until rank 0 closes (or `stop()` is true);
    returns the steps run. Raises `TPGroupError` when the group breaks (rank 0 or another
    rank died, a deadline passed, a step failed); the caller then exits (and closes the
    group)."""
    group, runner = loop.group, loop.runner
    steps = 0
    while True:
        message = group.receive_step(stop)
        if message is None or isinstance(message, StopMessage):
            return steps
        if not isinstance(message, PPStepMessage):
            raise group.fail(f"unexpected control message {type(message).__name__}")
        if message.sampled_for:
            ids = torch.tensor(message.sampled_ids, dtype=torch.int64, device=runner.device)
            runner.keep_sampled(ids, message.sampled_for)
        loop.run(message.seq, message.micro_batches)
        steps += 1


def run_stage(config: EngineConfig, group: PPGroup, stop: Callable[[], bool] | None = None) -> int:
    """Serve rank `group.rank` (> 0) of a pipeline engine of `config` until rank 0 closes (or
    `stop()` is true): `prepare_stage`, then `serve_stage`; returns the steps run."""
    return serve_stage(StageLoop(group, prepare_stage(config, group)), stop)
