"""A follower rank of a parallel worker: a small Ray actor, one per rank 1..N-1 (a TP worker's
ranks, or a pipeline worker's stages x TP ranks: engine/core/pp_runner.py).

Rank 0 is the worker's own actor (a PrefillWorker or DecodeWorker; worker_runtime/tp_ranks.py
is its view of the followers). A follower holds its part of the model and its own KV pool
(its KV heads; a pipeline rank: its stage's layers of them) and does three things:

1. `start(addr, port)`: join rank 0's group (rank 0 listens at addr:port), build its part
   while rank 0 builds its engine (engine/core/tp_runner.py `prepare_follower`, or
   engine/core/pp_runner.py `prepare_stage`: the start-up collectives), register its pool
   with its own transfer agent (kv_transfer/rank_endpoint.py) and return that agent
   (`RankAgent`) for the worker's handshake; then
2. run rank 0's steps on a thread of its own (`serve_follower` / `serve_stage`) until rank 0
   closes the group or the group breaks (rank 0 died, a deadline passed: `TPGroupError`);
3. a decode worker's follower runs its part of each KV pull (`read_kv`, `abort_kv`, and its
   peers: `add_kv_peer`, `remove_kv_peer`) for rank 0's transfer manager.

`ping` is rank 0's health check of this rank: it raises `WorkerUnhealthy` once the step
thread has ended with an error, or the transfer agent's thread died.

Lifecycle: NEW → start() → SERVING → (group closed by rank 0, or `shutdown`) STOPPED, or
SERVING → (the group broke) FAILED. The actor lives in its worker's placement group, which the
controller removes with the worker (so a dead worker leaves no follower behind).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading

from engine.core.pp_runner import StageLoop, prepare_stage, serve_stage
from engine.core.runner import ModelRunner
from engine.core.tp_runner import prepare_follower, serve_follower
from engine.pp.pipeline_group import PPGroup
from engine.tp.tensor_parallel import TPGroup
from kv_transfer.backend import MemoryRegion, XferStatus
from kv_transfer.config import KVTransferConfig
from kv_transfer.protocol import RankAgent
from kv_transfer.rank_endpoint import RankEndpoint
from kv_transfer.types import TransferPlan
from vocabulary.malloc_trim import start_malloc_trim
from vocabulary.worker_api import WorkerRole, WorkerUnhealthy
from worker_runtime.runtime import WorkerConfig, stall_reason
from worker_runtime.tp_ranks import WorkerGroup, join_worker_group

log = logging.getLogger(__name__)


class FollowerState(enum.Enum):
    """NEW → SERVING → STOPPED | FAILED (module docstring)."""

    NEW = "new"
    SERVING = "serving"
    STOPPED = "stopped"
    FAILED = "failed"


class TPFollower:
    """Ray actor class of rank `rank` (> 0) of worker `config.worker_id`."""

    def __init__(self, config: WorkerConfig, transfer: KVTransferConfig, rank: int) -> None:
        if not 0 < rank < config.engine.num_ranks:
            raise ValueError(f"follower rank {rank} of {config.engine.num_ranks} ranks")
        start_malloc_trim(f"{config.role.value} rank {rank}")  # from PDSERVE_MALLOC_TRIM_S
        self.config = config
        self.transfer = transfer
        self.rank = rank
        self.state = FollowerState.NEW
        self.failure = ""
        self.steps = 0
        self._group: WorkerGroup | None = None
        self._endpoint: RankEndpoint | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    async def start(self, master_addr: str, port: int) -> RankAgent:
        """Join the group at master_addr:port, build this rank, start its agent (module
        docstring, 1); returns the agent. Raises what failed (the worker then fails to start)."""
        built = await asyncio.to_thread(self._build, master_addr, port)
        runner = built.runner if isinstance(built, StageLoop) else built
        role = "prefill" if self.config.role is WorkerRole.PREFILL else "decode"
        endpoint = RankEndpoint(
            runner.kv_cache, self.config.worker_id, self.rank, role, self.transfer
        )
        agent = await asyncio.to_thread(endpoint.start)
        self._endpoint = endpoint
        self.state = FollowerState.SERVING
        self._thread = threading.Thread(
            target=self._serve, args=(built,), name=f"rank-{self.rank}", daemon=True
        )
        self._thread.start()
        return agent

    def _build(self, master_addr: str, port: int) -> ModelRunner | StageLoop:
        import torch

        engine = self.config.engine
        if engine.device in ("cpu", "auto") and not torch.cuda.is_available():
            torch.set_num_threads(max(1, self.config.torch_threads))
        group = join_worker_group(engine, self.rank, master_addr, port)
        self._group = group
        try:
            if isinstance(group, PPGroup):
                return prepare_stage(engine, group)
            return prepare_follower(engine, group)
        except BaseException:
            group.close()
            raise

    def _serve(self, built: ModelRunner | StageLoop) -> None:
        assert self._group is not None
        try:
            group, stop = self._group, lambda: self._stopping
            if isinstance(built, StageLoop):
                self.steps = serve_stage(built, stop)
            else:
                assert isinstance(group, TPGroup)
                self.steps = serve_follower(group, built, stop)
            self.state = FollowerState.STOPPED
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
            self.state = FollowerState.FAILED
            log.error("rank %d stopped serving: %s", self.rank, self.failure)
        finally:
            self._group.close()

    def ping(self) -> str:
        """This rank's state; raises WorkerUnhealthy once it cannot serve (module docstring)."""
        wid = self.config.worker_id
        if self.state is FollowerState.FAILED:
            raise WorkerUnhealthy(f"worker {wid}: rank {self.rank} failed: {self.failure}")
        if self._endpoint is not None:
            progress = self._endpoint.progress()
            why = stall_reason("transfer thread", progress, self.config.stall_timeout_s)
            if why is not None:
                raise WorkerUnhealthy(f"worker {wid}: rank {self.rank}'s {why}")
        return self.state.value

    # ---- a decode worker's KV pulls (kv_transfer/tp_backend.py RankLink) ---------------------

    async def read_kv(self, plan: TransferPlan, deadline: float) -> XferStatus:
        """Run this rank's part of a pull (`plan.slices`) by the wall-clock `deadline`."""
        return await asyncio.wrap_future(self._agent().read(plan, deadline))

    async def abort_kv(self, request_id: str) -> bool:
        return await asyncio.to_thread(self._agent().abort, request_id)

    async def add_kv_peer(self, agent_name: str, metadata: bytes, region: MemoryRegion) -> None:
        await asyncio.to_thread(self._agent().add_peer, agent_name, metadata, region)

    async def remove_kv_peer(self, agent_name: str) -> None:
        await asyncio.to_thread(self._agent().remove_peer, agent_name)

    def _agent(self) -> RankEndpoint:
        if self._endpoint is None:
            raise RuntimeError(f"rank {self.rank} is not started")
        return self._endpoint

    async def shutdown(self) -> None:
        """Stop serving (rank 0 normally ends the group first) and free the agent."""
        self._stopping = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._endpoint is not None:
            await asyncio.to_thread(self._endpoint.close)
        if self.state is FollowerState.SERVING:
            self.state = FollowerState.STOPPED
