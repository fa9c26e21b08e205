"""Rank 0's view of its parallel worker's follower actors (worker_runtime/tp_follower.py).

A TP worker is N ranks on one node, a pipeline-parallel one S stages of T ranks (rank
stage * T + tp rank, engine/core/pp_runner.py; on one node or over the Ray cluster's nodes),
their group joined by `join_worker_group`; deploy/control/worker_actors.py places them together
in one placement group. The worker's own actor is rank 0 and runs the engine (scheduler,
sampler) with a `TPLeader` or a `PPLeader`. At start (`TPRanks.start`) rank 0 picks a free port
on its node, hands (address, port) to every follower's `start`, joins the group itself and
builds its engine while they build their parts (the start-up collectives need every rank),
then collects their transfer agents in rank order (stage-major for a pipeline), which its KV
endpoint lists in its handshake (prefill) or drives (decode: `backends`, one `FollowerBackend`
per follower over Ray calls).

Health: every rank of every stage counts. `failure()` is set once a follower's ping fails (its
actor died, or it reports itself unable to serve) or the group broke (a step missed its
deadline on some rank: engine/tp/tensor_parallel.py, engine/pp/pipeline_group.py), and rank 0's
health check (`probe`, watched by `WorkerRuntime`) then reports the whole worker unhealthy: the
controller replaces all of it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.pp_runner import pipeline_stage
from engine.kv.kv_cache import KVCache
from engine.pp.pipeline_group import PPGroup, init_pp_group
from engine.tp.tensor_parallel import TPGroup, TPGroupState, init_tp_group
from kv_transfer.backend import BackendFactory, MemoryRegion, TransferBackend, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.protocol import RankAgent
from kv_transfer.tp_backend import FollowerBackend, TPBackend
from kv_transfer.types import TransferPlan
from vocabulary.loop_progress import LoopProgress, LoopState
from vocabulary.waits import wait_within

log = logging.getLogger(__name__)

PING_INTERVAL_S = 1.0
"""How often rank 0 pings its followers."""
PING_TIMEOUT_S = 5.0
"""A follower ping that takes longer fails (a follower whose actor is wedged)."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


WorkerGroup = TPGroup | PPGroup
"""A parallel worker's process group: tensor-parallel ranks, or pipeline stages of them."""


def join_worker_group(config: EngineConfig, rank: int, host: str, port: int) -> WorkerGroup:
    """Join rank `rank` of an engine of `config` to its worker's group (rank 0 listens at
    host:port): a `PPGroup` with pipeline stages, else a `TPGroup`."""
    if config.pipeline_parallel_size > 1:
        stage = pipeline_stage(config, rank)
        return init_pp_group(
            rank, stage, config.tensor_parallel_size, host, port,
            timeout_s=config.tp_timeout_s,
        )  # fmt: skip
    return init_tp_group(
        rank, config.tensor_parallel_size, host, port, timeout_s=config.tp_timeout_s
    )


class TPRanks:
    """The followers of one TP worker, seen from rank 0 (module docstring)."""

    def __init__(
        self, followers: Sequence[Any], worker_id: str, transfer: KVTransferConfig
    ) -> None:
        self.followers = list(followers)
        self.worker_id = worker_id
        self.transfer = transfer
        self.agents: list[RankAgent] = []
        self.group: WorkerGroup | None = None
        self._failure = ""
        self._pinger: asyncio.Task[None] | None = None

    @property
    def size(self) -> int:
        return len(self.followers) + 1

    async def start(
        self,
        build: Callable[[WorkerGroup], LLMEngine],
        config: EngineConfig,
        start_timeout_s: float,
    ) -> LLMEngine:
        """Start every follower and build rank 0's engine of `config` with `build(group)` (on
        a thread); returns the engine once every follower is ready. Raises (naming the rank)
        when one fails or does not answer within `start_timeout_s`."""
        host = node_address()
        port = free_port(host)
        starts = [f.start.remote(host, port) for f in self.followers]

        def build_rank0() -> LLMEngine:
            group = join_worker_group(config, 0, host, port)
            self.group = group
            try:
                return build(group)
            except BaseException:
                group.close()
                raise

        engine = await asyncio.to_thread(build_rank0)
        for rank, ref in enumerate(starts, start=1):
            try:
                self.agents.append(await wait_within(ref, start_timeout_s))
            except BaseException as e:
                raise RuntimeError(
                    f"worker {self.worker_id}: rank {rank} did not start: {e}"
                ) from e
        self._pinger = asyncio.get_running_loop().create_task(self._ping_loop())
        log.info("worker %s: %d ranks ready", self.worker_id, self.size)
        return engine

    # ---- health ---------------------------------------------------------------------------

    def failure(self) -> str:
        """Why the worker cannot serve any more ("" while every rank can)."""
        group = self.group
        if not self._failure and group is not None and group.state is TPGroupState.BROKEN:
            self._failure = f"TP group broken ({group.failure})"  # (a pipeline's too)
        return self._failure

    def probe(self) -> LoopProgress:
        """The ranks as a watched loop (`WorkerRuntime.watch`): DIED once `failure()`."""
        failure = self.failure()
        state = LoopState.DIED if failure else LoopState.RUNNING
        return LoopProgress(state=state, has_work=False, stalled_s=0.0, error=failure)

    async def _ping_loop(self) -> None:
        while not self._failure:
            await asyncio.sleep(PING_INTERVAL_S)
            results = await asyncio.gather(
                *(wait_within(f.ping.remote(), PING_TIMEOUT_S) for f in self.followers),
                return_exceptions=True,
            )
            for rank, r in enumerate(results, start=1):
                if isinstance(r, BaseException) and not self._failure:
                    self._failure = f"rank {rank}: {type(r).__name__}: {r}"
                    log.error("worker %s: %s", self.worker_id, self._failure)

    # ---- transfers ------------------------------------------------------------------------

    def backend_factory(self) -> BackendFactory:
        """A decode worker's endpoint backend: a `TPBackend` over rank 0's NIXL agent and the
        followers' (kv_transfer/tp_backend.py)."""
        from kv_transfer.nixl_backend import nixl_backend_factory

        def make(agent_name: str, cache: KVCache, config: KVTransferConfig) -> TransferBackend:
            return TPBackend([nixl_backend_factory(agent_name, cache, config), *self.backends()])

        return make

    def backends(self) -> list[TransferBackend]:
        """A decode worker's followers as transfer backends of rank 0's `TPBackend`."""
        timeout = self.transfer.call_timeout_s
        read_timeout = self.transfer.transfer_timeout_s + self.transfer.call_timeout_s
        return [
            FollowerBackend(rank, agent, RayRankLink(f, timeout), read_timeout)
            for rank, (f, agent) in enumerate(zip(self.followers, self.agents, strict=True), 1)
        ]

    # ---- stop -----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop pinging and tell the followers to stop (best effort: the controller removes
        the worker's placement group, which ends them in any case)."""
        if self._pinger is not None:
            self._pinger.cancel()
        await asyncio.gather(
            *(wait_within(f.shutdown.remote(), 10.0) for f in self.followers),
            return_exceptions=True,
        )


class _RayPending:
    """A follower's `read_kv` call in flight (kv_transfer/tp_backend.py PendingRead)."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self) -> XferStatus:
        import ray

        return XferStatus(ray.get(self.ref, timeout=0))


class RayRankLink:
    """Rank 0's `RankLink` to one follower actor (called on rank 0's transfer thread)."""

    def __init__(self, actor: Any, timeout_s: float) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def add_peer(self, agent_name: str, agent_metadata: bytes, region: MemoryRegion) -> None:
        import ray

        ref = self.actor.add_kv_peer.remote(agent_name, agent_metadata, region)
        ray.get(ref, timeout=self.timeout_s)

    def remove_peer(self, agent_name: str) -> None:
        import ray

        ray.get(self.actor.remove_kv_peer.remote(agent_name), timeout=self.timeout_s)

    def read(self, plan: TransferPlan, deadline: float) -> _RayPending:
        return _RayPending(self.actor.read_kv.remote(plan, deadline))

    def abort(self, request_id: str) -> bool:
        import ray

        started = time.monotonic()
        try:
            return bool(ray.get(self.actor.abort_kv.remote(request_id), timeout=self.timeout_s))
        except ray.exceptions.RayActorError:
            return True  # its process is gone: nothing writes any more
        except ray.exceptions.GetTimeoutError:
            log.warning("abort of %s: no answer in %.1fs", request_id, time.monotonic() - started)
            return False
