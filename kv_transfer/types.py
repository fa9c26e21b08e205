"""Values that cross the kv_transfer boundary (frozen; safe to pickle through Ray). The handle
they start from, `KVHandle`, and the load they report, `TransferLoad`, are in vocabulary/.

- `TransferPlan`: what a decode worker will pull for one handle (remote ids → local ids, after
  skipping the blocks it reuses, coalesced into descriptor runs; between workers of several
  ranks (TP, PP), which byte range of each block every decode rank reads from which prefill
  rank: `SliceRead`).
- `compat_hash`: the fingerprint of everything two pools must agree on to exchange blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kv_transfer.tp_plan import KVSplit
from vocabulary.kv_events import KVTier
from vocabulary.pipeline import stage_layer_bounds

if TYPE_CHECKING:  # engine.kv.kv_cache imports torch; the router imports this module without it
    from engine.kv.kv_cache import KVCacheSpec


def compat_fields(spec: KVCacheSpec, model_id: str, model_scales: Sequence[float] = ()) -> str:
    """The human-readable text that `compat_hash` hashes: `key=value` pairs joined by `;`.

    The pool's `num_blocks` is not part of it: two workers may have pools of any size. Nor is
    how a worker splits the model over its ranks: `num_kv_heads` and `num_layers` are the
    model's (every rank's, every stage's), and which heads and layers a rank holds is the
    handshake's `KVSplit`, which both sides check against a plan of the pulls
    (kv_transfer/tp_plan.py), so workers of different TP or PP sizes may exchange blocks. An
    e4m3 pool's scales are the model's (`model_kv_scales`: every stage's), so a pipeline
    stage's pool and a one-stage pool of the same model agree exactly when every layer's
    scales do. A pool of one rank hashes as it did before tensor and pipeline parallelism. The
    weight format of the model (fp8, int8, int4) is named when the weights are quantized: a
    prefill and a decode worker on different formats compute different K and V, and refuse
    each other; a pool of a dense model hashes as it did before quantized formats.
    """
    scales = model_kv_scales(spec, model_scales)
    return ";".join(
        [
            f"model={model_id}",
            f"dtype={spec.dtype}",
            f"layout={spec.layout}",
            f"block_size={spec.block_size}",
            f"num_layers={spec.total_layers}",
            f"num_kv_heads={spec.total_kv_heads}",
            f"head_dim={spec.head_dim}",
            *([f"kv_scales={_digest(scales)}"] if scales else []),
            *([f"weights={spec.weights}"] if spec.weights != "none" else []),
        ]
    )


def model_kv_scales(spec: KVCacheSpec, model_scales: Sequence[float] = ()) -> tuple[float, ...]:
    """The e4m3 scales of the whole model (k0, v0, k1, v1, ... over every layer) whose rank's
    pool is `spec`: its own `scales` when it holds every layer; for a pipeline stage's pool
    (which holds only its layers' scales), `model_scales`, every stage's in layer order, which
    the worker assembles and must agree with the stage's own. Empty for a float pool."""
    given = tuple(float(x) for x in model_scales)
    if not spec.scales:
        if given:
            raise ValueError(f"a {spec.dtype} KV pool has no scales, {len(given)} given")
        return ()
    if spec.num_layers == spec.total_layers:
        if given and given != spec.scales:
            raise ValueError("the model's KV scales differ from the pool's own (every layer)")
        return spec.scales
    start, stop = 2 * spec.layer_start, 2 * (spec.layer_start + spec.num_layers)
    if not given:
        raise ValueError(
            f"an e4m3 pool of pipeline stage {spec.pp_rank} holds only layers "
            f"[{spec.layer_start}, {spec.layer_start + spec.num_layers})'s scales: pass the "
            f"model's (every stage's, {2 * spec.total_layers} in layer order)"
        )
    if len(given) != 2 * spec.total_layers or given[start:stop] != spec.scales:
        raise ValueError(
            f"{len(given)} model KV scales: need {2 * spec.total_layers}, with stage "
            f"{spec.pp_rank}'s own at [{start}, {stop})"
        )
    return given


def kv_split(spec: KVCacheSpec, layer_bounds: Sequence[int] = ()) -> KVSplit:
    """How a worker holds the model's KV, from any of its ranks' pool `spec` and the worker's
    stage bounds (vocabulary/pipeline.py `stage_layer_bounds`; a spec alone names only its
    own stage's layers). `layer_bounds` empty: one stage, or equal stages (`pp_size` dividing
    the model's layers); a worker cut by a layer partition passes its bounds. Every rank of a
    worker yields the same split; raises ValueError when `spec` is not a stage of the bounds."""
    if spec.pp_size == 1:
        bounds: tuple[int, ...] = tuple(layer_bounds) or (0, spec.total_layers)
    else:
        bounds = tuple(layer_bounds) or stage_layer_bounds(spec.total_layers, spec.pp_size)
    stage = (spec.layer_start, spec.layer_start + spec.num_layers)
    if (
        len(bounds) != spec.pp_size + 1
        or bounds[-1] != spec.total_layers
        or bounds[spec.pp_rank : spec.pp_rank + 2] != stage
    ):
        raise ValueError(
            f"stage bounds {','.join(map(str, bounds))}: the pool of stage {spec.pp_rank} of "
            f"{spec.pp_size} holds layers [{stage[0]}, {stage[1]}) of {spec.total_layers} "
            "(pass the worker's layer bounds)"
        )
    return KVSplit(spec.tp_size, spec.total_kv_heads, spec.layout, spec.total_layers, bounds)


def _digest(scales: tuple[float, ...]) -> str:
    """12 hex digits over an e4m3 pool's scales (their exact float64 bits)."""
    return hashlib.sha256(struct.pack(f"<{len(scales)}d", *scales)).hexdigest()[:12]


def compat_hash(spec: KVCacheSpec, model_id: str, model_scales: Sequence[float] = ()) -> str:
    """32 hex digits over model, dtype, layout, block size, the model's layers and KV heads,
    head dim, an e4m3 model's scales (`model_kv_scales`) and a quantized model's weight
    format."""
    return hashlib.sha256(compat_fields(spec, model_id, model_scales).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SliceRead:
    """One decode rank's read, for every block of a plan, of `nbytes` at `src_offset` in the
    block of prefill agent `peer` into `dst_offset` of its own block (kv_transfer/tp_plan.py
    says which layers and heads that is). Offsets count a block's bytes segment after segment
    (a layer-major block's layer l at l x its segment's bytes, kv_transfer/backend.py
    `MemoryRegion`). `whole`: the range is whole segments on both sides (the whole block of a
    block-first pool, `num_segments` whole layers of a layer-major one), read through the
    blocks' own descriptors, so blocks adjacent on both sides share one per segment
    (`TransferPlan.runs`); a range within a block-first block is one descriptor per block."""

    decode_rank: int
    peer: str
    src_offset: int
    dst_offset: int
    nbytes: int
    whole: bool
    num_segments: int = 1
    """Segments of a block the range covers (a `whole` read posts one descriptor per segment
    and run of blocks); 1 in a block-first pool."""


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
    Otherwise every read of every decode rank (pipeline stages and TP ranks), over the same
    block ids (`SliceRead`); `peer` stays the prefill worker's rank 0 agent (its lease,
    notices and budget).
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
        if self.slices:  # (a partial slice is within a block-first block: one segment)
            runs = len(self.runs)
            return sum(runs * s.num_segments if s.whole else self.num_blocks for s in self.slices)
        return len(self.runs) * self.num_segments

    def for_rank(self, rank: int) -> TransferPlan:
        """The part of this plan decode rank `rank` reads (its slices only)."""
        return replace(self, slices=tuple(s for s in self.slices if s.decode_rank == rank))
