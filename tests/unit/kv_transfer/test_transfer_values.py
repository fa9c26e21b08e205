"""Pure values of kv_transfer: plans and coalescing, compat hash, handshake check, notices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvt_factories import COMPAT, MODEL, SPEC, make_handle

from engine.kv.kv_cache import BLOCK_MAJOR, HEAD_MAJOR, LAYER_MAJOR, KVCache, KVCacheSpec
from kv_transfer.backend import MemoryRegion, kv_region
from kv_transfer.plan import coalesce_runs, plan_transfer
from kv_transfer.protocol import (
    MAX_IDS_PER_HEARTBEAT,
    PROTOCOL_VERSION,
    HandshakeInfo,
    Notice,
    NoticeKind,
    check_handshake,
    decode_notice,
    encode_abort,
    encode_done,
    encode_heartbeats,
)
from kv_transfer.tp_plan import KVSplit
from kv_transfer.types import DescriptorRun, compat_fields, compat_hash, kv_split
from prefix_index.types import PrefixMatch, WorkerPrefix
from vocabulary.kv_events import KVTier
from vocabulary.transfer_errors import HandshakeError


def test_coalesce_runs_merges_blocks_adjacent_on_both_sides() -> None:
    runs = coalesce_runs([3, 4, 5, 9, 10, 11, 20], [10, 11, 12, 20, 22, 23, 5])
    assert runs == (
        DescriptorRun(3, 10, 3),
        DescriptorRun(9, 20, 1),
        DescriptorRun(10, 22, 2),
        DescriptorRun(20, 5, 1),
    )
    assert coalesce_runs([], []) == ()
    assert coalesce_runs([7, 6], [1, 2]) == (DescriptorRun(7, 1, 1), DescriptorRun(6, 2, 1))


def test_plan_skips_reused_blocks_and_maps_the_rest_in_order() -> None:
    handle = make_handle("r", (8, 9, 10, 11, 30), lease_deadline=0.0, num_hashed=4)
    plan = plan_transfer(handle, [40, 41, 2], SPEC.block_nbytes, num_reused=2)
    assert plan.remote_block_ids == (10, 11, 30) and plan.local_block_ids == (40, 41, 2)
    assert plan.runs == (DescriptorRun(10, 40, 2), DescriptorRun(30, 2, 1))
    assert (plan.num_blocks, plan.num_descriptors, plan.num_reused) == (3, 2, 2)
    assert plan.nbytes == 3 * SPEC.block_nbytes and plan.peer == "P"


@pytest.mark.parametrize(
    ("local", "reused", "message"),
    [
        ([1, 2], 0, "3 blocks to pull but 2"),
        ([1, 1, 2], 0, "duplicate"),
        ([-1, 2, 3], 0, "negative"),
        ([1, 2], 3, "num_reused=3"),  # the last block is partial: never reusable
    ],
)
def test_plan_rejects_inconsistent_inputs(local: list[int], reused: int, message: str) -> None:
    handle = make_handle("r", (1, 2, 3), lease_deadline=0.0, num_hashed=2)
    with pytest.raises(ValueError, match=message):
        plan_transfer(handle, local, SPEC.block_nbytes, num_reused=reused)


def test_handle_rejects_more_hashes_than_blocks_and_duplicate_blocks() -> None:
    with pytest.raises(ValueError, match="hashes"):
        make_handle("r", (1, 2), lease_deadline=0.0, num_hashed=3)
    with pytest.raises(ValueError, match="duplicates"):
        make_handle("r", (1, 1), lease_deadline=0.0)


def test_compat_hash_covers_layout_fields_but_not_pool_size() -> None:
    assert compat_hash(SPEC, MODEL) == COMPAT and len(COMPAT) == 32
    assert compat_hash(dataclasses.replace(SPEC, num_blocks=999), MODEL) == COMPAT
    changed = [
        dataclasses.replace(SPEC, dtype="bfloat16"),
        dataclasses.replace(SPEC, block_size=8),
        dataclasses.replace(SPEC, num_layers=2),
        dataclasses.replace(SPEC, num_kv_heads=2),
        dataclasses.replace(SPEC, head_dim=8),
        dataclasses.replace(SPEC, layout=HEAD_MAJOR),
        dataclasses.replace(SPEC, layout=LAYER_MAJOR),
    ]
    hashes = {compat_hash(s, MODEL) for s in changed} | {compat_hash(SPEC, "other-model")}
    assert len(hashes) == 8 and COMPAT not in hashes


def _info(
    spec: KVCacheSpec = SPEC,
    version: int = PROTOCOL_VERSION,
    block_nbytes: int = 0,
    num_segments: int | None = None,
    tier_segments: int | None = None,
) -> HandshakeInfo:
    """A peer's handshake over a pool of `spec` (its regions of `spec.num_segments` segments
    unless given), with a host tier region when `tier_segments` is."""
    segments = spec.num_segments if num_segments is None else num_segments
    nbytes = block_nbytes or spec.block_nbytes
    region = MemoryRegion("DRAM", 0, 4096, nbytes, spec.num_blocks, num_segments=segments)
    tiers = (
        ()
        if tier_segments is None
        else (MemoryRegion("DRAM", 0, 1 << 20, nbytes, 8, KVTier.HOST, tier_segments),)
    )
    return HandshakeInfo(
        protocol_version=version,
        compat_hash=compat_hash(spec, MODEL),
        compat_fields=compat_fields(spec, MODEL),
        worker_id="p0",
        agent_name="P",
        agent_metadata=b"md",
        region=region,
        split=kv_split(spec),
        tier_regions=tiers,
    )


def test_handshake_accepts_an_equal_peer_and_names_what_differs_otherwise() -> None:
    fields = compat_fields(SPEC, MODEL)
    mine = (COMPAT, fields, kv_split(SPEC), SPEC.head_nbytes, SPEC.num_segments)
    check_handshake(_info(), *mine)
    other = dataclasses.replace(SPEC, block_size=8, dtype="bfloat16")
    with pytest.raises(HandshakeError) as err:
        check_handshake(_info(other), *mine)
    assert "block_size: peer 8 vs local 4" in str(err.value)
    assert "dtype: peer bfloat16 vs local float32" in str(err.value)
    with pytest.raises(HandshakeError, match="protocol v99, this worker v1"):
        check_handshake(_info(version=99), *mine)
    with pytest.raises(HandshakeError, match="block of 7 bytes"):
        check_handshake(_info(block_nbytes=7), *mine)


def _local(spec: KVCacheSpec) -> tuple[str, str, KVSplit, int, int]:
    """What `check_handshake` takes of a local pool of `spec`."""
    fields = compat_fields(spec, MODEL)
    return compat_hash(spec, MODEL), fields, kv_split(spec), spec.head_nbytes, spec.num_segments


def test_the_handshake_refuses_a_layer_major_peer_of_a_block_major_worker_and_vice_versa() -> None:
    layer = dataclasses.replace(SPEC, num_layers=3, layout=LAYER_MAJOR)
    block = dataclasses.replace(layer, layout=BLOCK_MAJOR)
    for peer, local in ((layer, block), (block, layer)):
        with pytest.raises(HandshakeError) as err:
            check_handshake(_info(peer), *_local(local))
        message = str(err.value)
        assert f"prefill TP=1 over 1 KV heads, {peer.layout} → decode" in message
        assert f"{local.layout}: the KV layouts differ" in message
    check_handshake(_info(layer, tier_segments=3), *_local(layer))  # 3 segments everywhere


def test_the_handshake_refuses_regions_whose_blocks_have_other_segments_than_the_pool() -> None:
    layer = dataclasses.replace(SPEC, num_layers=3, layout=LAYER_MAJOR)
    with pytest.raises(HandshakeError, match=r"rank 0's block is 1 segment\(s\), 3 here"):
        check_handshake(_info(layer, num_segments=1), *_local(layer))
    with pytest.raises(HandshakeError, match=r"host tier region's block is 1 segment\(s\), 3"):
        check_handshake(_info(layer, tier_segments=1), *_local(layer))


def test_a_kv_region_has_one_segment_a_block_first_block_or_one_per_layer() -> None:
    block_first = KVCache(dataclasses.replace(SPEC, num_layers=3, layout=HEAD_MAJOR))
    spec = block_first.spec
    base = block_first.tensor.data_ptr()
    # a block-first pool's region is what it was before segments: block b at b * block_nbytes
    region = kv_region(block_first.tensor, spec.block_dim)
    assert region == MemoryRegion("DRAM", 0, base, spec.block_nbytes, spec.num_blocks)
    assert (region.num_segments, region.segment_stride, region.segment_nbytes) == (
        1, 0, spec.block_nbytes
    )  # fmt: skip
    layer_major = KVCache(dataclasses.replace(spec, layout=LAYER_MAJOR))
    host = torch.zeros((3, 8, *layer_major.tensor.shape[2:]))  # a host tier of 8 blocks
    pool = kv_region(layer_major.tensor, 1)
    tier = kv_region(host, 1, KVTier.HOST)
    seg = spec.block_nbytes // 3
    assert (pool.num_blocks, pool.num_segments, pool.segment_nbytes) == (64, 3, seg)
    assert (pool.block_nbytes, pool.segment_stride) == (spec.block_nbytes, 64 * seg)
    assert (tier.tier, tier.num_blocks, tier.segment_stride, tier.block_nbytes) == (
        KVTier.HOST, 8, 8 * seg, spec.block_nbytes
    )  # fmt: skip
    with pytest.raises(ValueError, match="one contiguous tensor"):
        kv_region(layer_major.tensor.transpose(0, 1), 0)
    with pytest.raises(ValueError, match="a block of 7 bytes in 2 segments"):
        MemoryRegion("DRAM", 0, base, 7, 4, num_segments=2)


def test_a_layer_major_plan_posts_each_run_once_per_layer() -> None:
    handle = make_handle("r", (8, 9, 10, 30), lease_deadline=0.0)
    plan = plan_transfer(handle, [40, 41, 42, 2], SPEC.block_nbytes, num_segments=3)
    assert (len(plan.runs), plan.num_descriptors, plan.num_blocks) == (2, 6, 4)
    assert plan.nbytes == 4 * SPEC.block_nbytes  # the segments are the block's bytes


def test_notices_round_trip_and_garbage_is_ignored() -> None:
    assert decode_notice(encode_done("req-1")) == Notice(NoticeKind.DONE, ("req-1",))
    assert decode_notice(encode_abort("req-2")) == Notice(NoticeKind.ABORT, ("req-2",))
    ids = [f"r{i}" for i in range(MAX_IDS_PER_HEARTBEAT + 3)]
    beats = [decode_notice(m) for m in encode_heartbeats(ids, 1234.5)]
    assert [b.request_ids for b in beats if b] == [
        tuple(ids[:MAX_IDS_PER_HEARTBEAT]),
        tuple(ids[-3:]),
    ]
    assert {b.lease_deadline for b in beats if b} == {1234.5}
    for junk in (b"", b"hello", b"pdkv1\x1fdone", b"pdkv1\x1fnope\x1fx", b"pdkv1\x1fhb\x1fx\x1fr"):
        assert decode_notice(junk) is None
    with pytest.raises(ValueError):
        encode_done("bad\x1fid")


def test_prefix_match_helpers() -> None:
    match = PrefixMatch(8, (WorkerPrefix("a", 5), WorkerPrefix("b", 2)))
    assert match.best() == WorkerPrefix("a", 5)
    assert (match.blocks_cached("b"), match.blocks_cached("zz")) == (2, 0)
    assert PrefixMatch(8, available=False).best() is None
