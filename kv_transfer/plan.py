"""Turn a `KVHandle` and the decode worker's destination blocks into a `TransferPlan`.

Coalescing: a descriptor covers a run of blocks whose ids are consecutive on both sides, so a
request whose blocks were allocated contiguously on both workers moves in one descriptor (each
descriptor has a fixed cost in NIXL; engine/kv/kv_cache.py says why a block is one contiguous
region), or in one per layer from a layer-major pool (`TransferPlan.num_segments`). Between
tensor-parallel workers, `slice_reads` turns the heads each decode rank reads
(kv_transfer/tp_plan.py) into byte ranges of a block: a whole block coalesces as above, a head
range of a head-major block is one descriptor per block. A handle may name blocks in more
than one region of its prefill agent (its KV pool, its host tier: `KVHandle.block_tiers`);
runs never cross regions, and the backend posts one read per region.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_transfer.tp_plan import HeadPlan
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
    rank r's agent is `agents[r]`; `head_nbytes`: one KV head's part of a block (the same on
    both sides: the compatibility hash covers layers, block size, head dim and dtype)."""
    if len(agents) != plan.prefill.tp_size:
        raise ValueError(f"{len(agents)} prefill agents for TP size {plan.prefill.tp_size}")
    return tuple(
        SliceRead(
            decode_rank=d,
            peer=agents[s.prefill_rank],
            src_offset=s.src_head * head_nbytes,
            dst_offset=s.dst_head * head_nbytes,
            nbytes=s.num_heads * head_nbytes,
            whole=plan.is_whole(s),
        )
        for d, rank_reads in enumerate(plan.reads)
        for s in rank_reads
    )


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
    decode ranks' reads between tensor-parallel workers (`slice_reads`); empty for whole
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
            f"request {handle.request_id}: host-tier blocks between tensor-parallel workers "
            "are not supported (a TP worker has no host tier)"
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
