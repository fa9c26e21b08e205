"""The transfer agent of a follower rank (ranks 1.. of a tensor- or pipeline-parallel worker).

Rank 0 of such a worker holds the worker's endpoint (leases and notices on the prefill side, the
transfer manager on the decode side); every other rank has only this: an agent over its own
pool, on its own thread (`AgentLoop`, like every agent), that

- exposes the pool (`start` returns its `RankAgent` for the worker's handshake). A prefill
  rank is read by decode ranks without taking part, but UCX completes a read only while the
  target progresses its worker, so the loop polls for notices every `notif_poll_s` at all
  times (a few microseconds a call; the rank cannot know when rank 0 holds leases);
- runs the reads rank 0's transfer manager gives it (`read`: one plan's part, this rank's
  `SliceRead`s, through kv_transfer/tp_backend.py on rank 0 and a Ray call), polling them
  until DONE or FAILED, and cancelling one at its deadline or on `abort`.

States of a read here: RUNNING → DONE | FAILED (its future holds the status); a read that
cannot be cancelled yet stays RUNNING and is tried again every tick.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.kv.kv_cache import KVCache
from kv_transfer.agent_loop import AgentLoop
from kv_transfer.backend import BackendFactory, MemoryRegion, TransferBackend, XferId, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.protocol import RankAgent, new_agent_name
from kv_transfer.types import TransferPlan
from vocabulary.loop_progress import LoopProgress
from vocabulary.transfer_errors import BackendError, TransferError

log = logging.getLogger(__name__)


def _default_factory() -> BackendFactory:
    from kv_transfer.nixl_backend import nixl_backend_factory

    return nixl_backend_factory


@dataclass
class _Read:
    xfer: XferId
    deadline: float
    future: Future[XferStatus]
    cancelling: bool = False


class RankEndpoint:
    """A follower rank's agent over its pool (module docstring)."""

    def __init__(
        self,
        cache: KVCache,
        worker_id: str,
        rank: int,
        role: str,
        config: KVTransferConfig | None = None,
        backend_factory: BackendFactory | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache = cache
        self.rank = rank
        self.config = config or KVTransferConfig()
        self.agent_name = new_agent_name(f"{worker_id}-r{rank}", role)
        self._factory = backend_factory or _default_factory()
        self._clock = clock
        self._backend: TransferBackend | None = None
        self._reads: dict[str, _Read] = {}  # loop thread only
        self._idle_s = self.config.notif_poll_s if role == "prefill" else self.config.idle_tick_s
        self._loop = AgentLoop(
            f"kv-{role}-{worker_id}-r{rank}", self._tick, self._idle_s, has_work=self._busy
        )
        self._num_reads = 0  # written by the loop, read by `_busy` (an int: atomic enough)

    def start(self) -> RankAgent:
        """Create the agent and register the pool (on the transfer thread)."""
        return self._loop.start(self._setup, self.config.call_timeout_s)

    def _setup(self) -> RankAgent:
        self._backend = self._factory(self.agent_name, self.cache, self.config)
        return RankAgent(
            self.agent_name, self._backend.agent_metadata(), self._backend.memory_region()
        )

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None:
        self._loop.call(
            lambda: self._require().add_peer(agent_name, agent_metadata, region),
            self.config.call_timeout_s,
        )

    def remove_peer(self, agent_name: str) -> None:
        self._loop.call(lambda: self._require().remove_peer(agent_name), self.config.call_timeout_s)

    def read(self, plan: TransferPlan, deadline: float) -> Future[XferStatus]:
        """Start this rank's part of a pull (`plan.slices` are its reads) and end it by the
        wall-clock `deadline`; the future holds DONE or FAILED (or the error that stopped it
        starting). Raises LoopStopped when the endpoint is closed."""
        future: Future[XferStatus] = Future()

        def run() -> None:
            rid = plan.request_id
            try:
                if rid in self._reads:
                    raise TransferError(f"request {rid} is already being read on rank {self.rank}")
                xfer = self._require().start_read(plan, b"")
            except BaseException as e:
                future.set_exception(e)
                return
            self._reads[rid] = _Read(xfer, deadline, future)
            self._num_reads = len(self._reads)

        self._loop.post(run)
        return future

    def abort(self, request_id: str) -> bool:
        """Cancel a read (its future then holds FAILED); True once it cannot write any more
        (also when it has ended, or is unknown here)."""

        def run() -> bool:
            read = self._reads.get(request_id)
            return read is None or self._end(request_id, read, XferStatus.FAILED)

        return self._loop.call(run, self.config.call_timeout_s)

    def progress(self) -> LoopProgress:
        return self._loop.progress()

    def _busy(self) -> bool:
        return self._num_reads > 0

    def _require(self) -> TransferBackend:
        if self._backend is None:
            raise TransferError(f"rank {self.rank}'s transfer agent is not started")
        return self._backend

    def _tick(self) -> float:
        backend = self._backend
        if backend is None:
            return self._idle_s
        try:
            backend.get_notifs()  # progresses UCX: a read of this pool completes meanwhile
        except BackendError as e:
            log.warning("rank %d: reading notices: %s", self.rank, e)
        now = self._clock()
        for rid, read in list(self._reads.items()):
            if read.cancelling or now >= read.deadline:
                self._end(rid, read, XferStatus.FAILED)
                continue
            try:
                status = backend.poll(read.xfer)
            except BackendError as e:
                log.warning("rank %d: read %s failed: %s", self.rank, rid, e)
                status = XferStatus.FAILED
            if status is not XferStatus.IN_PROGRESS:
                self._end(rid, read, status)
        self._num_reads = len(self._reads)
        return self.config.busy_poll_s if self._reads else self._idle_s

    def _end(self, rid: str, read: _Read, status: XferStatus) -> bool:
        """Finish a read with `status` (an unfinished one is cancelled first); False while it
        cannot be cancelled yet (retried each tick)."""
        backend = self._require()
        if status is XferStatus.DONE:
            backend.release(read.xfer)
        else:
            read.cancelling = True
            try:
                if not backend.abort(read.xfer):
                    return False
            except Exception as e:  # as the manager does: a raising abort counts as dropped
                log.error("rank %d: aborting %s raised %s: %s", self.rank, rid, type(e).__name__, e)
        del self._reads[rid]
        self._num_reads = len(self._reads)
        if not read.future.done():
            read.future.set_result(status)
        return True

    def close(self) -> None:
        """Cancel every read, then free the agent."""

        def teardown() -> None:
            for rid, read in list(self._reads.items()):
                if not self._end(rid, read, XferStatus.FAILED):
                    log.error("rank %d: closing with read %s not cancelled", self.rank, rid)
            if self._backend is not None:
                self._backend.close()

        self._loop.stop(teardown, self.config.call_timeout_s)
