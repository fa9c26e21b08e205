"""The transfer backend of a decode worker of several ranks (tensor-parallel, pipeline-parallel
or both): rank 0's agent and its followers'.

Each rank of such a worker has its own pool (its stage's layers of its KV heads) and its own
agent over it, in its own process; `ranks` are in the worker's rank order (stage-major,
kv_transfer/tp_plan.py), which the plan's `SliceRead.decode_rank` indexes. The worker's one
transfer manager (kv_transfer/manager.py: budget, leases, deadlines) runs on rank 0 and sees
one backend: this one, whose ranks are rank 0's own agent and a `FollowerBackend` per
follower: the follower runs its part on its own agent (kv_transfer/rank_endpoint.py), reached
through a `RankLink` (in a worker, Ray calls to the follower's actor:
worker_runtime/tp_ranks.py). A read of a plan is every rank's part of it
(`TransferPlan.for_rank`: the rank's `SliceRead`s), started together:

    start_read: each rank starts its part (one failing to start cancels those started)
    poll: DONE once every part is DONE, then the notice goes to the lease holder (the prefill
          worker's rank 0: it may free the blocks only once every rank has read them);
          a part that FAILED (or raised) first has the other parts cancelled, and the read
          raises that part's error only once none of them can write any more
    abort: cancels every part; True once all are cancelled

A peer (a prefill rank's agent) is loaded on every rank. Every method runs on rank 0's
transfer thread, like any backend's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kv_transfer.backend import MemoryRegion, Notification, TransferBackend, XferId, XferStatus
from kv_transfer.protocol import RankAgent
from kv_transfer.types import TransferPlan
from vocabulary.kv_events import KVTier
from vocabulary.transfer_errors import BackendError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class _Part:
    rank: int
    xfer: XferId
    done: bool = False
    cancelled: bool = False


@dataclass
class _Read:
    plan: TransferPlan
    notif: bytes
    parts: list[_Part] = field(default_factory=list)
    error: BackendError | None = None  # a part failed: cancelling the others


class TPBackend:
    """One backend over every rank of a TP decode worker (module docstring); `ranks[0]` is
    rank 0's own agent."""

    def __init__(self, ranks: Sequence[TransferBackend]) -> None:
        if not ranks:
            raise ValueError("a TP backend needs rank 0's backend")
        self.ranks = list(ranks)
        self.agent_name = self.ranks[0].agent_name
        self._reads: dict[XferId, _Read] = {}
        self._next_id = 0

    def agent_metadata(self) -> bytes:
        return self.ranks[0].agent_metadata()

    def memory_region(self) -> MemoryRegion:
        return self.ranks[0].memory_region()

    def register_tier(self, tensor: torch.Tensor, tier: KVTier) -> MemoryRegion:
        raise BackendError(f"a tensor-parallel worker has no {tier.value} tier to register")

    def add_peer(
        self,
        agent_name: str,
        agent_metadata: bytes,
        region: MemoryRegion,
        tier_regions: Sequence[MemoryRegion] = (),
    ) -> None:
        """(A peer's host-tier regions are not loaded: a TP pull reads KV pools only, and
        plan_transfer refuses a handle with host-tier blocks here.)"""
        for backend in self.ranks:
            backend.add_peer(agent_name, agent_metadata, region)

    def remove_peer(self, agent_name: str) -> None:
        """On every rank; the first error is raised after all were tried."""
        first: Exception | None = None
        for backend in self.ranks:
            try:
                backend.remove_peer(agent_name)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        if not plan.slices:
            raise BackendError(f"{plan.request_id}: a TP worker's pull names each rank's reads")
        if {s.decode_rank for s in plan.slices} - set(range(len(self.ranks))):
            raise BackendError(f"{plan.request_id}: reads for ranks this worker does not have")
        read = _Read(plan, notif)
        try:
            for rank, backend in enumerate(self.ranks):
                part = plan.for_rank(rank)
                if part.slices:
                    read.parts.append(_Part(rank, backend.start_read(part, b"")))
        except BaseException:
            for p in read.parts:  # best effort: a part that cannot be cancelled logs it
                self._cancel(p)
            raise
        self._next_id += 1
        self._reads[self._next_id] = read
        return self._next_id

    def poll(self, xfer: XferId) -> XferStatus:
        read = self._reads[xfer]
        if read.error is None:
            for p in read.parts:
                if p.done:
                    continue
                try:
                    status = self.ranks[p.rank].poll(p.xfer)
                except BackendError as e:
                    read.error = e
                    break
                if status is XferStatus.DONE:
                    p.done = True
                elif status is XferStatus.FAILED:
                    read.error = BackendError(f"decode rank {p.rank}'s read failed")
                    break
        if read.error is not None:
            if not all(p.done or self._cancel(p) for p in read.parts):
                return XferStatus.IN_PROGRESS  # a part may still write: try again next poll
            raise read.error  # (the manager then releases the read and fails the transfer)
        if not all(p.done for p in read.parts):
            return XferStatus.IN_PROGRESS
        if read.notif:
            message, read.notif = read.notif, b""
            try:  # best effort: the bytes are in; without it the lease expires instead
                self.ranks[0].send_notif(read.plan.peer, message)
            except BackendError as e:
                log.warning("completion notice to %s failed: %s", read.plan.peer, e)
        return XferStatus.DONE

    def _cancel(self, p: _Part) -> bool:
        """Abort one unfinished part; True once it cannot write any more."""
        if p.cancelled:
            return True
        try:
            p.cancelled = self.ranks[p.rank].abort(p.xfer)
        except Exception as e:  # as the manager does: a raising abort is taken as dropped
            log.error("decode rank %d: abort raised %s: %s", p.rank, type(e).__name__, e)
            p.cancelled = True
        return p.cancelled

    def descriptor_count(self, xfer: XferId) -> int | None:
        counts = [self.ranks[p.rank].descriptor_count(p.xfer) for p in self._reads[xfer].parts]
        return None if any(c is None for c in counts) else sum(c for c in counts if c)

    def release(self, xfer: XferId) -> None:
        read = self._reads.pop(xfer, None)
        if read is None:
            return
        for p in read.parts:
            if not p.cancelled:
                self.ranks[p.rank].release(p.xfer)

    def abort(self, xfer: XferId) -> bool:
        read = self._reads.get(xfer)
        if read is None:
            return True
        if all(p.done or self._cancel(p) for p in read.parts):
            for p in read.parts:
                if p.done:
                    self.ranks[p.rank].release(p.xfer)
            del self._reads[xfer]
            return True
        return False

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self.ranks[0].send_notif(agent_name, message)

    def get_notifs(self) -> list[Notification]:
        return self.ranks[0].get_notifs()

    def close(self) -> None:
        """Rank 0's agent; followers close their own when their worker stops."""
        for xfer in list(self._reads):
            if not self.abort(xfer):
                log.error("closing with a read that could not be aborted")
        self.ranks[0].close()


class PendingRead(Protocol):
    """A follower's read in flight, as rank 0 holds it (a `concurrent.futures.Future` is one)."""

    def done(self) -> bool:
        """Whether the follower has answered (never waits)."""
        ...

    def result(self) -> XferStatus:
        """Its DONE or FAILED; raises what stopped it (e.g. the follower is gone)."""
        ...


class RankLink(Protocol):
    """How rank 0 reaches one follower's agent (kv_transfer/rank_endpoint.py's methods; in a
    worker, Ray calls to the follower's actor). Calls other than `read` wait, each within
    its own deadline."""

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None: ...

    def remove_peer(self, agent_name: str) -> None: ...

    def read(self, plan: TransferPlan, deadline: float) -> PendingRead: ...

    def abort(self, request_id: str) -> bool:
        """True once the read cannot write any more (also when the follower is gone)."""
        ...


class FollowerBackend:
    """The `TransferBackend` of one follower rank inside a `TPBackend`: reads go to the
    follower over `link` and are bounded there by `read_timeout_s` (the manager's own
    deadline aborts them sooner)."""

    def __init__(self, rank: int, agent: RankAgent, link: RankLink, read_timeout_s: float) -> None:
        self.rank = rank
        self.agent = agent
        self.agent_name = agent.agent_name
        self.link = link
        self.read_timeout_s = read_timeout_s
        self._reads: dict[XferId, tuple[str, PendingRead]] = {}
        self._next_id = 0

    def agent_metadata(self) -> bytes:
        return self.agent.agent_metadata

    def memory_region(self) -> MemoryRegion:
        return self.agent.region

    def register_tier(self, tensor: torch.Tensor, tier: KVTier) -> MemoryRegion:
        raise BackendError(f"a tensor-parallel worker has no {tier.value} tier to register")

    def add_peer(
        self,
        agent_name: str,
        agent_metadata: bytes,
        region: MemoryRegion,
        tier_regions: Sequence[MemoryRegion] = (),
    ) -> None:
        try:
            self.link.add_peer(agent_name, agent_metadata, region)
        except BackendError:
            raise
        except Exception as e:
            raise BackendError(f"decode rank {self.rank}: loading {agent_name}: {e}") from e

    def remove_peer(self, agent_name: str) -> None:
        self.link.remove_peer(agent_name)

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        try:
            pending = self.link.read(plan, time.time() + self.read_timeout_s)
        except Exception as e:
            raise BackendError(f"decode rank {self.rank}: starting {plan.request_id}: {e}") from e
        self._next_id += 1
        self._reads[self._next_id] = (plan.request_id, pending)
        return self._next_id

    def poll(self, xfer: XferId) -> XferStatus:
        rid, pending = self._reads[xfer]
        if not pending.done():
            return XferStatus.IN_PROGRESS
        try:
            return pending.result()
        except Exception as e:
            raise BackendError(f"decode rank {self.rank}'s read of {rid}: {e}") from e

    def descriptor_count(self, xfer: XferId) -> int | None:
        return None

    def release(self, xfer: XferId) -> None:
        self._reads.pop(xfer, None)

    def abort(self, xfer: XferId) -> bool:
        entry = self._reads.get(xfer)
        if entry is None:
            return True
        rid, pending = entry
        if pending.done() or self.link.abort(rid):
            del self._reads[xfer]
            return True
        return False

    def send_notif(self, agent_name: str, message: bytes) -> None:
        raise BackendError(f"decode rank {self.rank} sends no notices (rank 0 does)")

    def get_notifs(self) -> list[Notification]:
        return []

    def close(self) -> None:
        """Nothing: the follower closes its agent when its worker stops."""
