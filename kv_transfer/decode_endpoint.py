"""Decode side of the KV hand-off: pull the blocks a `KVHandle` names into local blocks.

A decode worker's view of one request:

1. it receives a `KVHandle` (from the router) and, if the handle's agent is new, the prefill
   worker's `HandshakeInfo`, which it passes to `add_peer` (refused with `HandshakeError` when
   protocol or KV layout differ);
2. it allocates destination blocks (reusing the leading blocks it already caches) and calls
   `submit`, which returns the `TransferPlan` at once; if `submit` raises, nothing happened
   and the worker still owns its blocks;
3. exactly one outcome follows, on the endpoint's thread: `on_done(outcome)` when the bytes
   are in place, or `on_failed(outcome)` (FAILED or EXPIRED, with a typed `TransferError`)
   when the destination blocks are free to reuse. Every transfer has a deadline (default
   `transfer_timeout_s`), so an outcome always comes.

Tensor or pipeline parallelism (either side): the handshake plans which layers and heads each
decode rank reads from which prefill rank (kv_transfer/tp_plan.py), and every pull carries
those reads (`SliceRead`s); this endpoint is then rank 0's, its backend drives every rank's
reads (kv_transfer/tp_backend.py: every stage's ranks too), and one pull is done when all are.
A pipeline-parallel worker passes its stage bounds (`layer_bounds`) and, for an e4m3 pool,
the model's scales (`model_scales`): its rank 0's pool spec names only stage 0's.

Callbacks run on the transfer thread: they must be quick and must not wait on the endpoint
(route them into the engine thread). `load()`, `stats()`, `has_peer()` and `progress()` read
snapshots and never block. Every NIXL call happens on the endpoint's own thread (`AgentLoop`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine.kv.kv_cache import KVCache
from kv_transfer.agent_loop import AgentLoop
from kv_transfer.backend import BackendFactory, TransferBackend
from kv_transfer.budget import Candidate, InFlightBudget
from kv_transfer.config import KVTransferConfig
from kv_transfer.manager import OutcomeCallback, TransferManager, TransferState
from kv_transfer.plan import plan_transfer, slice_reads
from kv_transfer.protocol import HandshakeInfo, check_handshake, new_agent_name
from kv_transfer.types import SliceRead, TransferPlan, compat_fields, compat_hash, kv_split
from vocabulary.kv_handle import KVHandle
from vocabulary.loop_progress import LoopProgress
from vocabulary.transfer_errors import HandshakeError, TransferError, UnknownPeer
from vocabulary.transfer_load import TransferLoad, TransferStats

log = logging.getLogger(__name__)


def _default_factory() -> BackendFactory:
    from kv_transfer.nixl_backend import nixl_backend_factory

    return nixl_backend_factory


class DecodeEndpoint:
    """Pulls KV blocks from prefill peers under an in-flight budget (see module docstring)."""

    def __init__(
        self,
        cache: KVCache,
        model_id: str,
        worker_id: str,
        on_done: OutcomeCallback,
        on_failed: OutcomeCallback,
        config: KVTransferConfig | None = None,
        backend_factory: BackendFactory | None = None,
        clock: Callable[[], float] = time.time,
        budget: InFlightBudget | None = None,
        layer_bounds: Sequence[int] = (),
        model_scales: Sequence[float] = (),
    ) -> None:
        """`budget`: the worker's in-flight budget, shared with its engine's host tier
        (kv_transfer/budget.py); None: the endpoint's own. `layer_bounds`: the worker's stage
        bounds (`kv_split`; empty: one stage, or equal stages); `model_scales`: an e4m3
        model's scales over every layer when `cache` is one stage's pool (`model_kv_scales`)."""
        self.cache = cache
        self.split = kv_split(cache.spec, layer_bounds)
        self.worker_id = worker_id
        self.budget = budget
        self.config = config or KVTransferConfig()
        self.compat_hash = compat_hash(cache.spec, model_id, model_scales)
        self.compat_fields = compat_fields(cache.spec, model_id, model_scales)
        self.agent_name = new_agent_name(worker_id, "decode")
        self._factory = backend_factory or _default_factory()
        self._on_done = on_done
        self._on_failed = on_failed
        self._clock = clock
        self._backend: TransferBackend | None = None
        self._manager: TransferManager | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, Candidate] = {}  # submitted, not yet seen by the loop
        self._peers: frozenset[str] = frozenset()
        self._reads: dict[str, tuple[tuple[str, ...], tuple[SliceRead, ...]]] = {}
        """Per peer (its rank 0 agent): its ranks' agents and the reads of every pull from it
        (no reads: whole blocks, both workers of one rank)."""
        self._load = TransferLoad(
            max_inflight_blocks=self.config.budget.max_inflight_blocks,
            max_inflight_bytes=self.config.budget.max_inflight_bytes,
        )
        self._stats = TransferStats()
        self._published_version = -1
        self._loop = AgentLoop(
            f"kv-decode-{worker_id}", self._tick, self.config.idle_tick_s, self._has_transfers
        )

    def start(self) -> None:
        """Create the agent and register the KV pool (on the transfer thread)."""
        self._loop.start(self._setup, self.config.call_timeout_s)

    def _setup(self) -> None:
        self._backend = self._factory(self.agent_name, self.cache, self.config)
        self._manager = TransferManager(
            self._backend,
            self.config,
            self.compat_hash,
            self._on_done,
            self._on_failed,
            self._clock,
            self.budget,
        )

    # ---- peers ----------------------------------------------------------------------------

    def add_peer(self, info: HandshakeInfo) -> None:
        """Accept a prefill peer's handshake (idempotent). Raises `HandshakeError`."""
        spec = self.cache.spec
        plan = check_handshake(
            info,
            self.compat_hash,
            self.compat_fields,
            self.split,
            spec.head_nbytes,
            spec.num_segments,
        )
        agents = tuple(r.agent_name for r in info.ranks)
        one_rank = plan.prefill.num_ranks == plan.decode.num_ranks == 1
        reads = () if one_rank else slice_reads(plan, agents, spec.head_nbytes)

        def run() -> None:
            assert self._backend is not None and self._manager is not None
            for rank in info.ranks:  # rank 0 first: it takes the notices
                # (rank 0's other tiers, its host tier: handles may name blocks there)
                tiers = info.tier_regions if rank.agent_name == info.agent_name else ()
                if tiers:
                    self._backend.add_peer(rank.agent_name, rank.agent_metadata, rank.region, tiers)
                else:
                    self._backend.add_peer(rank.agent_name, rank.agent_metadata, rank.region)
            with self._lock:
                self._reads[info.agent_name] = (agents, reads)
            self._manager.add_peer(info.agent_name)
            self._publish()

        self._loop.call(run, self.config.call_timeout_s)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    # ---- transfers ------------------------------------------------------------------------

    def submit(
        self,
        handle: KVHandle,
        local_block_ids: Sequence[int],
        num_reused: int = 0,
        deadline: float | None = None,
    ) -> TransferPlan:
        """Pull `handle.block_ids[num_reused:]` into `local_block_ids` by `deadline`.

        `deadline` is wall-clock (`time.time()`), default now + `transfer_timeout_s`. With an
        engine `TransferAllocation`, pass `alloc.blocks_to_transfer` and
        `num_reused=alloc.num_cached_blocks`. Raises (and changes nothing) for a bad plan, an
        incompatible handle, an unknown peer or a closed endpoint; otherwise exactly one of
        `on_done` / `on_failed` follows.
        """
        with self._lock:
            agents, reads = self._reads.get(handle.agent_name, (handle.agents, ()))
        if handle.agents != agents:
            raise UnknownPeer(
                f"request {handle.request_id}: its rank agents {handle.agents} are not those "
                f"of the handshake with {handle.agent_name} ({agents})"
            )
        spec = self.cache.spec
        plan = plan_transfer(
            handle, local_block_ids, spec.block_nbytes, num_reused, reads, spec.num_segments
        )
        if plan.local_block_ids and max(plan.local_block_ids) >= spec.num_blocks:
            raise ValueError(f"request {handle.request_id}: destination block outside the pool")
        if handle.compat_hash != self.compat_hash:
            raise HandshakeError(
                f"request {handle.request_id}: KV compat hash {handle.compat_hash} "
                f"differs from this worker's {self.compat_hash}"
            )
        if handle.agent_name not in self._peers:
            raise UnknownPeer(f"request {handle.request_id}: no handshake with {handle.agent_name}")
        rid = handle.request_id
        with self._lock:
            if rid in self._pending:
                raise ValueError(f"request {rid} is already submitted")
            self._pending[rid] = Candidate(rid, plan.peer, plan.num_blocks, plan.nbytes)

        def run() -> None:
            assert self._manager is not None
            with self._lock:
                self._pending.pop(rid, None)
            self._manager.submit(handle, plan, deadline)

        try:
            self._loop.post(run)
        except TransferError:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        return plan

    def cancel(self, request_id: str) -> None:
        """Fail the transfer with `TransferCancelled` (its outcome frees the blocks)."""

        def run() -> None:
            assert self._manager is not None
            self._manager.cancel(request_id)

        self._loop.post(run)

    def state_of(self, request_id: str) -> TransferState | None:
        """Current or recent final state (asks the transfer thread; for tests and debugging)."""
        with self._lock:
            if request_id in self._pending:
                return TransferState.QUEUED
        assert self._manager is not None
        manager = self._manager
        return self._loop.call(lambda: manager.state_of(request_id), self.config.call_timeout_s)

    # ---- views ----------------------------------------------------------------------------

    def load(self) -> TransferLoad:
        """Transfer load for admission/placement: last snapshot plus not-yet-queued submits."""
        with self._lock:
            pending = list(self._pending.values())
            load = self._load
        if not pending:
            return load
        return TransferLoad(
            in_flight_transfers=load.in_flight_transfers,
            in_flight_blocks=load.in_flight_blocks,
            in_flight_bytes=load.in_flight_bytes,
            queued_transfers=load.queued_transfers + len(pending),
            queued_blocks=load.queued_blocks + sum(c.num_blocks for c in pending),
            queued_bytes=load.queued_bytes + sum(c.nbytes for c in pending),
            max_inflight_blocks=load.max_inflight_blocks,
            max_inflight_bytes=load.max_inflight_bytes,
            per_peer=load.per_peer,
        )

    def stats(self) -> TransferStats:
        return self._stats

    def progress(self) -> LoopProgress:
        """The transfer thread's progress (for the worker's health check): work is pending
        while transfers are submitted, queued or in flight."""
        return self._loop.progress()

    def _has_transfers(self) -> bool:  # any thread: reads the published load
        load = self.load()
        return load.queued_transfers > 0 or load.in_flight_transfers > 0

    # ---- loop -----------------------------------------------------------------------------

    def _tick(self) -> float:
        if self._manager is None:
            return self.config.idle_tick_s
        delay = self._manager.step()
        if self._backend is not None:
            # Drive UCX progress on every tick: without NIXL's progress thread, a notice posted
            # while nothing else is in flight (`done` for a fully reused prompt, the first
            # contact with a peer) only leaves once the worker is progressed. Decode receives
            # no notices, so the answer is empty.
            self._backend.get_notifs()
        if self._manager.version != self._published_version:
            self._publish()
        return delay

    def _publish(self) -> None:
        assert self._manager is not None
        self._published_version = self._manager.version
        load, stats = self._manager.load(), self._manager.stats()
        with self._lock:
            self._load, self._stats = load, stats
            self._peers = frozenset(self._manager.peers)
            lost = [p for p in self._reads if p not in self._peers]
            gone = [self._reads.pop(p)[0][1:] for p in lost]
        for agents in gone:  # a lost peer's other ranks (the manager removed rank 0's)
            for agent in agents:
                self._forget_agent(agent)

    def _forget_agent(self, agent: str) -> None:
        assert self._backend is not None
        try:
            self._backend.remove_peer(agent)
        except Exception as e:  # forgotten here either way
            log.warning("removing agent %s of a lost peer: %s: %s", agent, type(e).__name__, e)

    def close(self) -> None:
        """Cancel every transfer (outcomes still arrive), then free the agent."""

        def teardown() -> None:
            if self._manager is not None:
                self._manager.close()
                self._publish()
            if self._backend is not None:
                self._backend.close()

        self._loop.stop(teardown, self.config.call_timeout_s)
