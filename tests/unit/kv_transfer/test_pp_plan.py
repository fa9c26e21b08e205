"""The hand-off plan between pipeline-parallel layouts (kv_transfer/tp_plan.py): which layer
ranges each decode rank reads from which prefill stage, their byte ranges in every layout
(`slice_reads`), the refusals, `check_handoff_layouts` for `pdserve up`, the split a rank's
spec makes (`kv_split`), the compatibility hash over the model's layers and scales, and the
handshake that checks each stage's region."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.kv.kv_cache import LAYER_MAJOR as ENGINE_LAYER_MAJOR
from engine.kv.kv_cache import KVCacheSpec
from kv_transfer.backend import MemoryRegion
from kv_transfer.plan import plan_transfer, slice_reads
from kv_transfer.protocol import PROTOCOL_VERSION, HandshakeInfo, RankAgent, check_handshake
from kv_transfer.tp_plan import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    LAYER_MAJOR,
    HeadSlice,
    KVSplit,
    LayerRange,
    UnsupportedSplit,
    check_handoff_layouts,
    plan_layers,
    plan_split,
)
from kv_transfer.types import SliceRead, compat_fields, compat_hash, kv_split
from vocabulary.kv_handle import KVHandle
from vocabulary.pipeline import stage_layer_bounds
from vocabulary.transfer_errors import HandshakeError

K, L, PAGE, DIM = 4, 4, 4, 4
UNIT = 2 * PAGE * DIM * 4  # one KV head's one layer of a block: K and V, float32


def spec(
    layout: str = BLOCK_MAJOR,
    bounds: tuple[int, ...] = (0, L),
    tp: int = 1,
    rank: int = 0,
    dtype: str = "float32",
    scales: tuple[float, ...] = (),
) -> KVCacheSpec:
    """Worker rank `rank` (stage-major) of stages cut at `bounds` x `tp` ranks."""
    stage, t = divmod(rank, tp)
    pp = len(bounds) - 1
    return KVCacheSpec(
        16, bounds[stage + 1] - bounds[stage], PAGE, K // tp, DIM, dtype, layout=layout,
        scales=scales, tp_size=tp, tp_rank=t, model_kv_heads=K if tp > 1 else 0, pp_size=pp,
        pp_rank=stage, layer_start=bounds[stage], model_layers=L if pp > 1 else 0,
    )  # fmt: skip


def split(layout: str, bounds: tuple[int, ...] = (0, L), tp: int = 1) -> KVSplit:
    return KVSplit(tp, K, layout, L, bounds)


def reads(p: KVSplit, d: KVSplit) -> list[tuple[int, str, int, int, int, bool, int]]:
    """The SliceReads of the plan p -> d (prefill rank r's agent "P{r}"), as tuples."""
    plan = plan_split(p, d)
    head = UNIT * len(plan.stage_layers(d, 0))  # decode rank 0's head_nbytes
    agents = [f"P{r}" for r in range(p.num_ranks)]
    return [dataclasses.astuple(s) for s in slice_reads(plan, agents, head)]  # type: ignore[misc]


def test_layer_major_is_the_engines_name() -> None:
    assert LAYER_MAJOR == ENGINE_LAYER_MAJOR


def test_a_split_names_its_stages_and_numbers_ranks_stage_major() -> None:
    s = KVSplit(2, 8, BLOCK_MAJOR, 32, (0, 16, 32))
    assert (s.pp_size, s.num_ranks, s.local_heads) == (2, 4, 4)
    assert [s.position(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (
        s.describe()
        == "PP=2 over 32 layers (bounds 0,16,32) x TP=2 over 8 KV heads, block_major_v1"
    )
    assert s.ranks_text == "PP=2 x TP=2 (4 ranks)"
    one = KVSplit(2, 8, BLOCK_MAJOR, 32, (0, 32))  # one stage: one spelling, TP's text
    assert one == KVSplit(2, 8, BLOCK_MAJOR, 32) and one.layer_bounds == ()
    assert (one.pp_size, one.describe(), one.ranks_text) == (
        1, "TP=2 over 8 KV heads, block_major_v1", "TP size 2"
    )  # fmt: skip
    assert KVSplit(1, 8, BLOCK_MAJOR, layer_bounds=(0, 3, 6)).num_layers == 6
    for bad in ((0, 3, 2, 4), (1, 2, 4), (0, 2, 5)):
        with pytest.raises(UnsupportedSplit, match="must rise from 0 to the model's 4 layers"):
            KVSplit(1, 8, BLOCK_MAJOR, 4, bad)
    with pytest.raises(ValueError, match="rank 4 of PP=2 x TP=2"):
        s.position(4)


def test_each_decode_stage_reads_where_its_layers_meet_each_prefill_stage() -> None:
    assert plan_layers((0, 2, 4), (0, 4)) == (LayerRange(0, 0, 0, 2), LayerRange(1, 0, 2, 4))
    assert plan_layers((0, 4), (0, 2, 4)) == (LayerRange(0, 0, 0, 2), LayerRange(0, 1, 2, 4))
    assert plan_layers((0, 1, 4), (0, 3, 4)) == (
        LayerRange(0, 0, 0, 1), LayerRange(1, 0, 1, 3), LayerRange(1, 1, 3, 4)
    )  # fmt: skip
    for p, d in itertools.product([(0, 6), (0, 3, 6), (0, 1, 5, 6), (0, 2, 4, 6)], repeat=2):
        ranges = plan_layers(p, d)  # every layer once, from the stage holding it on both sides
        layers = [x for r in ranges for x in range(r.start, r.stop)]
        assert sorted(layers) == list(range(6))
        for r in ranges:
            assert p[r.prefill_stage] <= r.start < r.stop <= p[r.prefill_stage + 1]
            assert d[r.decode_stage] <= r.start < r.stop <= d[r.decode_stage + 1]


def test_block_major_pp2_to_pp1_reads_each_stage_s_whole_block_at_its_layers() -> None:
    layer = UNIT * K  # every head of one layer
    assert reads(split(BLOCK_MAJOR, (0, 2, 4)), split(BLOCK_MAJOR)) == [
        (0, "P0", 0, 0, 2 * layer, False, 1),
        (0, "P1", 0, 2 * layer, 2 * layer, False, 1),
    ]
    assert reads(split(BLOCK_MAJOR), split(BLOCK_MAJOR, (0, 2, 4))) == [
        (0, "P0", 0, 0, 2 * layer, False, 1),
        (1, "P0", 2 * layer, 0, 2 * layer, False, 1),
    ]
    # different partitions: stage 0 of D reads [0, 1) of P stage 0 and [1, 3) of P stage 1
    assert reads(split(BLOCK_MAJOR, (0, 1, 4)), split(BLOCK_MAJOR, (0, 3, 4))) == [
        (0, "P0", 0, 0, layer, False, 1),
        (0, "P1", 0, layer, 2 * layer, False, 1),
        (1, "P1", 2 * layer, 0, layer, False, 1),
    ]
    same = plan_split(split(BLOCK_MAJOR, (0, 1, 4)), split(BLOCK_MAJOR, (0, 1, 4)))
    assert same.whole_blocks and same.regions_per_block == 2
    assert reads(same.prefill, same.decode) == [
        (0, "P0", 0, 0, layer, True, 1),
        (1, "P1", 0, 0, 3 * layer, True, 1),
    ]
    handle = KVHandle("r", "p", "P0", (3, 4, 5, 9), (), 16, 0.0, "c", ("P0", "P1"))
    whole = slice_reads(same, ("P0", "P1"), UNIT)
    pulled = plan_transfer(handle, [10, 11, 12, 20], layer, slices=whole)
    assert pulled.num_descriptors == 2 * 2  # runs (3,4,5)->(10,11,12), 9->20 on each stage


def test_pp2_x_tp2_reads_into_tp2_by_stage_and_into_tp1_head_by_head() -> None:
    p = split(BLOCK_MAJOR, (0, 2, 4), tp=2)
    half = UNIT * 2  # one layer of a rank's two heads
    assert reads(p, split(BLOCK_MAJOR, tp=2)) == [
        (0, "P0", 0, 0, 2 * half, False, 1),  # stage 0, TP rank 0
        (0, "P2", 0, 2 * half, 2 * half, False, 1),  # stage 1, TP rank 0
        (1, "P1", 0, 0, 2 * half, False, 1),
        (1, "P3", 0, 2 * half, 2 * half, False, 1),
    ]
    with pytest.raises(UnsupportedSplit) as err:
        plan_split(p, split(BLOCK_MAJOR))
    assert str(err.value).startswith(
        "prefill PP=2 over 4 layers (bounds 0,2,4) x TP=2 over 4 KV heads, block_major_v1 → "
        "decode TP=1 over 4 KV heads, block_major_v1: each decode rank reads part of a "
        "block's KV heads, which is one region per block only in head_major_v1"
    )
    hm = split(HEAD_MAJOR, (0, 2, 4), tp=2)
    plan = plan_split(hm, split(HEAD_MAJOR))
    assert plan.reads == ((HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)),)
    assert plan.regions_per_block == 8  # 4 heads x 2 stages: a head's layers of a stage each
    # head-major [heads, layers, ...]: P's head h, its stage's 2 layers, at D's head h, layer a_s
    assert reads(hm, split(HEAD_MAJOR)) == [
        (0, "P0", 0, 0, 2 * UNIT, False, 1),
        (0, "P0", 2 * UNIT, 4 * UNIT, 2 * UNIT, False, 1),
        (0, "P1", 0, 8 * UNIT, 2 * UNIT, False, 1),
        (0, "P1", 2 * UNIT, 12 * UNIT, 2 * UNIT, False, 1),
        (0, "P2", 0, 2 * UNIT, 2 * UNIT, False, 1),
        (0, "P2", 2 * UNIT, 6 * UNIT, 2 * UNIT, False, 1),
        (0, "P3", 0, 10 * UNIT, 2 * UNIT, False, 1),
        (0, "P3", 2 * UNIT, 14 * UNIT, 2 * UNIT, False, 1),
    ]


def test_a_head_range_over_a_stage_s_whole_pool_on_both_sides_stays_one_region() -> None:
    p, d = split(HEAD_MAJOR, (0, 2, 4), tp=1), split(HEAD_MAJOR, (0, 2, 4), tp=2)
    plan = plan_split(p, d)
    assert plan.regions_per_block == 4 and not plan.whole_heads
    assert reads(p, d) == [  # rank (s, t) reads heads [2t, 2t+2) of stage s's whole pool
        (0, "P0", 0, 0, 4 * UNIT, False, 1),
        (1, "P0", 4 * UNIT, 0, 4 * UNIT, False, 1),
        (2, "P1", 0, 0, 4 * UNIT, False, 1),
        (3, "P1", 4 * UNIT, 0, 4 * UNIT, False, 1),
    ]


def test_layer_major_reads_whole_layer_segments_which_coalesce_over_blocks() -> None:
    layer = UNIT * K
    assert reads(split(LAYER_MAJOR, (0, 2, 4)), split(LAYER_MAJOR)) == [
        (0, "P0", 0, 0, 2 * layer, True, 2),
        (0, "P1", 0, 2 * layer, 2 * layer, True, 2),
    ]
    plan = plan_split(split(LAYER_MAJOR, (0, 1, 4)), split(LAYER_MAJOR, (0, 3, 4)))
    assert plan.regions_per_block == L  # a segment per layer, whichever stage
    slices = slice_reads(plan, ("P0", "P1"), 3 * UNIT)
    handle = KVHandle("r", "p", "P0", (3, 4, 5, 9), (), 16, 0.0, "c", ("P0", "P1"))
    pulled = plan_transfer(handle, [10, 11, 12, 20], 3 * layer, slices=slices, num_segments=3)
    assert pulled.num_descriptors == 2 * L  # runs (3,4,5)->(10,11,12), 9->20: once a layer
    assert pulled.nbytes == 4 * L * layer


def test_descriptors_of_a_partial_range_are_one_a_block() -> None:
    plan = plan_split(split(BLOCK_MAJOR, (0, 2, 4)), split(BLOCK_MAJOR))
    slices = slice_reads(plan, ("P0", "P1"), L * UNIT)
    handle = KVHandle("r", "p", "P0", (3, 4, 5, 9), (), 16, 0.0, "c", ("P0", "P1"))
    pulled = plan_transfer(handle, [10, 11, 12, 20], L * UNIT * K, slices=slices)
    assert (pulled.num_descriptors, pulled.nbytes) == (2 * 4, 4 * L * UNIT * K)
    with pytest.raises(ValueError, match="1 prefill agents for PP=2 x TP=1 \\(2 ranks\\)"):
        slice_reads(plan, ("P0",), L * UNIT)


def test_layouts_that_differ_or_models_that_differ_are_refused_naming_both_sides() -> None:
    with pytest.raises(UnsupportedSplit, match=r"block_major_v1 → decode .*layer_major_v1: the KV"):
        plan_split(split(BLOCK_MAJOR, (0, 2, 4)), split(LAYER_MAJOR))
    with pytest.raises(UnsupportedSplit, match="the models have different layers \\(4 and 6\\)"):
        plan_split(split(BLOCK_MAJOR), KVSplit(1, K, BLOCK_MAJOR, 6, (0, 3, 6)))
    with pytest.raises(UnsupportedSplit, match="decode TP=2 over 4 KV heads, layer_major_v1: each"):
        plan_split(split(LAYER_MAJOR, (0, 2, 4)), split(LAYER_MAJOR, tp=2))


def test_pdserve_up_s_check_names_the_numbers_and_what_to_set() -> None:
    ok = check_handoff_layouts(2, 1, 1, 1, 32, 8, "block_major")
    assert ok.regions_per_block == 2 and ok.prefill.layer_bounds == (0, 16, 32)
    both = check_handoff_layouts(2, 2, 1, 1, 32, 8, "head_major_v1")
    assert both.regions_per_block == 16  # 8 heads x 2 stages
    partitioned = check_handoff_layouts(2, 1, 3, 1, 32, 8, "layer_major", (10, 22), (8, 8, 16))
    assert partitioned.decode.layer_bounds == (0, 8, 16, 32)
    refusals = {
        (2, 2, 1, 1, 32, 8, "block_major"): "prefill PP=2 over 32 layers (bounds 0,16,32) x "
        "TP=2 over 8 KV heads, block_major_v1 → decode TP=1 over 8 KV heads, block_major_v1: "
        "each decode rank reads part of a block's KV heads",
        (3, 1, 1, 1, 32, 8, "block_major"): "prefill workers: 3 pipeline stages do not "
        "divide the model's 32 layers (give a layer partition, e.g. 11,11,10)",
        (1, 1, 1, 3, 32, 8, "head_major"): "decode workers: TP=3 over 8 KV heads, "
        "head_major_v1: the TP size must divide",
        (1, 1, 40, 1, 32, 8, "block_major"): "decode workers: 40 pipeline stages over 32 layers",
        (1, 1, 1, 1, 32, 8, "diagonal"): "KV layout 'diagonal': one of block_major, head_major",
    }
    for args, message in refusals.items():
        with pytest.raises(UnsupportedSplit) as err:
            check_handoff_layouts(*args)  # type: ignore[arg-type]
        assert str(err.value).startswith(message), str(err.value)
    with pytest.raises(UnsupportedSplit, match="prefill workers: layer partition 10,10: needs 2"):
        check_handoff_layouts(2, 1, 1, 1, 32, 8, "block_major", (10, 10))


def test_every_rank_of_a_worker_makes_the_same_split_with_the_worker_s_bounds() -> None:
    ranks = [spec(BLOCK_MAJOR, (0, 2, 4), 2, r) for r in range(4)]
    assert {kv_split(s) for s in ranks} == {KVSplit(2, K, BLOCK_MAJOR, L, (0, 2, 4))}
    assert {kv_split(s, (0, 2, 4)) for s in ranks} == {KVSplit(2, K, BLOCK_MAJOR, L, (0, 2, 4))}
    cut = [spec(BLOCK_MAJOR, (0, 1, 4), 1, r) for r in range(2)]
    assert {kv_split(s, (0, 1, 4)) for s in cut} == {KVSplit(1, K, BLOCK_MAJOR, L, (0, 1, 4))}
    with pytest.raises(ValueError, match="stage bounds 0,2,4: the pool of stage 1 of 2 holds "
                       "layers \\[1, 4\\) of 4 \\(pass the worker's layer bounds\\)"):  # fmt: skip
        kv_split(cut[1])
    one = spec()
    assert kv_split(one) == KVSplit(1, K, BLOCK_MAJOR, L) and kv_split(one).layer_bounds == ()
    assert stage_layer_bounds(L, 2) == (0, 2, 4)


def test_a_one_stage_pool_hashes_as_before_and_stages_hash_as_their_model() -> None:
    recorded = {  # computed before pipeline parallelism
        spec(): "fa094b43e31ea579cf0c43880c094e86",
        spec(LAYER_MAJOR, dtype="float8_e4m3fn", scales=(1.0, 2.0, 0.5, 0.25, 1.0, 1.0, 4.0, 8.0)):
        "f6301ac8745959f03f9c54e9dbc46d07",
        spec(HEAD_MAJOR, tp=2, rank=1): "1a7aa06c26b672468d4ec977c4f12b4b",
    }  # fmt: skip
    for s, h in recorded.items():
        assert compat_hash(s, "m") == h
    stages = [spec(BLOCK_MAJOR, (0, 1, 4), 2, r) for r in range(4)]
    assert {compat_hash(s, "m") for s in stages} == {compat_hash(spec(), "m")}
    assert "num_layers=4;" in compat_fields(stages[3], "m")  # the model's, not the stage's 3


def test_an_e4m3_stage_hashes_the_model_s_scales_which_the_worker_passes() -> None:
    scales = (1.0, 2.0, 0.5, 0.25, 1.0, 1.0, 4.0, 8.0)
    whole = spec(LAYER_MAJOR, dtype="float8_e4m3fn", scales=scales)
    s0 = spec(LAYER_MAJOR, (0, 1, 4), dtype="float8_e4m3fn", scales=scales[:2])
    s1 = spec(LAYER_MAJOR, (0, 1, 4), rank=1, dtype="float8_e4m3fn", scales=scales[2:])
    assert compat_hash(s0, "m", scales) == compat_hash(s1, "m", scales) == compat_hash(whole, "m")
    other = (*scales[:6], 4.0, 16.0)  # layer 3's V scale differs
    assert compat_hash(dataclasses.replace(s1, scales=other[2:]), "m", other) != compat_hash(
        whole, "m"
    )
    with pytest.raises(ValueError, match="stage 1 holds only layers \\[1, 4\\)'s scales"):
        compat_hash(s1, "m")
    with pytest.raises(ValueError, match="8 model KV scales: need 8, with stage 1's own at"):
        compat_hash(s1, "m", other)
    with pytest.raises(ValueError, match="a float32 KV pool has no scales"):
        compat_hash(spec(), "m", scales)


def info(bounds: tuple[int, ...], layout: str = BLOCK_MAJOR, ranks: int | None = None,
         sizes: dict[int, int] | None = None) -> HandshakeInfo:  # fmt: skip
    """A prefill worker of stages `bounds` (TP 1): rank r's region of its stage's block
    (`sizes[r]` bytes when given), one segment a layer when layer-major."""
    n = len(bounds) - 1 if ranks is None else ranks
    agents = []
    for r in range(n):
        s = spec(layout, bounds, 1, min(r, len(bounds) - 2))
        nbytes = (sizes or {}).get(r, s.block_nbytes)
        region = MemoryRegion("DRAM", 0, 4096, nbytes, 16, num_segments=s.num_segments)
        agents.append(RankAgent(f"P{r}", b"", region))
    s0 = spec(layout, bounds)
    return HandshakeInfo(
        protocol_version=PROTOCOL_VERSION, compat_hash=compat_hash(s0, "m"),
        compat_fields=compat_fields(s0, "m"), worker_id="p0", agent_name="P0",
        agent_metadata=b"", region=agents[0].region, split=kv_split(s0, bounds),
        followers=tuple(agents[1:]),
    )  # fmt: skip


def check(remote: HandshakeInfo, local: KVCacheSpec, bounds: tuple[int, ...] = ()) -> object:
    return check_handshake(
        remote, compat_hash(local, "m"), compat_fields(local, "m"), kv_split(local, bounds),
        local.head_nbytes, local.num_segments,
    )  # fmt: skip


def test_the_handshake_plans_between_stages_and_checks_each_stage_s_region() -> None:
    plan = check(info((0, 1, 4)), spec())
    assert plan.layers == (LayerRange(0, 0, 0, 1), LayerRange(1, 0, 1, 4))  # type: ignore[attr-defined]
    check(info((0, 2, 4)), spec(BLOCK_MAJOR, (0, 1, 4)), (0, 1, 4))  # PP=2 -> PP=2 cut elsewhere
    check(info((0, 1, 4), LAYER_MAJOR), spec(LAYER_MAJOR))  # stage 1's region: 3 segments
    with pytest.raises(HandshakeError, match="has 1 rank agents for PP=2 x TP=1 \\(2 ranks\\)"):
        check(info((0, 1, 4), ranks=1), spec())
    with pytest.raises(HandshakeError) as err:
        check(info((0, 1, 4), sizes={1: 100}), spec())
    assert "rank 1's block of 100 bytes holds 4 KV heads of 3 layers, 128 bytes a head and " in (
        str(err.value)
    )
    bad = info((0, 1, 4), LAYER_MAJOR)
    flat = dataclasses.replace(bad.followers[0].region, num_segments=1)
    bad = dataclasses.replace(bad, followers=(RankAgent("P1", b"", flat),))
    with pytest.raises(HandshakeError, match="rank 1's block is 1 segment\\(s\\), 3 here"):
        check(bad, spec(LAYER_MAJOR))


def test_slice_read_defaults_to_one_segment() -> None:
    assert SliceRead(0, "P", 0, 0, 8, True).num_segments == 1
