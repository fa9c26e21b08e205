"""The cross-TP hand-off plan (kv_transfer/tp_plan.py), exhaustively over the TP sizes a model's
KV heads allow, its byte ranges (`slice_reads`), and the handshake that checks it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.kv.kv_cache import BLOCK_MAJOR as ENGINE_BLOCK_MAJOR
from engine.kv.kv_cache import HEAD_MAJOR as ENGINE_HEAD_MAJOR
from engine.kv.kv_cache import KVCacheSpec
from engine.tp.tp_shard import TPShard, kv_head_range
from kv_transfer.backend import MemoryRegion
from kv_transfer.plan import plan_transfer, slice_reads
from kv_transfer.protocol import PROTOCOL_VERSION, HandshakeInfo, RankAgent, check_handshake
from kv_transfer.tp_plan import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    HeadSlice,
    KVSplit,
    UnsupportedSplit,
    kv_heads_of,
    plan_heads,
    plan_split,
)
from kv_transfer.types import compat_fields, compat_hash, kv_split
from vocabulary.kv_handle import KVHandle
from vocabulary.model_config import ModelConfig, RopeConfig
from vocabulary.transfer_errors import HandshakeError


def sizes(kv_heads: int) -> list[int]:
    """Every TP size up to 16 that splits `kv_heads` (divides them or is a multiple)."""
    return [n for n in range(1, 17) if kv_heads % n == 0 or n % kv_heads == 0]


KV_HEADS = (1, 2, 3, 4, 8, 16)


def pairs(kv_heads: int) -> list[tuple[int, int]]:
    """Every (prefill TP, decode TP) pair for a model of `kv_heads` KV heads."""
    return list(itertools.product(sizes(kv_heads), repeat=2))


def model(kv_heads: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=16 * 16, intermediate_size=16 * 16,
        num_layers=1, num_heads=16 * max(kv_heads, 16), num_kv_heads=kv_heads, head_dim=4,
        max_position_embeddings=8, rms_norm_eps=1e-5, rope=RopeConfig(),
        tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, qk_norm=False,
        bos_token_id=None, eos_token_ids=(), torch_dtype="float32",
    )  # fmt: skip


def test_layout_names_are_the_engines() -> None:
    assert (BLOCK_MAJOR, HEAD_MAJOR) == (ENGINE_BLOCK_MAJOR, ENGINE_HEAD_MAJOR)


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 4, 8, 16])
def test_kv_heads_of_each_rank_are_the_engines_shard(kv_heads: int) -> None:
    cfg = model(kv_heads)
    for n in sizes(kv_heads):
        for r in range(n):
            assert kv_heads_of(kv_heads, n, r) == kv_head_range(cfg, TPShard(n, r))


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_every_decode_rank_reads_exactly_its_heads_from_ranks_that_hold_them(
    kv_heads: int,
) -> None:
    for prefill_tp, decode_tp in pairs(kv_heads):
        check_reads(kv_heads, prefill_tp, decode_tp)


def check_reads(kv_heads: int, prefill_tp: int, decode_tp: int) -> None:
    reads = plan_heads(prefill_tp, decode_tp, kv_heads)
    assert len(reads) == decode_tp
    for d, slices in enumerate(reads):
        mine = kv_heads_of(kv_heads, decode_tp, d)
        dst = [s.dst_head + i for s in slices for i in range(s.num_heads)]
        assert dst == list(range(len(mine)))  # covered once, in order
        for s in slices:
            theirs = kv_heads_of(kv_heads, prefill_tp, s.prefill_rank)
            assert s.src_head >= 0 and s.src_head + s.num_heads <= len(theirs)
            for i in range(s.num_heads):  # the same model head on both sides
                assert theirs[s.src_head + i] == mine[s.dst_head + i]
        for a, b in itertools.pairwise(slices):  # maximal: adjacent slices could not merge
            assert not (a.prefill_rank == b.prefill_rank and a.src_head + a.num_heads == b.src_head)
        holders = [p for p in range(prefill_tp) if mine[0] in kv_heads_of(kv_heads, prefill_tp, p)]
        if d in holders and len(mine) == 1:  # a replicated head comes from rank d when it can
            assert slices[0].prefill_rank == d


@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_head_major_serves_every_pair_and_block_major_only_whole_blocks(kv_heads: int) -> None:
    for prefill_tp, decode_tp in pairs(kv_heads):
        check_layouts(kv_heads, prefill_tp, decode_tp)


def check_layouts(kv_heads: int, prefill_tp: int, decode_tp: int) -> None:
    def split(n: int, layout: str) -> KVSplit:
        return KVSplit(n, kv_heads, layout)

    plan = plan_split(split(prefill_tp, HEAD_MAJOR), split(decode_tp, HEAD_MAJOR))
    local_p, local_d = len(kv_heads_of(kv_heads, prefill_tp, 0)), plan.decode.local_heads
    whole = all(len(r) == 1 and r[0].num_heads == local_p == local_d for r in plan.reads)
    assert plan.whole_blocks == whole
    if prefill_tp == decode_tp:
        assert whole
        assert plan.reads == tuple((HeadSlice(r, 0, 0, local_d),) for r in range(decode_tp))
    bm = (split(prefill_tp, BLOCK_MAJOR), split(decode_tp, BLOCK_MAJOR))
    if whole:
        assert plan_split(*bm).reads == plan.reads
    else:
        with pytest.raises(UnsupportedSplit, match="one region per block only in head_major_v1"):
            plan_split(*bm)
    with pytest.raises(UnsupportedSplit, match="decode TP="):
        plan_split(split(prefill_tp, HEAD_MAJOR), split(decode_tp, BLOCK_MAJOR))


def test_the_issue_s_pairs_for_eight_kv_heads() -> None:
    assert plan_heads(1, 2, 8) == ((HeadSlice(0, 0, 0, 4),), (HeadSlice(0, 4, 0, 4),))
    assert plan_heads(2, 1, 8) == ((HeadSlice(0, 0, 0, 4), HeadSlice(1, 0, 4, 4)),)
    assert plan_heads(2, 4, 8) == tuple((HeadSlice(d // 2, 2 * (d % 2), 0, 2),) for d in range(4))
    # 2 KV heads (the tiny model): TP=4 replicates them; P TP=2 -> D TP=4 stays whole blocks
    assert plan_heads(2, 4, 2) == tuple((HeadSlice(d // 2, 0, 0, 1),) for d in range(4))
    assert plan_heads(4, 2, 2) == ((HeadSlice(0, 0, 0, 1),), (HeadSlice(3, 0, 0, 1),))
    assert plan_heads(4, 1, 2) == ((HeadSlice(0, 0, 0, 1), HeadSlice(2, 0, 1, 1)),)


def test_splits_that_do_not_divide_the_heads_or_differ_in_heads_are_refused() -> None:
    with pytest.raises(UnsupportedSplit, match="TP=3 over 8 KV heads"):
        KVSplit(3, 8, HEAD_MAJOR)
    with pytest.raises(UnsupportedSplit, match="the models have different KV heads"):
        plan_split(KVSplit(1, 8, HEAD_MAJOR), KVSplit(1, 4, HEAD_MAJOR))
    with pytest.raises(UnsupportedSplit, match="the KV layouts differ"):
        plan_split(KVSplit(2, 8, HEAD_MAJOR), KVSplit(2, 8, BLOCK_MAJOR))


def spec(tp: int, rank: int = 0, layout: str = HEAD_MAJOR, kv_heads: int = 8) -> KVCacheSpec:
    local = len(kv_heads_of(kv_heads, tp, rank))
    return KVCacheSpec(
        64, 2, 16, local, 8, "float32", layout=layout, tp_size=tp, tp_rank=rank,
        model_kv_heads=kv_heads if tp > 1 else 0,
    )  # fmt: skip


def test_slice_reads_are_byte_ranges_of_a_head_major_block() -> None:
    d = spec(2)
    head = d.head_nbytes
    assert head == 2 * 2 * 16 * 8 * 4 and spec(1).head_nbytes == head
    plan = plan_split(KVSplit(1, 8, HEAD_MAJOR), kv_split(d))
    reads = slice_reads(plan, ("P0",), head)
    got = [(r.decode_rank, r.peer, r.src_offset, r.dst_offset, r.nbytes, r.whole) for r in reads]
    assert got == [
        (0, "P0", 0, 0, 4 * head, False),
        (1, "P0", 4 * head, 0, 4 * head, False),
    ]  # fmt: skip
    handle = KVHandle("r", "p", "P0", (3, 4, 5, 9), (), 64, 0.0, "c")
    tp = plan_transfer(handle, [10, 11, 12, 20], d.block_nbytes, slices=reads)
    assert tp.nbytes == 4 * 8 * head  # every decode rank's half of 4 blocks
    assert tp.num_descriptors == 8  # a partial range: one per block and rank
    assert [s.decode_rank for s in tp.for_rank(1).slices] == [1]
    same = slice_reads(plan_split(KVSplit(2, 8, HEAD_MAJOR), kv_split(d)), ("P0", "P1"), head)
    assert all(r.whole for r in same)
    whole = plan_transfer(handle, [10, 11, 12, 20], d.block_nbytes, slices=same)
    assert whole.num_descriptors == 2 * 2  # runs (3,4,5)->(10,11,12) and 9->20, per rank
    with pytest.raises(ValueError, match="1 prefill agents for TP size 2"):
        slice_reads(plan_split(KVSplit(2, 8, HEAD_MAJOR), kv_split(d)), ("P0",), head)


def info(tp: int, layout: str = HEAD_MAJOR, followers: int | None = None) -> HandshakeInfo:
    s = spec(tp, layout=layout)
    n = tp - 1 if followers is None else followers
    region = MemoryRegion("DRAM", 0, 4096, s.block_nbytes, s.num_blocks)
    return HandshakeInfo(
        protocol_version=PROTOCOL_VERSION, compat_hash=compat_hash(s, "m"),
        compat_fields=compat_fields(s, "m"), worker_id="p0", agent_name="P0",
        agent_metadata=b"", region=region, split=kv_split(s),
        followers=tuple(RankAgent(f"P{r}", b"", region) for r in range(1, n + 1)),
    )  # fmt: skip


def check(remote: HandshakeInfo, local: KVCacheSpec) -> object:
    return check_handshake(
        remote, compat_hash(local, "m"), compat_fields(local, "m"), kv_split(local),
        local.head_nbytes, local.num_segments,
    )  # fmt: skip


def test_the_handshake_plans_cross_tp_pulls_and_refuses_what_it_cannot_serve() -> None:
    # one hash per model, whatever the TP split (the rank's own head count is not in it)
    assert compat_hash(spec(1), "m") == compat_hash(spec(2, 1), "m") == compat_hash(spec(4), "m")
    assert "tp_size" not in compat_fields(spec(2), "m")
    one = dataclasses.replace(spec(1, layout=BLOCK_MAJOR))
    assert compat_fields(one, "m").endswith("num_kv_heads=8;head_dim=8")  # as before TP
    for p, d in [(1, 2), (2, 1), (2, 4), (2, 2), (4, 2)]:
        plan = check(info(p), spec(d))
        assert plan.prefill.tp_size == p and plan.decode.tp_size == d  # type: ignore[attr-defined]
    check(info(2, BLOCK_MAJOR), spec(2, layout=BLOCK_MAJOR))  # same TP: whole blocks
    with pytest.raises(HandshakeError) as err:
        check(info(2, BLOCK_MAJOR), spec(1, layout=BLOCK_MAJOR))
    message = str(err.value)
    assert "peer P0 (worker p0) cannot hand KV to this worker" in message
    assert "prefill TP=2 over 8 KV heads, block_major_v1 → decode TP=1" in message
    assert "head_major" in message
    with pytest.raises(HandshakeError, match="the KV layouts differ"):
        check(info(1, BLOCK_MAJOR), spec(1))
    with pytest.raises(HandshakeError, match="1 rank agents for TP size 2"):
        check(info(2, followers=0), spec(1))
    small = dataclasses.replace(info(1), region=MemoryRegion("DRAM", 0, 1, 7, 64))
    with pytest.raises(HandshakeError, match="rank 0's block of 7 bytes holds 8 KV heads"):
        check(small, spec(2))
