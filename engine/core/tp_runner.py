"""A tensor-parallel engine's steps: rank 0 decides and samples, the other ranks follow.

The scheduler runs once, on rank 0, in `LLMEngine` as with one rank. Its runner calls go
through a `TPLeader` (the `execute` / `keep_sampled` pair of `ModelRunner`), which runs each
step on every rank; each follower process runs `run_follower`, which builds its part of the
model, KV pool and runner as rank 0 does (engine/core/rank_setup.py) and then loops. Per step:

    rank 0                                     follower
    send StepMessage(seq, batch, sampled_for)  receive it (waits as long as rank 0 lives)
    [placeholders, GPU: broadcast the ids the  [receive them; `keep_sampled` (on CPU the
     latest step sampled, on the device]        ids ride in the message)]
    runner.execute(batch)                      runner.execute(batch)   (same block ids;
      all-reduces after o_proj and down_proj     the pools hold each rank's KV heads)
    agree: collect every rank's report         agree: report whether it ran
    sample (rank 0 only)

A step that fails on one rank fails on all. A failure before the model's first all-reduce
(a malformed batch: the same on every rank) or after its last reaches `agree`: rank 0's
`execute` raises (its own error, or `TPStepError` naming the follower's), so the engine fails
the step (EngineDriver aborts its requests), the group stays usable and followers wait for
the next step (they hold no request state: nothing else to undo). A failure between
two all-reduces leaves peers waiting in the next one: the failing rank breaks the group at
once (`TPGroup.fail`), so they fail too (`TPGroupError`), and so does a rank that dies or
misses a deadline (`EngineConfig.tp_timeout_s`); rank 0's step then raises `TPGroupError`,
every later step raises it at once, and followers return from `run_follower` by raising it.
`TPLeader.close` (`LLMEngine.close`) sends `StopMessage`: followers return normally.

Host cost per step beside the model's 2 x layers all-reduces: one control broadcast of the
pickled batch (two past INLINE_BYTES), one gather of the reports, and on GPU the sampled ids'
broadcast when placeholders read them (`python -m benchmarks tp` measures them on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.batch import ScheduledBatch
from engine.config import EngineConfig
from engine.core.rank_setup import build_rank
from engine.core.runner import ModelRunner, resolve_device, resolve_dtype
from engine.tp.tensor_parallel import TPGroup, TPGroupError, TPGroupState, TPStepError
from vocabulary.model_config import ModelConfig
from vocabulary.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMessage:
    """What a follower needs to run step `seq` as rank 0 runs it."""

    seq: int
    batch: ScheduledBatch
    sampled_for: tuple[str, ...] = ()
    """The requests whose sampled ids (rank 0's latest `keep_sampled`, in row order) the
    batch's placeholder chunks read; empty: none."""
    sampled_ids: tuple[int, ...] = ()
    """Those ids, when rank 0 has them on the host (CPU); else rank 0 broadcasts them on the
    device right after this message (no host sync)."""


@dataclass(frozen=True)
class StopMessage:
    """Rank 0 is closing: followers return from `run_follower`."""


def run_agreed(
    group: TPGroup, runner: ModelRunner, batch: ScheduledBatch, seq: int
) -> torch.Tensor:
    """`runner.execute(batch)` on this rank, then the ranks' agreement that it ran everywhere
    (see the module docstring); raises this rank's own error, `TPStepError` for another
    rank's, `TPGroupError` when the group broke."""
    per_step = 2 * len(runner.model.layers)  # eager: every all-reduce is issued from Python
    before = group.num_all_reduces
    try:
        logits = runner.execute(batch)
    except TPGroupError:
        raise
    except Exception as e:
        if group.num_all_reduces - before not in (0, per_step):  # peers wait in the next one
            raise group.fail(f"step {seq} failed between all-reduces: {e!r}") from e
        group.agree(f"{type(e).__name__}: {e}")
        raise
    failed = group.agree(None)
    if failed is not None:
        rank, error = failed
        raise TPStepError(f"step {seq} failed on TP rank {rank}: {error}")
    return logits


class TPLeader:
    """Rank 0's side of a TP engine: `execute` and `keep_sampled` as `ModelRunner`'s, each
    step run on every rank (module docstring)."""

    def __init__(self, group: TPGroup, runner: ModelRunner) -> None:
        if group.rank != 0:
            raise ValueError(f"TPLeader runs on TP rank 0, not {group.rank}")
        self.group = group
        self.runner = runner
        self.num_steps = 0
        self._sampled: torch.Tensor | None = None
        self._sampled_for: tuple[str, ...] = ()

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits of the sampled chunks, as `ModelRunner.execute`, after every rank
        has run the step. Raises as `run_agreed`."""
        if not batch.chunks:
            return self.runner.execute(batch)
        self.group.check()
        sampled, sampled_for = self._sampled, self._sampled_for
        if sampled is None or not any(c.placeholder for c in batch.chunks):
            sampled, sampled_for = None, ()
        on_host = sampled is not None and sampled.device.type == "cpu"
        ids = tuple(sampled.tolist()) if sampled is not None and on_host else ()
        self.num_steps += 1
        self.group.send(StepMessage(self.num_steps, batch, sampled_for, ids))
        if sampled is not None and not on_host:
            self.group.broadcast_tensor(sampled)
        return run_agreed(self.group, self.runner, batch, self.num_steps)

    def keep_sampled(self, token_ids: torch.Tensor, request_ids: Sequence[str]) -> None:
        """As `ModelRunner.keep_sampled`; the followers get the ids with the next step that
        reads them."""
        self._sampled = token_ids.to(torch.int64)
        self._sampled_for = tuple(request_ids)
        self.runner.keep_sampled(token_ids, request_ids)

    def close(self) -> None:
        """Tell the followers to return (idempotent; nothing to tell a broken group)."""
        if self.group.state is TPGroupState.OPEN:
            self.group.send(StopMessage())


def run_follower(
    config: EngineConfig,
    group: TPGroup,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Serve TP rank `group.rank` (> 0) of an engine of `config` until rank 0 closes (or
    `stop()` is true); returns the steps run: `prepare_follower`, then `serve_follower`."""
    return serve_follower(group, prepare_follower(config, group), stop)


def prepare_follower(config: EngineConfig, group: TPGroup) -> ModelRunner:
    """Build TP rank `group.rank`'s (> 0) part of an engine of `config` as rank 0 builds its
    own (engine/core/rank_setup.py: the start-up collectives), so it must run while rank 0 builds
    its `LLMEngine`; the runner holds the rank's model and KV pool (`runner.kv_cache`)."""
    if group.rank == 0:
        raise ValueError("followers are TP ranks > 0; rank 0 runs LLMEngine")
    model_config = ModelConfig.from_pretrained(config.model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = Tokenizer.from_model_dir(Path(config.model_dir))
    runner = build_rank(config, model_config, device, dtype, tokenizer, tp=group).runner
    log.info("TP rank %d of %d: ready", group.rank, group.size)
    return runner


def serve_follower(
    group: TPGroup, runner: ModelRunner, stop: Callable[[], bool] | None = None
) -> int:
    """Run rank 0's steps on this rank's `runner` until rank 0 closes (or `stop()` is
    true); returns the steps run. Raises `TPGroupError` when the group breaks (rank 0
    died, a deadline passed); the caller then exits (and closes `group`)."""
    steps = 0
    while True:
        message = group.receive(stop)
        if message is None or isinstance(message, StopMessage):
            return steps
        if not isinstance(message, StepMessage):
            raise group.fail(f"unexpected control message {type(message).__name__}")
        if message.sampled_ids:
            ids = torch.tensor(message.sampled_ids, dtype=torch.int64, device=runner.device)
            runner.keep_sampled(ids, message.sampled_for)
        elif message.sampled_for:
            ids = torch.empty(len(message.sampled_for), dtype=torch.int64, device=runner.device)
            group.broadcast_tensor(ids)
            runner.keep_sampled(ids, message.sampled_for)
        try:
            run_agreed(group, runner, message.batch, message.seq)
        except TPGroupError:
            raise
        except Exception:  # every rank failed this step (agreed); the next one may run
            log.warning("TP rank %d: step %d failed", group.rank, message.seq, exc_info=True)
        steps += 1
