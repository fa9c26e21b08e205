"""Prefill side of the KV hand-off: lease finished blocks until a decode worker pulled them.

A prefill worker's view of one request:

1. at start it publishes `handshake_info()` (the worker carries it to decode workers);
2. when a prompt is prefilled it calls `hand_off(...)`, which pins the blocks under a lease
   and returns the `KVHandle` that travels with the first token;
3. the worker keeps its own reference on those blocks (so its prefix cache cannot evict
   them) until `release_blocks(request_id, block_ids)` is called: exactly once per handle,
   on the endpoint's thread, when decode reports `done`, when decode gives up (`abort`),
   when the worker calls `cancel`, when the lease expires (the reaper runs on a timer), or
   when the endpoint closes.

Decode heartbeats extend leases of transfers still queued there. `release_blocks` must be
quick and must not wait on the endpoint: route it into the engine thread.

A worker with a host KV tier registers it too (`tiers`, one registration like the pool's),
and a hand-off may name blocks there (`block_tiers`: engine/core/handoffs.py lends the host-tier
copies of a prompt's blocks instead of device blocks): the decode worker reads them from host
memory, and the worker holds them pinned until `release_blocks`, exactly like pool blocks.

A worker of several ranks (tensor-parallel, pipeline-parallel, both): this endpoint is rank
0's (leases, notices); the other ranks' agents (`followers`, in rank order: stage-major,
kv_transfer/rank_endpoint.py) only expose their pools, and the handshake and every handle
list them, so a decode worker reads each rank's layers and heads. A pipeline-parallel worker
passes its stage bounds (`layer_bounds`) and, for an e4m3 pool, the model's scales
(`model_scales`): rank 0's pool spec names only stage 0's layers and scales.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from engine.kv.kv_cache import KVCache
from kv_transfer.agent_loop import AgentLoop
from kv_transfer.backend import BackendFactory, TransferBackend
from kv_transfer.config import KVTransferConfig
from kv_transfer.leases import Lease, LeaseStats, LeaseTable
from kv_transfer.protocol import (
    PROTOCOL_VERSION,
    HandshakeInfo,
    NoticeKind,
    RankAgent,
    decode_notice,
    new_agent_name,
)
from kv_transfer.types import compat_fields, compat_hash, kv_split
from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVTier
from vocabulary.kv_handle import KVHandle
from vocabulary.loop_progress import LoopProgress
from vocabulary.transfer_errors import BackendError, TransferError

log = logging.getLogger(__name__)

ReleaseBlocks = Callable[[str, tuple[int, ...]], None]


def _default_factory() -> BackendFactory:
    from kv_transfer.nixl_backend import nixl_backend_factory

    return nixl_backend_factory


class PrefillEndpoint:
    """Holds handed-off blocks under leases and serves them to decode peers."""

    def __init__(
        self,
        cache: KVCache,
        model_id: str,
        worker_id: str,
        release_blocks: ReleaseBlocks,
        config: KVTransferConfig | None = None,
        backend_factory: BackendFactory | None = None,
        clock: Callable[[], float] = time.time,
        followers: Sequence[RankAgent] = (),
        tiers: Mapping[KVTier, torch.Tensor] | None = None,
        layer_bounds: Sequence[int] = (),
        model_scales: Sequence[float] = (),
    ) -> None:
        """`followers`: the agents of ranks 1.. of a worker of several ranks, stage-major
        (this is rank 0). `tiers`: the worker's other KV tiers' blocks (its host tier's
        tensor, in the pool's layout), registered for decode workers to read hand-offs' blocks
        there (`hand_off`'s `block_tiers`). `layer_bounds`: the worker's stage bounds
        (`kv_split`; empty: one stage, or equal stages); `model_scales`: an e4m3 model's
        scales over every layer when `cache` is one stage's pool (`model_kv_scales`)."""
        self.cache = cache
        self.tiers = dict(tiers or {})
        self.followers = tuple(followers)
        self.split = kv_split(cache.spec, layer_bounds)
        if len(self.followers) + 1 != self.split.num_ranks:
            raise ValueError(
                f"{len(self.followers)} follower agents for a worker of {self.split.ranks_text}"
            )
        self.model_id = model_id
        self.worker_id = worker_id
        self.config = config or KVTransferConfig()
        self.compat_hash = compat_hash(cache.spec, model_id, model_scales)
        self.compat_fields = compat_fields(cache.spec, model_id, model_scales)
        self.agent_name = new_agent_name(worker_id, "prefill")
        self.leases = LeaseTable(self.config, clock)
        self.malformed_notices = 0
        self._release_blocks = release_blocks
        self._factory = backend_factory or _default_factory()
        self._clock = clock
        self._backend: TransferBackend | None = None
        self._handshake: HandshakeInfo | None = None
        self._next_reap = 0.0
        self._loop = AgentLoop(
            f"kv-prefill-{worker_id}",
            self._tick,
            self.config.idle_tick_s,
            has_work=lambda: len(self.leases) > 0,  # the table is thread-safe
        )

    def start(self) -> HandshakeInfo:
        """Create the agent, register the KV pool, and return the handshake to publish."""
        return self._loop.start(self._setup, self.config.call_timeout_s)

    def _setup(self) -> HandshakeInfo:
        self._backend = self._factory(self.agent_name, self.cache, self.config)
        # registered before the metadata is taken: it describes every registered region
        tier_regions = tuple(
            self._backend.register_tier(tensor, tier) for tier, tensor in self.tiers.items()
        )
        self._handshake = HandshakeInfo(
            protocol_version=PROTOCOL_VERSION,
            compat_hash=self.compat_hash,
            compat_fields=self.compat_fields,
            worker_id=self.worker_id,
            agent_name=self.agent_name,
            agent_metadata=self._backend.agent_metadata(),
            region=self._backend.memory_region(),
            split=self.split,
            followers=self.followers,
            tier_regions=tier_regions,
        )
        return self._handshake

    def handshake_info(self) -> HandshakeInfo:
        if self._handshake is None:
            raise TransferError("PrefillEndpoint.start() has not run")
        return self._handshake

    # ---- leases ---------------------------------------------------------------------------

    def hand_off(
        self,
        request_id: str,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        lease_s: float | None = None,
        block_tiers: Sequence[KVTier] = (),
    ) -> KVHandle:
        """Pin `block_ids` under a new lease and describe them for a decode worker.
        `block_tiers`: per block, the tier its id is in (empty: all in the KV pool); the
        worker holds host-tier blocks pinned there until `release_blocks`, like the pool's
        (the lease pins the pool's block ids)."""
        spec = self.cache.spec
        if self._handshake is None or not self._loop.running:
            raise TransferError("PrefillEndpoint is not running (start() not run, or closed)")
        tiers = tuple(block_tiers) or (KVTier.DEVICE,) * len(block_ids)
        if len(tiers) != len(block_ids):
            raise ValueError(f"request {request_id}: {len(tiers)} tiers, {len(block_ids)} blocks")
        sizes = {t: x.shape[spec.block_dim] for t, x in self.tiers.items()}  # the pool's layout
        sizes[KVTier.DEVICE] = spec.num_blocks
        if any(not 0 <= b < sizes.get(t, 0) for b, t in zip(block_ids, tiers, strict=True)):
            raise ValueError(f"request {request_id}: block id outside its tier's region")
        if len(block_ids) * spec.block_size < num_tokens:
            raise ValueError(
                f"request {request_id}: {len(block_ids)} blocks cannot hold {num_tokens} tokens"
            )
        pool_ids = [b for b, t in zip(block_ids, tiers, strict=True) if t is KVTier.DEVICE]
        lease = self.leases.grant(request_id, pool_ids, lease_s)
        self._loop.wake()
        return KVHandle(
            request_id=request_id,
            worker_id=self.worker_id,
            agent_name=self.agent_name,
            block_ids=tuple(int(b) for b in block_ids),
            block_tiers=tuple(block_tiers) if KVTier.HOST in tiers else (),
            block_hashes=tuple(block_hashes),
            num_tokens=num_tokens,
            lease_deadline=lease.deadline,
            compat_hash=self.compat_hash,
            rank_agents=(
                (self.agent_name, *(f.agent_name for f in self.followers)) if self.followers else ()
            ),
        )

    def cancel(self, request_id: str) -> None:
        """End a lease now (no decode will pull it); `release_blocks` follows on the thread.

        Only call this once no decode worker can still be reading the blocks (cancel the
        decode side first); otherwise let the lease expire.
        """

        def run() -> None:
            lease = self.leases.abort(request_id)
            if lease is not None:
                self._release(lease)

        self._loop.post(run)

    def is_pinned(self, block_id: int) -> bool:
        return self.leases.is_pinned(block_id)

    def pinned_block_ids(self) -> frozenset[int]:
        return self.leases.pinned_block_ids()

    def stats(self) -> LeaseStats:
        return self.leases.stats()

    def progress(self) -> LoopProgress:
        """The transfer thread's progress (for the worker's health check): work is pending
        while leases are held (their notices and the reaper need the thread)."""
        return self._loop.progress()

    # ---- loop -----------------------------------------------------------------------------

    def _tick(self) -> float:
        if self._backend is None:
            return self.config.idle_tick_s
        try:
            notifs = self._backend.get_notifs()
        except BackendError as e:
            log.warning("reading notices: %s", e)
            notifs = []
        for n in notifs:
            self._on_notice(n.message)
        now = self._clock()
        if now >= self._next_reap:
            self._next_reap = now + self.config.reaper_interval_s
            for lease in self.leases.reap():
                log.info("lease of %s expired; freeing its blocks", lease.request_id)
                self._release(lease)
        if len(self.leases):
            return min(self.config.notif_poll_s, self.config.reaper_interval_s)
        return self.config.idle_tick_s

    def _on_notice(self, message: bytes) -> None:
        notice = decode_notice(message)
        if notice is None:
            self.malformed_notices += 1
            return
        if notice.kind is NoticeKind.HEARTBEAT:
            self.leases.extend(notice.request_ids, notice.lease_deadline)
            return
        for rid in notice.request_ids:
            if notice.kind is NoticeKind.DONE:
                lease = self.leases.complete(rid)
            else:
                lease = self.leases.abort(rid)
            if lease is not None:
                self._release(lease)

    def _release(self, lease: Lease) -> None:
        try:
            self._release_blocks(lease.request_id, lease.block_ids)
        except Exception:
            log.exception("release_blocks failed for %s", lease.request_id)

    def close(self) -> None:
        """End every lease (`release_blocks` for each), then free the agent."""

        def teardown() -> None:
            for lease in self.leases.abort_all():
                self._release(lease)
            if self._backend is not None:
                self._backend.close()

        self._loop.stop(teardown, self.config.call_timeout_s)
