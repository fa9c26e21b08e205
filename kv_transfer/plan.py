"""Turn a `KVHandle` and the decode worker's destination blocks into a `TransferPlan`.

Coalescing: a descriptor covers a run of blocks whose ids are consecutive on both sides, so a
request whose blocks were allocated contiguously on both workers moves in one descriptor (each
descriptor has a fixed cost in NIXL; engine/kv/kv_cache.py says why a block is one contiguous
region), or in one per layer from a layer-major pool (`TransferPlan.num_segments`). Between
workers of several ranks (tensor-parallel, pipeline-parallel), `slice_reads` turns the layers
and heads each decode rank reads (kv_transfer/tp_plan.py) into byte ranges of a block: whole
segments (a whole block-first block, whole layers of a layer-major one) coalesce as above, a
range within a block-first block (a head range of a head-major block, a stage's layers of a
block-major one) is one descriptor per block. A handle may name blocks in more
than one region of its prefill agent (its KV pool, its host tier: `KVHandle.block_tiers`);
runs never cross regions, and the backend posts one read per region.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.tp_plan import HEAD_MAJOR, LAYER_MAJOR, HeadPlan, HeadSlice, LayerRange
from kv_transfer.types import DescriptorRun, SliceRead, TransferPlan
from vocabulary.kv_events import KVTier
from vocabulary.kv_handle import KVHandle


def coalesce_runs(
    remote_ids: Sequence[int], local_ids: Sequence[int], remote_tiers: Sequence[KVTier] = ()
) -> tuple[DescriptorRun, ...]:
    """Group `remote_ids[i] -> local_ids[i]` into maximal runs adjacent on both sides and
    within one peer region (`remote_tiers[i]`; empty: all in its KV pool)."""
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote ids but {len(local_ids)} local ids")
    tiers = remote_tiers or (KVTier.DEVICE,) * len(remote_ids)
    runs: list[DescriptorRun] = []
    start = 0
    for i in range(1, len(remote_ids) + 1):
        if (
            i == len(remote_ids)
            or remote_ids[i] != remote_ids[i - 1] + 1
            or local_ids[i] != local_ids[i - 1] + 1
            or tiers[i] is not tiers[i - 1]
        ):
            if i > start:
                run = DescriptorRun(remote_ids[start], local_ids[start], i - start, tiers[start])
                runs.append(run)
            start = i
    return tuple(runs)


def slice_reads(plan: HeadPlan, agents: Sequence[str], head_nbytes: int) -> tuple[SliceRead, ...]:
    """Every decode rank's reads of a hand-off planned as `plan` from a prefill worker whose
    rank r's agent is `agents[r]` (stage-major, rank 0 first), decode rank by rank, each by
    layer then head. `head_nbytes`: one KV head's part of a block of decode rank 0's pool
    (`KVCacheSpec.head_nbytes`: its stage's layers); one head's part of one layer is the same
    on both sides (the compatibility hash covers block size, head dim and dtype)."""
    if len(agents) != plan.prefill.num_ranks:
        raise ValueError(f"{len(agents)} prefill agents for {plan.prefill.ranks_text}")
    unit = head_nbytes // len(plan.stage_layers(plan.decode, 0))  # one head, one layer
    return tuple(
        SliceRead(d, agents[p], src, dst, nbytes, whole, segments)
        for d in range(plan.decode.num_ranks)
        for p, r, s in plan.pieces(d)
        for src, dst, nbytes, whole, segments in _ranges(plan, p, d, r, s, unit)
    )


def _ranges(
    plan: HeadPlan, p: int, d: int, r: LayerRange, s: HeadSlice, unit: int
) -> list[tuple[int, int, int, bool, int]]:
    """(src offset, dst offset, bytes, whole, segments) of the piece (r, s) of a block from
    prefill rank `p` to decode rank `d` (kv_transfer/tp_plan.py's table of regions)."""
    src_layers = plan.stage_layers(plan.prefill, plan.prefill.position(p)[0])
    dst_layers = plan.stage_layers(plan.decode, plan.decode.position(d)[0])
    src_l, dst_l = r.start - src_layers.start, r.start - dst_layers.start  # first layer, local
    n = r.num_layers
    if plan.decode.layout == HEAD_MAJOR:  # [heads, layers, 2, page, dim]
        lp, ld = len(src_layers), len(dst_layers)
        if plan.whole_layers(r):  # a head range is one region
            src, dst = s.src_head * lp * unit, s.dst_head * ld * unit
            return [(src, dst, s.num_heads * n * unit, plan.is_whole(s), 1)]
        return [  # part of each head's layers: one region per head
            (((s.src_head + i) * lp + src_l) * unit, ((s.dst_head + i) * ld + dst_l) * unit,
             n * unit, False, 1)
            for i in range(s.num_heads)
        ]  # fmt: skip
    layer = unit * plan.decode.local_heads  # every head of one layer (plan_split: whole heads)
    if plan.decode.layout == LAYER_MAJOR:  # a segment per layer
        return [(src_l * layer, dst_l * layer, n * layer, True, n)]
    return [(src_l * layer, dst_l * layer, n * layer, plan.whole_layers(r), 1)]  # block-major


def plan_transfer(
    handle: KVHandle,
    local_block_ids: Sequence[int],
    block_nbytes: int,
    num_reused: int = 0,
    slices: tuple[SliceRead, ...] = (),
    num_segments: int = 1,
) -> TransferPlan:
    """Plan the pull of `handle.block_ids[num_reused:]` into `local_block_ids`.

    `num_reused` leading blocks are already on the decode worker (found by hash); only full
    blocks can be reused, so it may not exceed `len(handle.block_hashes)`. `slices`: the
    decode ranks' reads between workers of several ranks (`slice_reads`); empty for whole
    blocks between two workers of one rank. `num_segments`: the pool's contiguous pieces of
    a block (`KVCacheSpec.num_segments`).
    """
    if not 0 <= num_reused <= len(handle.block_hashes):
        raise ValueError(
            f"num_reused={num_reused} must be within 0..{len(handle.block_hashes)} (full blocks)"
        )
    remote = tuple(handle.block_ids[num_reused:])
    tiers = tuple(handle.block_tiers[num_reused:])
    if all(t is KVTier.DEVICE for t in tiers):
        tiers = ()
    if tiers and slices:
        raise ValueError(
            f"request {handle.request_id}: host-tier blocks between workers of several ranks "
            "are not supported (a TP or PP worker hands off and reads KV pools only: give the "
            "prefill worker host_kv_handoff false)"
        )
    local = tuple(int(b) for b in local_block_ids)
    if len(local) != len(remote):
        raise ValueError(
            f"request {handle.request_id}: {len(remote)} blocks to pull "
            f"but {len(local)} destination blocks"
        )
    if len(set(local)) != len(local):
        raise ValueError(f"request {handle.request_id}: duplicate destination blocks")
    if min(local, default=0) < 0:
        raise ValueError(f"request {handle.request_id}: negative destination block id")
    return TransferPlan(
        request_id=handle.request_id,
        peer=handle.agent_name,
        remote_block_ids=remote,
        local_block_ids=local,
        num_reused=num_reused,
        runs=coalesce_runs(remote, local, tiers),
        block_nbytes=block_nbytes,
        slices=slices,
        remote_tiers=tiers,
        num_segments=num_segments,
    )
