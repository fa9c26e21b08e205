"""Values that cross the kv_transfer boundary (frozen; safe to pickle through Ray). The handle
they start from, `KVHandle`, and the load they report, `TransferLoad`, are in vocabulary/.

- `TransferPlan`: what a decode worker will pull for one handle (remote ids → local ids, after
  skipping the blocks it reuses, coalesced into descriptor runs; between TP workers, which
  byte range of each block every decode rank reads from which prefill rank: `SliceRead`).
- `compat_hash`: the fingerprint of everything two pools must agree on to exchange blocks.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kv_transfer.tp_plan import KVSplit
from vocabulary.kv_events import KVTier

if TYPE_CHECKING:  # engine.kv.kv_cache imports torch; the router imports this module without it
    from engine.kv.kv_cache import KVCacheSpec


def compat_fields(spec: KVCacheSpec, model_id: str) -> str:
    """The human-readable text that `compat_hash` hashes: `key=value` pairs joined by `;`.

    The pool's `num_blocks` is not part of it: two workers may have pools of any size. Nor is
    the tensor-parallel split: `num_kv_heads` is the model's (every rank's), and which heads
    a rank holds is the handshake's `KVSplit`, which both sides check against a plan of the
    pulls (kv_transfer/tp_plan.py), so pools of different TP sizes may exchange blocks. A pool
    of one rank hashes as it did before tensor parallelism. The weight format of the model
    (fp8, int8, int4) is named when the weights are quantized: a prefill and a decode worker
    on different formats compute different K and V, and refuse each other; a pool of a dense
    model hashes as it did before quantized formats.
    """
    return ";".join(
        [
            f"model={model_id}",
            f"dtype={spec.dtype}",
            f"layout={spec.layout}",
            f"block_size={spec.block_size}",
            f"num_layers={spec.num_layers}",
            f"num_kv_heads={spec.total_kv_heads}",
            f"head_dim={spec.head_dim}",
            *([f"kv_scales={_digest(spec.scales)}"] if spec.scales else []),
            *([f"weights={spec.weights}"] if spec.weights != "none" else []),
        ]
    )


def kv_split(spec: KVCacheSpec) -> KVSplit:
    """How a worker whose rank pools are specified as `spec` holds the model's KV heads."""
    return KVSplit(spec.tp_size, spec.total_kv_heads, spec.layout)


def _digest(scales: tuple[float, ...]) -> str:
    """12 hex digits over an e4m3 pool's scales (their exact float64 bits)."""
    return hashlib.sha256(struct.pack(f"<{len(scales)}d", *scales)).hexdigest()[:12]


def compat_hash(spec: KVCacheSpec, model_id: str) -> str:
    """32 hex digits over model, dtype, layout, block size, layers, the model's KV heads,
    head dim, an e4m3 pool's scales and a quantized model's weight format."""
    return hashlib.sha256(compat_fields(spec, model_id).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SliceRead:
    """One decode rank's read, for every block of a plan, of `nbytes` at `src_offset` in the
    block of prefill agent `peer` into `dst_offset` of its own block (kv_transfer/tp_plan.py
    says which heads that is). `whole`: the range is the whole block on both sides, so
    blocks adjacent on both sides share a descriptor (`TransferPlan.runs`); a partial range
    is one descriptor per block."""

    decode_rank: int
    peer: str
    src_offset: int
    dst_offset: int
    nbytes: int
    whole: bool


@dataclass(frozen=True)
class DescriptorRun:
    """`num_blocks` consecutive blocks on both sides (in one peer region): one descriptor."""

    remote_start: int
    local_start: int
    num_blocks: int
    remote_tier: KVTier = KVTier.DEVICE


@dataclass(frozen=True)
class TransferPlan:
    """What a decode endpoint pulls for one handle.

    `remote_block_ids[i]` is read into `local_block_ids[i]`; the first `num_reused` blocks of
    the handle are not transferred (the decode worker already holds them). `runs` is the same
    mapping coalesced into descriptors: adjacent ids on both sides share one descriptor.

    `slices` empty: whole blocks of `peer` into this worker's one pool (both of one rank).
    Otherwise every read of every decode rank, over the same block ids (`SliceRead`); `peer`
    stays the prefill worker's rank 0 agent (its lease, notices and budget).
    """

    request_id: str
    peer: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_reused: int
    runs: tuple[DescriptorRun, ...]
    block_nbytes: int
    slices: tuple[SliceRead, ...] = ()
    remote_tiers: tuple[KVTier, ...] = ()
    """Per remote block, the region of the peer it is read from (the handle's
    `block_tiers`); empty: all from its KV pool. `runs` never cross from one to another."""
    num_segments: int = 1
    """Contiguous pieces of a block on both sides (one per layer in a layer-major pool,
    kv_transfer/backend.py `MemoryRegion`): a run is posted as one descriptor per segment."""

    @property
    def num_blocks(self) -> int:
        return len(self.remote_block_ids)

    def by_tier(self) -> tuple[tuple[KVTier, TransferPlan], ...]:
        """The plan split by the peer region its blocks are read from (one read each)."""
        if not self.remote_tiers or len(set(self.remote_tiers)) == 1:
            tier = self.remote_tiers[0] if self.remote_tiers else KVTier.DEVICE
            return ((tier, replace(self, remote_tiers=())),)
        parts = []
        for tier in sorted(set(self.remote_tiers), key=lambda t: t.value):
            pairs = [
                (r, loc)
                for r, loc, t in zip(
                    self.remote_block_ids, self.local_block_ids, self.remote_tiers, strict=True
                )
                if t is tier
            ]
            remote, local = (tuple(x) for x in zip(*pairs, strict=True))
            runs = tuple(r for r in self.runs if r.remote_tier is tier)
            part = replace(self, remote_block_ids=remote, local_block_ids=local, runs=runs,
                           remote_tiers=())  # fmt: skip
            parts.append((tier, part))
        return tuple(parts)

    @property
    def nbytes(self) -> int:
        """Bytes read, over every decode rank."""
        if self.slices:
            return self.num_blocks * sum(s.nbytes for s in self.slices)
        return self.num_blocks * self.block_nbytes

    @property
    def num_descriptors(self) -> int:
        """Descriptors posted, over every decode rank."""
        runs = len(self.runs) * self.num_segments
        if self.slices:  # (a partial slice is of a head-major block: one segment)
            return sum(runs if s.whole else self.num_blocks for s in self.slices)
        return runs

    def for_rank(self, rank: int) -> TransferPlan:
        """The part of this plan decode rank `rank` reads (its slices only)."""
        return replace(self, slices=tuple(s for s in self.slices if s.decode_rank == rank))
