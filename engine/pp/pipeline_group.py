"""The process group of a pipeline-parallel worker (PP x TP ranks), and its bounded hand-offs.

A worker of `pp_size` stages of `tp_size` ranks each is `pp_size * tp_size` processes, rank
`stage * tp_size + tp_rank` (stage-major: the order the KV hand-off lists the ranks' agents
in). `init_pp_group` joins this process to the worker's group (torch.distributed's default
group: one worker per process) and returns a `PPGroup` over:

- the world (every rank): the device group (NCCL on GPUs, gloo on CPU) carries the activations
  from (stage s, tp rank t) to (s + 1, t) and what the last stage's tp rank 0 sampled back
  to rank 0 (`isend` / `recv`, point to point); a gloo control group carries the start-up
  agreement on the KV pool's block count (`reduce_min`), through a `TPGroup` over every rank
  (engine/tp/tensor_parallel.py: its bounded control ops);
- rank 0's step messages (`send_step` / `receive_step`): a gloo group of two ranks, rank 0
  and each other rank (`links`), so no stage relays another's steps and each takes its next
  step when it is ready while rank 0 goes on (a cross-step pipeline, engine/core/pp_steps.py);
- with `tp_size` > 1, each stage's TP group (`tp`: a `TPGroup` over that stage's ranks, whose
  all-reduces its model's layers use).

Every wait has a deadline (`EngineConfig.tp_timeout_s`); a rank that dies closes its sockets,
so gloo fails its peers' pending ops at once (NCCL at its timeout). Any failed op breaks the
group: from then on every call raises `TPGroupError` at once, naming the first failure, and
the worker must be replaced. States as `TPGroup`'s: OPEN → BROKEN → CLOSED, or OPEN → CLOSED.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.pp.pp_stage import PPStage
from engine.tp.tensor_parallel import (
    CONTROL_OP_LIMIT,
    TPGroup,
    TPGroupError,
    TPGroupState,
    init_world,
)
from engine.tp.tp_shard import TPShard

log = logging.getLogger(__name__)


class PPGroup:
    """This process's rank of a PP x TP worker (see the module docstring)."""

    def __init__(
        self,
        stage: PPStage,
        tp_rank: int,
        tp_size: int,
        world: TPGroup,
        tp: TPGroup | None,
        links: tuple[TPGroup, ...] = (),
    ) -> None:
        """`world`: the bounded control ops over every rank; `tp`: this stage's TP group
        (None when `tp_size` is 1); `links`: the step messages' groups of two ranks (rank 0
        and each other rank: rank 0 holds every one, another rank its own; none: they go
        over `world`). Use `init_pp_group` rather than this."""
        self.stage = stage
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.world = world
        self.tp = tp
        self.links = links
        self.rank = stage.rank * tp_size + tp_rank
        self.size = stage.size * tp_size
        self.timeout_s = world.timeout_s

    def rank_of(self, stage: int, tp_rank: int) -> int:
        """The worker rank of (stage, tp rank)."""
        return stage * self.tp_size + tp_rank

    @property
    def last_stage_rank(self) -> int:
        """The rank that samples and hands the tokens back to rank 0 (the last stage's tp
        rank 0; engine/core/pp_sampling.py)."""
        return self.rank_of(self.stage.size - 1, 0)

    # ---- control (rank 0 → every rank) ----------------------------------------------------

    def send_step(self, message: object, wait: bool = True) -> list[dist.Work]:
        """Rank 0: hand `message` (picklable) to every other rank's `receive_step`, over each
        rank's link (a broadcast over every rank would pass through other stages, gloo's
        tree, so a stage could take a step only once the stages it relays to are ready for
        it); `wait` False: return with the sends in flight (their works, for `wait_sent`)."""
        if not self.links:
            return self.world.send(message, wait)
        self.check()
        try:
            return [w for link in self.links for w in link.send(message, wait)]
        except TPGroupError as e:
            raise self.fail(f"sending a step: {e}") from e

    def wait_step_sent(self, works: Sequence[dist.Work]) -> None:
        """Wait for the sends of `send_step(..., wait=False)` (within the deadline)."""
        for work in works:
            self._wait(work, "sending a step")

    def receive_step(self, stop: Callable[[], bool] | None = None) -> object | None:
        """Ranks > 0: the next message of rank 0, waiting as long as rank 0 lives (None once
        `stop()` is true)."""
        if not self.links:
            return self.world.receive(stop)
        self.check()
        try:
            return self.links[0].receive(stop)
        except TPGroupError as e:
            raise self.fail(f"receiving a step: {e}") from e

    def reduce_min(self, value: int) -> int:
        """The smallest `value` over every rank (the KV pool's block count: the block ids are
        the same on every rank)."""
        return self.world.reduce_min(value)

    def reduce_max(self, values: list[float]) -> list[float]:
        """The element-wise max over every rank (each stage's e4m3 KV scales at their layers'
        places: the whole model's)."""
        return self.world.reduce_max(values)

    # ---- point to point -------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        """Start sending contiguous `tensor` to rank `dst` (its `recv` of the same shape);
        the caller keeps `tensor` alive until `wait_sent` returns."""
        self.check()
        try:
            work = dist.isend(tensor, dst=dst)
        except Exception as e:
            raise self.fail(f"sending to rank {dst} failed: {e}") from e
        assert work is not None
        return work

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Fill `tensor` with what rank `src` sends next (within the deadline)."""
        self.check()
        try:
            work = dist.irecv(tensor, src=src)
        except Exception as e:
            raise self.fail(f"receiving from rank {src} failed: {e}") from e
        assert work is not None
        self._wait(work, f"receiving from rank {src}")
        return tensor

    def receive_activations(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The (h, residual) pair [2, num_tokens, hidden] the stage before sends next (its
        rank of this TP rank); None on stage 0, which embeds its tokens."""
        if self.stage.is_first:
            return None
        buffer = torch.empty((2, num_tokens, hidden), dtype=dtype, device=device)
        return self.recv(buffer, self.rank_of(self.stage.rank - 1, self.tp_rank))

    def send_activations(self, pair: torch.Tensor) -> None:
        """Send this stage's (h, residual) pair to the next stage and wait until it is sent
        (nothing on the last stage)."""
        if not self.stage.is_last:
            self.wait_sent([self.isend(pair.contiguous(), self.next_rank)])

    @property
    def next_rank(self) -> int:
        """This TP rank's rank on the next stage."""
        return self.rank_of(self.stage.rank + 1, self.tp_rank)

    def wait_sent(self, works: Sequence[dist.Work]) -> None:
        """Wait for sends started by `isend` (within the deadline)."""
        for work in works:
            self._wait(work, "sending to the next stage")

    # ---- state ----------------------------------------------------------------------------

    @property
    def state(self) -> TPGroupState:
        if self.tp is not None and self.tp.state is TPGroupState.BROKEN:
            return TPGroupState.BROKEN
        return self.world.state

    @property
    def failure(self) -> str:
        """Why the group broke (empty while it is open)."""
        if self.tp is not None and self.tp.failure and self.world.state is TPGroupState.OPEN:
            return self.tp.failure
        return self.world.failure

    def check(self) -> None:
        """Raise TPGroupError unless the group is open."""
        if self.tp is not None:
            self.tp.check()
        self.world.check()

    def fail(self, reason: str) -> TPGroupError:
        """Break the group (peers blocked on this rank fail at once, gloo); the error to
        raise."""
        error = self.world.fail(f"pipeline stage {self.stage.rank}: {reason}")
        for sub in (self.tp, *self.links):
            if sub is not None and sub.state is TPGroupState.OPEN:
                sub.state = TPGroupState.BROKEN
                sub.failure = self.world.failure
        return error

    def close(self) -> None:
        """Leave the group (idempotent); its peers' pending ops then fail."""
        self.world.close()
        for sub in (self.tp, *self.links):
            if sub is not None:
                sub.state = TPGroupState.CLOSED

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            if work.is_completed():  # it failed: a peer is gone
                raise self.fail(f"{what}: {e}") from e
            raise self.fail(f"{what}: no answer within {self.timeout_s:g} s") from e


def init_pp_group(
    rank: int,
    stage: PPStage,
    tp_size: int,
    master_addr: str,
    port: int,
    backend: str = "auto",
    timeout_s: float = 60.0,
) -> PPGroup:
    """Join rank `rank` (stage-major: `stage.rank * tp_size + tp rank`) of a worker of
    `stage.size` stages of `tp_size` ranks to its group, rendezvous at tcp://master_addr:port
    (rank 0 listens there; every rank must call this within `timeout_s` of the others).
    `backend`: auto (nccl when CUDA is available, else gloo), nccl or gloo; `timeout_s` bounds
    every wait (`EngineConfig.tp_timeout_s`). On GPUs each rank must already see its own device
    as the current one."""
    size = stage.size * tp_size
    if not 0 <= rank < size or rank // tp_size != stage.rank:
        raise ValueError(
            f"rank {rank} is not of pipeline stage {stage.rank} ({stage.size} stages x "
            f"{tp_size} TP ranks)"
        )
    backend, control = init_world(rank, size, master_addr, port, backend, timeout_s)
    tp_rank = rank % tp_size
    tp: TPGroup | None = None
    for s in range(stage.size):  # every rank makes every subgroup, in the same order
        ranks = list(range(s * tp_size, (s + 1) * tp_size))
        if tp_size == 1:
            break
        device = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        stage_control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_OP_LIMIT)
        if s == stage.rank:
            tp = TPGroup(TPShard(tp_size, tp_rank), device, stage_control, timeout_s)
    links = []
    for other in range(1, size):  # every rank makes every link, in the same order
        link = dist.new_group([0, other], backend="gloo", timeout=CONTROL_OP_LIMIT)
        if rank in (0, other):
            links.append(TPGroup(TPShard(2, int(rank > 0)), None, link, timeout_s))
    world = TPGroup(TPShard(size, rank), None, control, timeout_s)
    if backend == "nccl":  # communicators made at the first collective, before any capture
        warm = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(warm)
        if tp is not None:
            tp.all_reduce(warm)
        torch.cuda.synchronize()
    log.info("pipeline rank %d of %d (stage %d, TP rank %d)", rank, size, stage.rank, tp_rank)
    return PPGroup(stage, tp_rank, tp_size, world, tp, tuple(links))
