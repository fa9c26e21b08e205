"""The tp_gpu suite's arithmetic and plan (benchmarks/suites/tp/gpu_plan.py): the bytes one TP
rank reads in a decode step (the HBM floor's numerator) against the parameters of the model a
rank actually builds, the floor itself, the logits comparison, which TP sizes and hand-off
pairs (TP and PP x TP layouts) a machine of 0..4 GPUs runs, skips (with the reason) and where
each rank goes, and the descriptors and bytes a pair's hand-off posts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.harness.decode_model import weight_read_bytes
from benchmarks.suites.tp.gpu_plan import (
    DEFAULT_PAIRS,
    LOGITS_REL_TOL,
    HandoffPair,
    PairPlacement,
    Skip,
    WorkerLayout,
    expected_reads,
    floor_s,
    logits_rel_diff,
    parse_ints,
    parse_pairs,
    plan_decode,
    plan_pairs,
    rank_step_bytes,
    tp_pair,
)
from deploy.checkpoints.make_model import PRESETS, hf_config
from engine.kv.kv_sizing import kv_cache_spec
from engine.modeling.llama import LlamaModel
from engine.tp.tp_shard import TPShard, local_config
from vocabulary.model_config import ModelConfig

PAIRS = (tp_pair(1, 1), tp_pair(1, 2), tp_pair(2, 1), tp_pair(2, 2))
PP2 = WorkerLayout(2, 1)
PP2_TO_TP2 = HandoffPair(PP2, WorkerLayout(1, 2))


def preset(name: str, **overrides: object) -> ModelConfig:
    raw = hf_config(PRESETS[name], 0, 1) | overrides
    return ModelConfig.from_dict(raw)


def test_llama3_8b_bytes_per_rank_by_hand() -> None:
    cfg = preset("llama3-8b")
    # per layer: qkv 4096 x 6144, o 4096 x 4096, gate/up 28672 x 4096, down 4096 x 14336
    projections = 32 * (4096 * 6144 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336)
    norms, head = 32 * 2 * 4096 + 4096, 128256 * 4096
    one = rank_step_bytes(cfg, 1, 64, 2048, 2)
    assert one.weights == 2 * (projections + norms + head) == 15_009_849_344
    assert one.kv == 64 * 2048 * (32 * 2 * 8 * 128) * 2 == 17_179_869_184
    two = rank_step_bytes(cfg, 2, 64, 2048, 2)
    assert two.weights == 2 * (projections // 2 + norms + head) == 8_030_527_488
    assert two.kv == one.kv // 2
    assert two.total == two.weights + two.kv


@pytest.mark.parametrize(
    ("name", "overrides", "sizes"),
    [
        ("llama3-8b", {}, (1, 2, 4, 8, 16)),  # 16 > 8 KV heads: replicated, one per rank
        ("tiny", {}, (1, 2, 4)),
        ("tiny", {"tie_word_embeddings": True}, (1, 2)),
        ("tiny", {"attention_bias": True}, (1, 2)),
    ],
)
def test_step_bytes_equal_what_a_rank_builds(
    name: str, overrides: dict[str, object], sizes: tuple[int, ...]
) -> None:
    """The weights one rank's decode reads (its part's parameters, less a separate embedding
    table) and its KV bytes a token, from the model and pool spec a rank of that TP size
    builds (on the meta device: shapes only; the first and last rank)."""
    cfg = preset(name, **overrides)
    for size in sizes:
        for rank in sorted({0, size - 1}):
            shard = TPShard(size, rank)
            local = local_config(cfg, shard)
            model = LlamaModel(local, torch.bfloat16, "meta")
            want = rank_step_bytes(cfg, size, 3, 5, 2)
            assert weight_read_bytes(model) == want.weights, (size, rank)
            spec = kv_cache_spec(local, 16, torch.bfloat16, 1, shard=shard,
                                 model_kv_heads=cfg.num_kv_heads)  # fmt: skip
            assert 3 * 5 * spec.block_nbytes // 16 == want.kv, (size, rank)


def test_floor_is_the_slowest_rank() -> None:
    assert floor_s(8_000_000_000, [4e12]) == pytest.approx(2e-3)
    assert floor_s(8_000_000_000, [4e12, 2e12, 4e12]) == pytest.approx(4e-3)


def test_logits_rel_diff() -> None:
    want = np.array([3.0, 4.0], dtype=np.float32)
    assert logits_rel_diff(want.copy(), want) == 0.0
    assert logits_rel_diff(np.array([3.0, 4.5], dtype=np.float32), want) == pytest.approx(0.1)
    assert logits_rel_diff(np.array([3.0, 4.6], dtype=np.float32), want) > LOGITS_REL_TOL
    assert logits_rel_diff(-want, want) == pytest.approx(2.0)  # what a broken model looks like


def test_decode_plan_skips_what_the_machine_cannot_hold() -> None:
    assert plan_decode(2, 2) == ([1, 2], [])
    assert plan_decode(2, 8) == ([1, 2], [])
    assert plan_decode(1, 1) == ([1], [])
    runs, skips = plan_decode(2, 1)
    assert runs == [1]
    assert skips == [Skip("decode TP=2", "needs 2 GPUs (one per rank), this machine has 1")]
    runs, skips = plan_decode(4, 0)
    assert runs == []
    assert [s.what for s in skips] == ["decode TP=1", "decode TP=4"]


def test_pairs_need_two_gpus() -> None:
    placed, skips = plan_pairs(PAIRS, 1, "auto")
    assert placed == {}
    assert [s.what for s in skips] == ["hand-off 1->1", "hand-off 1->2", "hand-off 2->1",
                                       "hand-off 2->2"]  # fmt: skip
    assert all("needs 2 GPUs" in s.why and "has 1" in s.why for s in skips)


def test_one_gpu_runs_pairs_inside_it_only_when_asked() -> None:
    placed, skips = plan_pairs(PAIRS, 1, "auto")
    assert placed == {} and len(skips) == 4
    assert all("--placement single runs it inside the one GPU" in s.why for s in skips)
    for num_devices in (1, 2):
        placed, skips = plan_pairs(PAIRS, num_devices, "single")
        assert skips == []
        assert placed[tp_pair(2, 2)] == PairPlacement((0, 0), (0, 0), "single")
        assert placed[tp_pair(1, 2)] == PairPlacement((0,), (0, 0), "single")
    placed, skips = plan_pairs(PAIRS, 0, "single")
    assert placed == {} and all("has 0" in s.why for s in skips)


def test_two_gpus_pack_every_pair_across_the_one_link() -> None:
    for placement in ("auto", "packed"):
        placed, skips = plan_pairs(PAIRS, 2, placement)
        assert skips == []
        assert placed[tp_pair(1, 1)] == PairPlacement((0,), (1,), "packed")
        assert placed[tp_pair(1, 2)] == PairPlacement((0,), (1, 1), "packed")
        assert placed[tp_pair(2, 1)] == PairPlacement((0, 0), (1,), "packed")
        assert placed[tp_pair(2, 2)] == PairPlacement((0, 0), (1, 1), "packed")


def test_four_gpus_spread_every_rank_to_its_own_gpu() -> None:
    placed, skips = plan_pairs(PAIRS, 4, "auto")
    assert skips == []
    assert placed[tp_pair(1, 1)] == PairPlacement((0,), (1,), "spread")
    assert placed[tp_pair(1, 2)] == PairPlacement((0,), (1, 2), "spread")
    assert placed[tp_pair(2, 1)] == PairPlacement((0, 1), (2,), "spread")
    assert placed[tp_pair(2, 2)] == PairPlacement((0, 1), (2, 3), "spread")


def test_auto_packs_when_one_pair_does_not_spread() -> None:
    placed, skips = plan_pairs(PAIRS, 3, "auto")
    assert skips == []
    assert {p.mode for p in placed.values()} == {"packed"}


def test_spread_asked_for_skips_the_pairs_that_do_not_fit() -> None:
    placed, skips = plan_pairs(PAIRS, 3, "spread")
    assert [pair.name for pair in placed] == ["1->1", "1->2", "2->1"]
    assert skips == [
        Skip(
            "hand-off 2->2",
            "spread placement needs 4 GPUs (one per rank), this machine has 3; "
            "--placement packed puts prefill ranks on GPU 0 and decode ranks on GPU 1",
        )
    ]


def test_pp_pairs_place_every_stage_s_ranks() -> None:
    pairs = (HandoffPair(PP2, WorkerLayout(1, 1)), PP2_TO_TP2)
    placed, skips = plan_pairs(pairs, 2, "auto")
    assert skips == []
    assert placed[pairs[0]] == PairPlacement((0, 0), (1,), "packed")
    assert placed[PP2_TO_TP2] == PairPlacement((0, 0), (1, 1), "packed")
    placed, skips = plan_pairs(pairs, 3, "spread")
    assert placed == {pairs[0]: PairPlacement((0, 1), (2,), "spread")}
    assert skips == [
        Skip(
            "hand-off pp2tp1->pp1tp2",
            "spread placement needs 4 GPUs (one per rank), this machine has 3; "
            "--placement packed puts prefill ranks on GPU 0 and decode ranks on GPU 1",
        )
    ]
    placed, _ = plan_pairs(pairs, 4, "auto")
    assert placed[PP2_TO_TP2] == PairPlacement((0, 1), (2, 3), "spread")


def test_parse_pairs_and_ints() -> None:
    assert parse_pairs("1-1, 2-4") == (tp_pair(1, 1), tp_pair(2, 4))
    assert parse_pairs("pp2tp1:pp1tp2,pp1tp2:pp1tp1 , 2-1") == (
        PP2_TO_TP2, tp_pair(2, 1), tp_pair(2, 1)
    )  # fmt: skip
    assert parse_pairs("1-1,1-2,2-1,2-2,pp2tp1:pp1tp1,pp2tp1:pp1tp2") == DEFAULT_PAIRS
    for bad in ("2", "1-x", "0-1", "1-1,", "-1-2", "pp2tp1", "pp2:pp1tp1", "pp0tp1:pp1tp1",
                "pp2tp1:pp1tp1:pp1tp1", "pp2tp1-pp1tp1", "tp1pp2:pp1tp1"):  # fmt: skip
        with pytest.raises(ValueError, match=r"PREFILL_TP-DECODE_TP .* ppSTAGEStpRANKS"):
            parse_pairs(bad)
    assert parse_ints("1,16,64") == (1, 16, 64)
    for bad in ("0,1", "a", ""):
        with pytest.raises(ValueError):
            parse_ints(bad)


def test_pair_names_layouts_and_plans() -> None:
    assert [p.name for p in DEFAULT_PAIRS] == [
        "1->1", "1->2", "2->1", "2->2", "pp2tp1->pp1tp1", "pp2tp1->pp1tp2"
    ]  # fmt: skip
    layouts = [p.kv_layout.removesuffix("_v1") for p in DEFAULT_PAIRS]
    assert layouts == ["block_major", "head_major", "head_major", "block_major",
                       "block_major", "head_major"]  # fmt: skip
    plan = PP2_TO_TP2.plan(32, 8)
    assert plan.prefill.layer_bounds == (0, 16, 32) and plan.decode.tp_size == 2
    with pytest.raises(ValueError, match="3 pipeline stages do not divide the model's 4 layers"):
        HandoffPair(WorkerLayout(3, 1), WorkerLayout(1, 1)).plan(4, 2)


@pytest.mark.parametrize(
    ("pair", "per_rank"),
    [
        (tp_pair(1, 1), (1,)),  # whole blocks: one run
        (tp_pair(1, 2), (128, 128)),  # a head range of a head-major block: one a block
        (tp_pair(2, 1), (256,)),
        (tp_pair(2, 2), (1, 1)),
        (HandoffPair(PP2, WorkerLayout(1, 1)), (256,)),  # a stage's layers: one a block each
        (PP2_TO_TP2, (1024, 1024)),  # 2 stages x 4 heads (one region each) a block
        (HandoffPair(WorkerLayout(1, 1), PP2), (128, 128)),
        (HandoffPair(PP2, PP2), (1, 1)),  # the same stages: whole blocks
    ],
)
def test_expected_reads_llama3_8b_shape(pair: HandoffPair, per_rank: tuple[int, ...]) -> None:
    """128 blocks of 16 tokens, 32 layers, 8 KV heads of 128, bf16: every pair moves the
    prompt's 256 MiB once (no head is replicated), in the descriptors of tp_plan's table."""
    unit = 2 * 16 * 128 * 2
    got = expected_reads(pair.plan(32, 8), 128, 1, unit)
    assert got.per_rank == per_rank and got.descriptors == sum(per_rank)
    assert got.nbytes == 128 * 32 * 8 * unit == 256 * 2**20
