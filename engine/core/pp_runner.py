"""A pipeline-parallel engine's steps: rank 0 schedules, the stages run in turn, the last samples.

A worker is S stages of T tensor-parallel ranks (rank = stage * T + tp rank,
engine/pp/pipeline_group.py); stage s holds layers [a_s, b_s) and their KV. The scheduler runs
once, on rank 0 (stage 0, TP rank 0), in `LLMEngine` as with one rank; its runner calls go
through a `PPLeader` (`execute_sampled`, `keep_sampled`). Every other rank runs `run_stage`,
which builds its part as rank 0 does (engine/core/rank_setup.py) and loops.

The schedule of one step (its batch cut into M micro-batches by tokens, a long prompt chunk
cut too: engine/pp/micro_batches.py):

    rank 0: check the batch (a malformed one fails here, before any rank starts: the group
            stays usable); build the step's sampling (rows, the structured-output mask,
            prompt-logprob rows: engine/core/pp_sampling.py); send PPStepMessage(seq,
            micro-batches, sampling[, sampled ids][, LoRA slot fills][, host-tier copies]) to
            all
    every rank > 0: make rank 0's LoRA slot fills and host-tier copies on its own layers
    stage s, for k in 0..M-1 (each TP rank of the stage alike):
        receive micro-batch k's (h, residual) from (s - 1, t)     [stage 0: embed the tokens]
        run the stage's layers over it (its KV written in its pool)
        send (h, residual) to (s + 1, t) without waiting          [last stage: keep its
                                                                   logits]
    last stage, TP rank 0: sample the whole step (every micro-batch's logits, in order) and
            send back the token ids (and the logprobs asked for) to rank 0
    rank 0: receive them (its next step's placeholders read them)

So stage s works on micro-batch k while stage s + 1 works on k - 1 (GPipe's forward
schedule): of the M + S - 1 slots of a step each stage is busy M, and the bubble is (S - 1) /
(M + S - 1) of the step; `EngineConfig.pipeline_micro_batches` trades it against smaller
micro-batches. That is the whole schedule with `pipeline_schedule` = within_step: the next
step's decodes wait for this step's sampled ids. With cross_step (the default) the engine
keeps up to G steps of disjoint requests in flight (`launch` returns before the last stage has
sampled, `PendingStep.receive` reads the tokens in launch order: engine/core/pp_steps.py,
engine/core/decode_groups.py), so while stage 1 runs one group's step stage 0 runs another's; a
decode-only step is then one micro-batch. The logits never leave the last stage:
rank 0 sends what sampling needs with the step (it keeps the requests, the grammar matchers
and the scheduler) and gets back only what was sampled (engine/core/pp_sampling.py says why
the draws are one rank's). `execute` (rank 0 gets the logits themselves, the last stage
samples nothing) remains for tools that need logits. Stage 0's other TP ranks get the sampled
ids that placeholder chunks read in the step message; later stages read no token ids.

Rank 0's adapter cache and host tier decide for every stage (the slot and block ids are the
same on each): mirrored, they log what they fill and copy, and each step message carries
what they did since the step before (engine/lora/lora_stage.py, engine/kv/host_mirror.py).

Failures: a step that fails on any rank after rank 0 has sent it breaks the group
(`PPGroup.fail`: gloo fails every peer's pending op at once, a dead rank's peers too, and a
rank that misses a deadline, `EngineConfig.tp_timeout_s`); rank 0's `execute_sampled` raises
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
from engine.core.pp_sampling import StageSampler, StageSampling, unpack
from engine.core.prompt_logprobs import PromptLogprobsStep, PromptSpan
from engine.core.rank_setup import build_rank
from engine.core.request import Request
from engine.core.runner import ModelRunner, resolve_device, resolve_dtype
from engine.core.sampler import SampledTokens, SamplingRow
from engine.core.tp_runner import StopMessage, TPLeader
from engine.kv.host_mirror import StageHostTier
from engine.kv.host_tier import HostCopy, HostTier
from engine.lora.lora_cache import LoraCache, LoraFill
from engine.lora.lora_stage import StageLoras
from engine.pp.micro_batches import logit_row_count, micro_batches
from engine.pp.pipeline_group import PPGroup
from engine.pp.pp_stage import PPStage
from engine.structured.grammars import TokenMask
from engine.tp.tensor_parallel import TPGroup, TPGroupError, TPGroupState
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
    sampling: StageSampling | None = None
    """What the last stage samples the step with; None: it sends rank 0 the logits."""
    sampled_for: tuple[str, ...] = ()
    """Stage 0's TP ranks: the requests whose sampled ids the placeholder chunks read."""
    sampled_ids: tuple[int, ...] = ()
    """Those ids, in `sampled_for` order."""
    lora_fills: tuple[LoraFill, ...] = ()
    """The LoRA slots rank 0 filled since its previous step (fill them alike first)."""
    host_copies: tuple[HostCopy, ...] = ()
    """The host-tier copies rank 0 queued since its previous step (make them alike first)."""


@dataclass(frozen=True)
class StageSpan:
    """One rank's run of one micro-batch: [start, end) on the monotonic clock (seconds)."""

    step: int
    micro_batch: int
    stage: int
    start: float
    end: float
    num_tokens: int = 0
    num_seqs: int = 0


class StageLoop:
    """One rank's part of each step (the module docstring's loop over micro-batches), with
    what this rank keeps beside its runner: the last stage's sampler (its TP rank 0), and on
    ranks > 0 the LoRA slots and host-tier blocks rank 0's decisions fill."""

    def __init__(
        self,
        group: PPGroup,
        runner: ModelRunner,
        loras: StageLoras | None = None,
        host: StageHostTier | None = None,
    ) -> None:
        self.group = group
        self.runner = runner
        self.loras = loras
        self.host = host
        self.trace: collections.deque[StageSpan] = collections.deque(maxlen=TRACE_SPANS)
        cfg = runner.model.cfg
        self._hidden = cfg.hidden_size
        self._vocab = cfg.vocab_size
        self.sampler: StageSampler | None = None
        if group.rank == group.last_stage_rank:
            config = runner.config
            self.sampler = StageSampler(
                config.seed, runner.device, cfg.vocab_size, 4 * config.max_num_seqs
            )

    def follow(self, message: PPStepMessage) -> None:
        """Make rank 0's LoRA slot fills and host-tier copies of `message` here (ranks > 0,
        before the step)."""
        if message.lora_fills:
            if self.loras is None:
                raise ValueError("a LoRA slot fill reached a stage without LoRA slots")
            for fill in message.lora_fills:
                self.loras.fill(fill)
        if message.host_copies:
            if self.host is None:
                raise ValueError("a host-tier copy reached a stage without a host tier")
            self.host.apply(message.host_copies)

    def run(
        self,
        seq: int,
        batches: Sequence[ScheduledBatch],
        sampling: StageSampling | None = None,
        wait: bool = True,
    ) -> list[tuple[dist.Work, torch.Tensor]]:
        """Run this rank's part of step `seq` (`sampling`: the last stage samples the step
        and sends rank 0 the result; None: it sends rank 0 each micro-batch's logits); raises
        `TPGroupError` (the group broken) on any failure. `wait` False: return with the sends
        in flight (rank 0 of a cross-step pipeline waits once it has the step's tokens)."""
        group, stage = self.group, self.group.stage
        sent: list[tuple[dist.Work, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        try:
            for k, batch in enumerate(batches):
                dtype, device = self.runner.model.dtype, self.runner.device
                carried = group.receive_activations(batch.num_tokens, self._hidden, dtype, device)
                start = time.perf_counter()
                out = self.runner.execute_stage(batch, carried)
                end, n = time.perf_counter(), len(batch.chunks)
                self.trace.append(StageSpan(seq, k, stage.rank, start, end, batch.num_tokens, n))
                if not stage.is_last:
                    sent.append((group.isend(out, group.next_rank), out))
                elif group.tp_rank == 0 and sampling is not None:
                    logits.append(out)
                elif group.tp_rank == 0 and out.shape[0]:
                    sent.append((group.isend(out.contiguous(), 0), out))
            if self.sampler is not None and sampling is not None:
                for t in self.sampler.sample(torch.cat(logits), sampling):
                    if t is not None and t.numel():  # (rank 0 knows the sizes: `sizes`)
                        sent.append((group.isend(t, 0), t))
            if wait:
                group.wait_sent([work for work, _ in sent])
        except TPGroupError:
            raise
        except Exception as e:
            raise group.fail(f"step {seq} failed: {e!r}") from e
        return [] if wait else sent

    def logits_buffer(self, batch: ScheduledBatch) -> torch.Tensor:
        """Where rank 0 receives a micro-batch's logits (`PPLeader.execute`)."""
        rows = logit_row_count(batch)
        return torch.empty((rows, self._vocab), dtype=torch.float32, device=self.runner.device)


class PPLeader:
    """Rank 0's side of a pipeline engine: `execute_sampled` (the engine's steps), `execute`
    (logits for tools) and `keep_sampled` as `ModelRunner`'s, each step run by every stage
    (module docstring). `loras` and `host_tier`: rank 0's adapter cache and host tier, whose
    slot fills and copies every stage makes too (mirrored from here on)."""

    def __init__(
        self,
        group: PPGroup,
        runner: ModelRunner,
        num_micro_batches: int,
        loras: LoraCache | None = None,
        host_tier: HostTier | None = None,
        cross_step: bool = False,
    ) -> None:
        """`cross_step`: the engine keeps steps in flight (`launch`, engine/core/pp_steps.py):
        a decode-only step then runs as one micro-batch (its group is one)."""
        if group.rank != 0 or group.stage.size < 2:
            raise ValueError(
                f"PPLeader runs on rank 0 of a pipeline of >= 2 stages, not rank {group.rank} "
                f"of {group.stage.size} stage(s)"
            )
        self.group = group
        self.runner = runner
        self.loop = StageLoop(group, runner)
        self.num_micro_batches = num_micro_batches
        self.cross_step = cross_step
        self.num_steps = 0
        self.loras = loras
        self.host_tier = host_tier
        if loras is not None:
            loras.mirror()
        if host_tier is not None:
            host_tier.mirror()
        self._sampled: tuple[tuple[str, ...], torch.Tensor] | None = None

    @property
    def trace(self) -> collections.deque[StageSpan]:
        return self.loop.trace

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits of the sampled chunks, as `ModelRunner.execute`, once every stage
        has run the step (the last stage sends them here and samples nothing). Raises
        ValueError for a malformed batch (nothing ran anywhere), `TPGroupError` when the
        group broke."""
        if not batch.chunks:
            return torch.empty((0, self.runner.model.cfg.vocab_size), device=self.runner.device)
        batches = self._cut(batch)
        self._run(batch, None)
        logits = []
        src = self.group.last_stage_rank
        for b in batches:
            buffer = self.loop.logits_buffer(b)
            if buffer.shape[0]:
                self.group.recv(buffer, src)
            logits.append(buffer)
        return torch.cat(logits)

    def execute_sampled(
        self,
        batch: ScheduledBatch,
        requests: Sequence[Request],
        rows: Sequence[SamplingRow],
        mask: TokenMask | None,
    ) -> tuple[SampledTokens, PromptLogprobsStep | None]:
        """Run a step on every stage and sample it on the last (module docstring): what
        `ModelRunner.execute`, `PromptLogprobsStep.split` and `Sampler.sample` give together
        on one rank. `requests`: the batch's, chunk by chunk (read only for prompt logprobs);
        `rows`: the sampled chunks' (`sampling_rows`), with `mask` over them. Raises as
        `execute`."""
        return self.launch(batch, requests, rows, mask, wait=True).receive()

    def launch(
        self,
        batch: ScheduledBatch,
        requests: Sequence[Request],
        rows: Sequence[SamplingRow],
        mask: TokenMask | None,
        wait: bool = False,
    ) -> PendingStep:
        """Send a step down the pipeline and run stage 0's part of it, as `execute_sampled`,
        but return before the last stage has sampled it: `PendingStep.receive` gets what it
        sampled (every launched step's, in launch order). `wait` False: the step message and
        stage 0's activations are still being sent when this returns (the stages take them
        when they are ready)."""
        planned = PromptLogprobsStep.plan(batch, requests)
        sampled_ids = [c.request_id for c in batch.chunks if c.sample]
        plan = planned[0] if planned is not None else None
        sampling = StageSampling.of(sampled_ids, rows, mask, plan)
        posted, sent = self._run(batch, sampling, wait)
        spans = planned[1] if planned is not None else None
        return PendingStep(self.group, sampling, spans, self.runner.device, posted, sent)

    def _run(
        self, batch: ScheduledBatch, sampling: StageSampling | None, wait: bool = True
    ) -> tuple[list[dist.Work], list[tuple[dist.Work, torch.Tensor]]]:
        """Send step `batch` to every rank and run stage 0's part; with `wait` False, (the
        step message's broadcasts, stage 0's sends) still in flight."""
        self.group.check()
        self.runner.check(batch)
        batches = self._cut(batch)
        sampled_for: tuple[str, ...] = ()
        ids: tuple[int, ...] = ()
        placeholders = any(c.placeholder for c in batch.chunks)
        if self.group.tp_size > 1 and self._sampled is not None and placeholders:
            sampled_for = self._sampled[0]
            ids = tuple(int(i) for i in self._sampled[1].tolist())
        self.num_steps += 1
        seq = self.num_steps
        fills = self.loras.take_fills() if self.loras is not None else ()
        copies = self.host_tier.take_copies() if self.host_tier is not None else ()
        message = PPStepMessage(seq, batches, sampling, sampled_for, ids, fills, copies)
        posted = self.group.send_step(message, wait)
        return posted, self.loop.run(seq, batches, sampling, wait)

    def _cut(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, ...]:
        """The step's micro-batches (cross-step: a decode-only step is one)."""
        one = self.cross_step and batch.is_decode_only
        return micro_batches(batch, 1 if one else self.num_micro_batches)

    def keep_sampled(self, token_ids: torch.Tensor, request_ids: Sequence[str]) -> None:
        """As `ModelRunner.keep_sampled`; stage 0's other TP ranks get the ids with the next
        step that reads them."""
        self._sampled = (tuple(request_ids), token_ids.to(torch.int64))
        self.runner.keep_sampled(token_ids, request_ids)

    def close(self) -> None:
        """Tell the other ranks to return (idempotent; nothing to tell a broken group)."""
        if self.group.state is TPGroupState.OPEN:
            self.group.send_step(StopMessage())


class PendingStep:
    """A step rank 0 launched down the pipeline whose sampled tokens it has not received yet
    (`PPLeader.launch`); the last stage sends them in launch order, so `receive` them in it."""

    def __init__(
        self,
        group: PPGroup,
        sampling: StageSampling,
        prompt_spans: list[PromptSpan] | None,
        device: torch.device,
        posted: list[dist.Work],
        sent: list[tuple[dist.Work, torch.Tensor]],
    ) -> None:
        self.group = group
        self.sampling = sampling
        self._prompt_spans = prompt_spans
        self.device = device
        self._posted = posted
        self._sent = sent  # (the tensors stay alive until their sends are waited for)

    def receive(self) -> tuple[SampledTokens, PromptLogprobsStep | None]:
        """What the last stage sampled (`execute_sampled`'s result); waits for it, within the
        deadline. The step's own sends are certainly done then (the last stage had them)."""
        ints_n, floats_n = self.sampling.sizes()
        device = self.device
        ints = torch.empty(ints_n, dtype=torch.int64, device=device)
        floats = torch.empty(floats_n, dtype=torch.float32, device=device) if floats_n else None
        for t in (ints, floats):
            if t is not None and t.numel():
                self.group.recv(t, self.group.last_stage_rank)
        self.group.wait_step_sent(self._posted)
        self.group.wait_sent([work for work, _ in self._sent])
        self._posted, self._sent = [], []
        tokens, prompt_values = unpack(self.sampling, ints, floats)
        if self._prompt_spans is None or prompt_values is None:
            return tokens, None
        return tokens, PromptLogprobsStep(self._prompt_spans, *prompt_values)


def step_runner(
    runner: ModelRunner,
    tp: TPGroup | None = None,
    pp: PPGroup | None = None,
    loras: LoraCache | None = None,
    host_tier: HostTier | None = None,
) -> ModelRunner | TPLeader | PPLeader:
    """What runs rank 0's steps: `runner` itself with one rank, else a `TPLeader` over `tp`
    or a `PPLeader` over `pp` (whose other stages fill LoRA slots and copy host blocks as
    rank 0's `loras` and `host_tier` do)."""
    if tp is not None:
        return TPLeader(tp, runner)
    if pp is not None:
        config = runner.config
        cross = config.cross_step_pipeline
        return PPLeader(pp, runner, config.micro_batches, loras, host_tier, cross)
    return runner


def pipeline_stage(config: EngineConfig, rank: int) -> PPStage:
    """The stage worker rank `rank` of an engine of `config` serves (ValueError naming the
    numbers when the stages do not cut the model's layers as configured)."""
    num_layers = ModelConfig.from_pretrained(config.model_dir).num_layers
    tp = config.tensor_parallel_size
    return PPStage.of(
        num_layers, config.pipeline_parallel_size, rank // tp, config.pipeline_layer_partition
    )


def prepare_stage(config: EngineConfig, group: PPGroup) -> StageLoop:
    """Build rank `group.rank`'s (> 0) part of a pipeline engine of `config` as rank 0 builds
    its own (engine/core/rank_setup.py: the start-up collectives), so it must run while rank
    0 builds its `LLMEngine`; the loop's runner holds the rank's model and KV pool, beside
    its LoRA slots and host-tier blocks when the engine serves them."""
    if group.rank == 0:
        raise ValueError("rank 0 of a pipeline runs LLMEngine")
    model_config = ModelConfig.from_pretrained(config.model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer.from_model_dir(Path(config.model_dir))
    loras = None
    if config.lora_enabled:  # slots before the KV pool is sized, as on rank 0
        loras = StageLoras(config, model_config, group.stage.layers, dtype, device)
    parts = build_rank(
        config, model_config, device, dtype, tokenizer, pp=group,
        lora_weights=loras.weights if loras is not None else None,
    )  # fmt: skip
    host = None
    if parts.num_host_blocks:
        spec = parts.kv_cache.spec
        host = StageHostTier(
            parts.num_host_blocks, parts.kv_cache.tensor, spec.block_dim,
            config.host_kv_max_blocks_per_step,
        )  # fmt: skip
    log.info("pipeline rank %d of %d: ready", group.rank, group.size)
    return StageLoop(group, parts.runner, loras, host)


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
        try:
            loop.follow(message)
        except Exception as e:
            raise group.fail(f"step {message.seq} failed: {e!r}") from e
        if message.sampled_for:
            ids = torch.tensor(message.sampled_ids, dtype=torch.int64, device=runner.device)
            runner.keep_sampled(ids, message.sampled_for)
        loop.run(message.seq, message.micro_batches, message.sampling)
        steps += 1


def run_stage(config: EngineConfig, group: PPGroup, stop: Callable[[], bool] | None = None) -> int:
    """Serve rank `group.rank` (> 0) of a pipeline engine of `config` until rank 0 closes (or
    `stop()` is true): `prepare_stage`, then `serve_stage`; returns the steps run."""
    return serve_stage(prepare_stage(config, group), stop)
