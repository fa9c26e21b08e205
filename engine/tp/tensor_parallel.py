"""The process group of a tensor-parallel engine, and its bounded collectives.

A TP worker is N processes on one node, rank r holding part r of the model
(engine/tp/tp_shard.py). `init_tp_group` joins this process to the group (torch.distributed's
default group: one TP group per process) and returns a `TPGroup` over two process groups of
the same ranks:

- the device group (NCCL on GPUs, gloo on CPU) carries the model's two all-reduces per layer
  (`all_reduce`, inside the forward and inside captured CUDA graphs) and the sampled ids rank 0
  hands the followers (`broadcast_tensor`); its timeout (`EngineConfig.tp_timeout_s`) bounds
  each of them;
- the control group (gloo, on the host) carries rank 0's step messages (`send` / `receive`)
  and the ranks' reports that a step ran (`agree`, collected by rank 0). Every wait on it has
  its own deadline (a pending op waited on with a timeout), so a follower may wait idle for
  the next step as long as rank 0 lives, and rank 0 never waits longer than `timeout_s` for a
  follower.

A rank that dies closes its sockets: gloo fails every pending collective of its peers at once
("Connection closed by peer"); NCCL notices at its timeout, and its watchdog ends the process.
Any failed collective raises `TPGroupError` and breaks the group: from then on every call
raises at once, naming the first failure, and the worker must be replaced.

States: OPEN → BROKEN (a collective failed or missed its deadline) or CLOSED (`close`);
BROKEN → CLOSED. Nothing returns to OPEN.
"""

from __future__ import annotations

import enum
import logging
import pickle
import struct
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from engine.tp.tp_shard import TPShard

log = logging.getLogger(__name__)

INLINE_BYTES = 4096
"""Size of a control message's first broadcast: its length and up to INLINE_BYTES - 8 bytes of
it (a decode step of a few dozen sequences); the rest, if any, follows in a second one."""
CONTROL_OP_LIMIT = timedelta(days=3650)
"""gloo's own timeout of a control-group op: none in practice; waits use their deadlines."""
STATUS_BYTES = 512
"""Size of a rank's report of a step (`agree`): a flag and the start of its error."""
IDLE_POLL_S = 0.5
"""A follower waiting for the next step looks at its `stop` callable this often."""
TP_BACKENDS = ("auto", "nccl", "gloo")


class TPGroupError(RuntimeError):
    """A collective of the TP group failed or missed its deadline (a rank died, hung, or
    failed mid-step): the group is broken and the worker must be replaced."""


class TPStepError(RuntimeError):
    """A step failed on a rank other than this one; every rank failed it, the group is
    intact (the next step may run)."""


class TPGroupState(enum.Enum):
    """OPEN → BROKEN → CLOSED, or OPEN → CLOSED (module docstring)."""

    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


class TPGroup:
    """This process's rank of a tensor-parallel group (see the module docstring)."""

    def __init__(
        self,
        shard: TPShard,
        device_group: dist.ProcessGroup | None,
        control_group: dist.ProcessGroup | None,
        timeout_s: float,
    ) -> None:
        """`device_group` None: the default group; both must span the same `shard.size`
        ranks. Use `init_tp_group` rather than this."""
        self.shard = shard
        self.rank = shard.rank
        self.size = shard.size
        self.timeout_s = timeout_s
        self.state = TPGroupState.OPEN
        self.failure = ""
        """Why the group broke (empty while it is open)."""
        self.num_all_reduces = 0
        """Device all-reduces issued from Python so far (captured graphs' replays excluded)."""
        self._device = device_group
        self._control = control_group
        self._next_head: tuple[torch.Tensor, dist.Work] | None = None
        """A follower: the next message's first part, posted (a `receive` that `stop` ended)."""

    # ---- device group ---------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the ranks (the model's row-parallel outputs)."""
        self.num_all_reduces += 1
        try:
            dist.all_reduce(tensor, group=self._device)
        except RuntimeError as e:
            raise self.fail(f"an all-reduce failed: {e}") from e

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's `tensor` (same shape and dtype everywhere)."""
        self.check()
        try:
            dist.broadcast(tensor, src=0, group=self._device)
        except RuntimeError as e:
            raise self.fail(f"a broadcast from rank 0 failed: {e}") from e

    # ---- control group --------------------------------------------------------------------

    def send(self, message: object, wait: bool = True) -> list[dist.Work]:
        """Rank 0: hand `message` (picklable) to every follower's `receive`. `wait` False:
        return at once, the broadcasts in flight (their works, for `wait_sent`)."""
        self.check()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = bytearray(INLINE_BYTES)
        inline = min(len(payload), INLINE_BYTES - 8)
        head[:8] = struct.pack("<q", len(payload))
        head[8 : 8 + inline] = payload[:inline]
        works = [self._broadcast(_bytes_tensor(head))]
        if inline < len(payload):
            works.append(self._broadcast(_bytes_tensor(bytearray(payload[inline:]))))
        if wait:
            self.wait_sent(works)
        return works

    def wait_sent(self, works: list[dist.Work]) -> None:
        """Wait for the broadcasts of `send(..., wait=False)` (within the deadline)."""
        for work in works:
            self._wait(work, "sending a step", self.timeout_s)

    def receive(self, stop: Callable[[], bool] | None = None) -> object | None:
        """A follower: the next message `send` hands out; waits as long as rank 0 lives
        (None once `stop()` is true, looked at every IDLE_POLL_S; the receive stays posted
        for the next call)."""
        self.check()
        if self._next_head is None:
            head = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
            self._next_head = (head, self._broadcast(head))
        head, work = self._next_head
        while not self._wait(work, "waiting for rank 0's next step", IDLE_POLL_S, idle=True):
            if stop is not None and stop():
                return None
        self._next_head = None
        raw = head.numpy().tobytes()
        (length,) = struct.unpack("<q", raw[:8])
        inline = min(length, INLINE_BYTES - 8)
        payload = raw[8 : 8 + inline]
        if inline < length:
            rest = torch.zeros(length - inline, dtype=torch.uint8)
            self._wait(self._broadcast(rest), "receiving a step", self.timeout_s)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)

    def agree(self, error: str | None) -> tuple[int, str] | None:
        """Every rank reports whether its part of a step ran (`error`: None, or what failed)
        and rank 0 collects the reports (a gather: a follower waits only until its report
        is sent). Rank 0 gets None when all ran, else (the lowest failed rank, its error,
        cut to STATUS_BYTES); a follower always gets None. All ranks call it once per step."""
        self.check()
        status = bytearray(STATUS_BYTES)
        if error is not None:
            text = error.encode()[: STATUS_BYTES - 1]
            status[0], status[1 : 1 + len(text)] = 1, text
        reports = [torch.zeros(STATUS_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        try:
            work = dist.gather(
                _bytes_tensor(status), reports if self.rank == 0 else None, dst=0,
                group=self._control, async_op=True,
            )  # fmt: skip
        except RuntimeError as e:
            raise self.fail(f"a control gather failed: {e}") from e
        assert work is not None
        self._wait(work, "collecting the ranks' reports of a step", self.timeout_s)
        if self.rank != 0:
            return None
        for rank, report in enumerate(reports):
            raw = report.numpy().tobytes()
            if raw[0]:
                return rank, raw[1:].rstrip(b"\0").decode(errors="replace")
        return None

    def reduce_max(self, values: list[float]) -> list[float]:
        """Element-wise max over the ranks (at start-up: FP8 calibration's amax values)."""
        self.check()
        t = torch.tensor(values, dtype=torch.float64)
        self._wait(self._all_reduce(t, dist.ReduceOp.MAX), "agreeing on maxima", self.timeout_s)
        return [float(v) for v in t.tolist()]

    def reduce_min(self, value: int) -> int:
        """The smallest `value` over the ranks (at start-up: the KV pool's block count)."""
        self.check()
        t = torch.tensor([value], dtype=torch.int64)
        self._wait(self._all_reduce(t, dist.ReduceOp.MIN), "agreeing on a minimum", self.timeout_s)
        return int(t.item())

    # ---- state ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise TPGroupError unless the group is open."""
        if self.state is not TPGroupState.OPEN:
            raise TPGroupError(f"TP group rank {self.rank} is {self.state.value}: {self.failure}")

    def fail(self, reason: str) -> TPGroupError:
        """Break the group (the first reason is kept) and close it, so that peers blocked in
        a collective with this rank fail at once (gloo); the error to raise."""
        if self.state is TPGroupState.OPEN:
            self.failure = f"rank {self.rank}: {reason}"
            self.state = TPGroupState.BROKEN
            log.error("TP group broken: %s", self.failure)
            self._destroy()
        return TPGroupError(f"TP group broken ({self.failure})")

    def close(self) -> None:
        """Leave the group (idempotent); its peers' pending collectives then fail."""
        if self.state is TPGroupState.CLOSED:
            return
        if self.state is TPGroupState.OPEN:
            self.failure = "closed"
            self._destroy()
        self.state = TPGroupState.CLOSED

    def __enter__(self) -> TPGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        try:
            work = dist.broadcast(tensor, src=src, group=self._control, async_op=True)
        except RuntimeError as e:
            raise self.fail(f"a control broadcast failed: {e}") from e
        assert work is not None
        return work

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> dist.Work:
        try:
            work = dist.all_reduce(tensor, op=op, group=self._control, async_op=True)
        except RuntimeError as e:
            raise self.fail(f"a control all-reduce failed: {e}") from e
        assert work is not None
        return work

    def _wait(self, work: dist.Work, what: str, timeout_s: float, idle: bool = False) -> bool:
        """Wait for `work` up to `timeout_s`; True when it completed. A timeout breaks the
        group unless `idle` (then False: the op stays pending, to be waited on again)."""
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
            return True
        except RuntimeError as e:
            if work.is_completed():  # it failed (a peer is gone), or completed since the timeout
                try:  # a completed op's wait returns at once, or raises what failed it
                    work.wait(timeout=timedelta(seconds=timeout_s))
                    return True
                except RuntimeError as failed:
                    raise self.fail(f"{what}: {failed}") from failed
            if idle:
                return False
            raise self.fail(f"{what}: no answer from every rank within {timeout_s:g} s") from e

    def _destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _bytes_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def init_world(
    rank: int, size: int, master_addr: str, port: int, backend: str, timeout_s: float
) -> tuple[str, Any]:
    """torch.distributed's world of one worker's `size` ranks (a TP group, or a pipeline's
    stages x TP ranks), rendezvous at tcp://master_addr:port, each op bounded by `timeout_s`;
    returns the backend `backend` resolves to (auto: nccl when CUDA is available, else gloo)
    and the world's gloo control group (host messages beside the device collectives)."""
    if backend not in TP_BACKENDS:
        raise ValueError(f"backend: one of {', '.join(TP_BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group (one worker)")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    return backend, dist.new_group(backend="gloo", timeout=CONTROL_OP_LIMIT)


def init_tp_group(
    rank: int,
    size: int,
    master_addr: str,
    port: int,
    backend: str = "auto",
    timeout_s: float = 60.0,
) -> TPGroup:
    """Join rank `rank` of `size` to its TP group, rendezvous at tcp://master_addr:port (rank
    0 listens there; every rank must call this within `timeout_s` of the others). `backend`:
    auto (nccl when CUDA is available, else gloo), nccl or gloo; `timeout_s` bounds each
    collective (`EngineConfig.tp_timeout_s`). On GPUs each rank must already see its own
    device as the current one (`torch.cuda.set_device`, or one visible device per rank)."""
    shard = TPShard(size, rank)
    backend, control = init_world(rank, size, master_addr, port, backend, timeout_s)
    if backend == "nccl":  # NCCL makes its communicator at the first collective: not in a capture
        warm = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(warm)
        torch.cuda.synchronize()
    return TPGroup(shard, None, control, timeout_s)
