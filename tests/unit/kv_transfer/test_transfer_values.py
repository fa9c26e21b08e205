"""Pure values of kv_transfer: plans and coalescing, compat hash, handshake check, notices."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from kvt_factories import COMPAT, MODEL, SPEC, make_handle

from kv_transfer.backend import MemoryRegion
from kv_transfer.errors import HandshakeError
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
from kv_transfer.types import DescriptorRun, compat_fields, compat_hash, kv_split
from prefix_index.types import PrefixMatch, WorkerPrefix


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
        dataclasses.replace(SPEC, layout="head_major_v1"),
    ]
    hashes = {compat_hash(s, MODEL) for s in changed} | {compat_hash(SPEC, "other-model")}
    assert len(hashes) == 7 and COMPAT not in hashes


def _info(
    spec: object = SPEC, version: int = PROTOCOL_VERSION, block_nbytes: int = 0
) -> HandshakeInfo:
    assert isinstance(spec, type(SPEC))
    region = MemoryRegion("DRAM", 0, 4096, block_nbytes or spec.block_nbytes, spec.num_blocks)
    return HandshakeInfo(
        protocol_version=version,
        compat_hash=compat_hash(spec, MODEL),
        compat_fields=compat_fields(spec, MODEL),
        worker_id="p0",
        agent_name="P",
        agent_metadata=b"md",
        region=region,
        split=kv_split(spec),
    )


def test_handshake_accepts_an_equal_peer_and_names_what_differs_otherwise() -> None:
    fields = compat_fields(SPEC, MODEL)
    mine = (COMPAT, fields, kv_split(SPEC), SPEC.head_nbytes)
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


def test_router_facing_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from kv_transfer.types import KVHandle, TransferLoad, compat_hash\n"
        "from kv_transfer.errors import TransferError\n"
        "from kv_transfer.protocol import HandshakeInfo\n"
        "from prefix_index.index import PrefixIndex\n"
        "from prefix_index.publisher import KVEventPublisher\n"
        "from prefix_index.types import PrefixMatch\n"
        "import router.orchestrator, router.servicer, worker_runtime.api\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
