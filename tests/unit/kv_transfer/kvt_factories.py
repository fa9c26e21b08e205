"""TEST-ONLY loopback transfer backend and small factories for kv_transfer unit tests.

`LoopbackBackend` implements `kv_transfer.backend.TransferBackend` inside one process: a
`LoopbackFabric` connects named agents; a read copies blocks between their `KVCache`
tensors, at once (`auto_complete`) or when the test calls `fabric.complete(request_id)`.
Faults are switches on the fabric (fail, drop notices, refuse aborts, kill an agent, make one
backend call raise an unexpected exception). It is not part of the kv_transfer package and
never used in production.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.kv_cache import KVCache, KVCacheSpec, block_segments
from kv_transfer.backend import (
    BackendFactory,
    MemoryRegion,
    Notification,
    XferId,
    XferStatus,
    kv_region,
)
from kv_transfer.config import KVTransferConfig
from kv_transfer.types import SliceRead, TransferPlan, compat_hash
from vocabulary.block_hash import BlockHash
from vocabulary.kv_events import KVTier
from vocabulary.kv_handle import KVHandle
from vocabulary.transfer_errors import BackendError

MODEL = "tiny-test"
SPEC = KVCacheSpec(
    num_blocks=64, num_layers=1, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32"
)
COMPAT = compat_hash(SPEC, MODEL)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Read:
    plan: TransferPlan
    notif: bytes
    source: LoopbackBackend
    status: XferStatus = XferStatus.IN_PROGRESS


@dataclass
class LoopbackFabric:
    """The in-process network of loopback agents, with fault switches."""

    auto_complete: bool = True
    drop_notifs: bool = False  # completion notices of reads are lost
    abort_fails: bool = False  # abort() reports the read still running
    agents: dict[str, LoopbackBackend] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    raises: dict[tuple[str, str], Exception] = field(default_factory=dict)
    """(backend method, request id) → what that call raises, once (see `raise_once`)."""

    def kill(self, agent_name: str) -> None:
        self.dead.add(agent_name)

    def raise_once(self, method: str, request_id: str, error: Exception) -> None:
        """The next `method` call (start_read, poll, descriptor_count, release, abort) for
        `request_id` raises `error` before doing anything: a backend bug, not a BackendError."""
        self.raises[(method, request_id)] = error

    def trip(self, method: str, request_id: str) -> None:
        error = self.raises.pop((method, request_id), None)
        if error is not None:
            raise error

    def _reads(self) -> list[tuple[LoopbackBackend, XferId, _Read]]:
        return [(a, x, r) for a in self.agents.values() for x, r in a.reads.items()]

    def complete(self, request_id: str) -> bool:
        """Finish the read of `request_id` (False if no such read is live: a late completion)."""
        for agent, _, read in self._reads():
            if read.plan.request_id == request_id and read.status is XferStatus.IN_PROGRESS:
                agent.finish(read)
                return True
        return False

    def fail(self, request_id: str) -> None:
        for _, _, read in self._reads():
            if read.plan.request_id == request_id:
                read.status = XferStatus.FAILED


class LoopbackBackend:
    """TEST-ONLY `TransferBackend` over the `LoopbackFabric` (see module docstring)."""

    def __init__(self, fabric: LoopbackFabric, agent_name: str, cache: KVCache) -> None:
        self.fabric = fabric
        self.agent_name = agent_name
        self.cache = cache
        self.peers: set[str] = set()
        self.reads: dict[XferId, _Read] = {}
        self.inbox: list[Notification] = []
        self.sent: list[tuple[str, bytes]] = []
        self.tiers: dict[KVTier, torch.Tensor] = {}  # registered other tiers (register_tier)
        self.peer_tiers: dict[str, tuple[KVTier, ...]] = {}
        self._next = 0
        fabric.agents[agent_name] = self

    def agent_metadata(self) -> bytes:
        return self.agent_name.encode()

    def memory_region(self) -> MemoryRegion:
        return kv_region(self.cache.tensor, self.cache.spec.block_dim)

    def register_tier(self, tensor: torch.Tensor, tier: KVTier) -> MemoryRegion:
        self.tiers[tier] = tensor
        return kv_region(tensor, self.cache.spec.block_dim, tier)

    def add_peer(
        self,
        agent_name: str,
        agent_metadata: bytes,
        region: MemoryRegion,
        tier_regions: Sequence[MemoryRegion] = (),
    ) -> None:
        if agent_name not in self.fabric.agents or agent_name in self.fabric.dead:
            raise BackendError(f"no agent {agent_name}", peer_lost=True)
        self.peers.add(agent_name)
        self.peer_tiers[agent_name] = tuple(r.tier for r in tier_regions)

    def remove_peer(self, agent_name: str) -> None:
        self.peers.discard(agent_name)

    def _check_alive(self, agent_name: str) -> None:
        if agent_name in self.fabric.dead:
            raise BackendError(f"{agent_name} disconnected", peer_lost=True)

    def start_read(self, plan: TransferPlan, notif: bytes) -> XferId:
        self.fabric.trip("start_read", plan.request_id)
        for agent in {plan.peer, *(s.peer for s in plan.slices)}:
            self._check_alive(agent)
            if agent not in self.peers:
                raise BackendError(f"no handshake with {agent}")
        missing = set(plan.remote_tiers) - {KVTier.DEVICE, *self.peer_tiers.get(plan.peer, ())}
        if missing:
            raise BackendError(f"{plan.peer} registered no {sorted(t.value for t in missing)}")
        self._next += 1
        read = _Read(plan, notif, self.fabric.agents[plan.peer])
        self.reads[self._next] = read
        if self.fabric.auto_complete:
            self.finish(read)
        return self._next

    def finish(self, read: _Read) -> None:
        p = read.plan
        if p.slices:  # byte ranges of every block, each from its own agent
            for s in p.slices:
                copy_range(self.fabric.agents[s.peer].cache, self.cache, p, s)
        else:
            for tier, part in p.by_tier():  # from each region of the peer its blocks are in
                src, dst = list(part.remote_block_ids), list(part.local_block_ids)
                if tier is KVTier.DEVICE:
                    self.cache.copy_blocks_from(read.source.cache, src, dst)
                else:
                    self.cache.tensor[dst] = read.source.tiers[tier][src]
        read.status = XferStatus.DONE
        if read.notif and not self.fabric.drop_notifs:
            read.source.inbox.append(Notification(self.agent_name, read.notif))

    def poll(self, xfer: XferId) -> XferStatus:
        read = self.reads[xfer]
        self.fabric.trip("poll", read.plan.request_id)
        if read.status is XferStatus.IN_PROGRESS:
            self._check_alive(read.plan.peer)
        return read.status

    def descriptor_count(self, xfer: XferId) -> int | None:
        self.fabric.trip("descriptor_count", self.reads[xfer].plan.request_id)
        return len(self.reads[xfer].plan.runs)

    def release(self, xfer: XferId) -> None:
        self.fabric.trip("release", self.reads[xfer].plan.request_id)
        del self.reads[xfer]

    def abort(self, xfer: XferId) -> bool:
        if xfer in self.reads:
            self.fabric.trip("abort", self.reads[xfer].plan.request_id)
        if self.fabric.abort_fails:
            return False
        self.reads.pop(xfer, None)
        return True

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self._check_alive(agent_name)
        self.sent.append((agent_name, message))
        self.fabric.agents[agent_name].inbox.append(Notification(self.agent_name, message))

    def get_notifs(self) -> list[Notification]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        self.fabric.agents.pop(self.agent_name, None)


def segment_bytes(cache: KVCache) -> torch.Tensor:
    """The pool as [segments, num_blocks, segment bytes] (a view; one segment a block in a
    block-first pool, one per layer in a layer-major one)."""
    return block_segments(cache.tensor.view(torch.uint8), cache.spec.block_dim)


def copy_range(src: KVCache, dst: KVCache, plan: TransferPlan, s: SliceRead) -> None:
    """What a `SliceRead` of `plan` moves: bytes of every remote block into the local one
    (offsets count a block's bytes segment after segment; a range of several segments is
    whole segments on both sides)."""
    remote = torch.tensor(plan.remote_block_ids, dtype=torch.long)
    local = torch.tensor(plan.local_block_ids, dtype=torch.long)
    a, b = segment_bytes(src), segment_bytes(dst)
    seg = a.shape[2]
    if s.src_offset % seg + s.nbytes <= seg:  # within one segment of each side
        i, j = s.src_offset // seg, s.dst_offset // b.shape[2]
        src_at, dst_at = s.src_offset % seg, s.dst_offset % b.shape[2]
        b[j, local, dst_at : dst_at + s.nbytes] = a[i, remote, src_at : src_at + s.nbytes]
        return
    assert s.whole and seg == b.shape[2] and not (s.src_offset | s.dst_offset | s.nbytes) % seg
    for k in range(s.nbytes // seg):
        b[s.dst_offset // seg + k, local] = a[s.src_offset // seg + k, remote]


def loopback_factory(fabric: LoopbackFabric, name: str | None = None) -> BackendFactory:
    """A `BackendFactory` building loopback agents on `fabric` (optionally renamed)."""

    def factory(agent_name: str, cache: KVCache, config: KVTransferConfig) -> LoopbackBackend:
        return LoopbackBackend(fabric, name or agent_name, cache)

    return factory


def filled_cache(seed: int = 0, spec: KVCacheSpec = SPEC) -> KVCache:
    """A cache whose block b holds values seed*1e6 + b*1e3 + offset (every block distinct)."""
    cache = KVCache(spec)
    per_block = cache.tensor[0].numel()
    values = torch.arange(spec.num_blocks * per_block, dtype=torch.float32)
    blocks = values.reshape(spec.num_blocks, per_block) // per_block
    offsets = values.reshape(spec.num_blocks, per_block) % per_block
    cache.tensor.copy_((seed * 1e6 + blocks * 1e3 + offsets).reshape(spec.shape))
    return cache


def make_handle(
    request_id: str,
    block_ids: tuple[int, ...],
    lease_deadline: float,
    agent_name: str = "P",
    compat: str = COMPAT,
    num_hashed: int | None = None,
) -> KVHandle:
    n = len(block_ids) if num_hashed is None else num_hashed
    hashes = tuple(BlockHash(bytes([i]) * 16) for i in range(n))
    return KVHandle(
        request_id=request_id,
        worker_id="prefill-0",
        agent_name=agent_name,
        block_ids=block_ids,
        block_hashes=hashes,
        num_tokens=len(block_ids) * SPEC.block_size,
        lease_deadline=lease_deadline,
        compat_hash=compat,
    )
