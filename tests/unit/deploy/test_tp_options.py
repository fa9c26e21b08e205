"""Tensor-parallel workers in the config tree and the CLI: `--prefill-tp/--decode-tp` (and
`--kv-layout`) reach `workers`, each role's engine gets its TP size and the cluster's KV
layout (auto: head-major when the sizes differ), the capacity checks count a worker's ranks,
and `up` refuses sizes that cannot serve the model, or a layout no hand-off plan serves,
before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_cli_up_checks import StartRecorder, assert_refused, make_checkpoint, up, write_config
from test_config_tree import show

from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
from deploy.control.worker_actors import capacity_shortfall, rebalance_shortfall
from engine.config import EngineConfig, EngineMode
from vocabulary.worker_api import ActorPlacement, WorkerRole

starts = __import__("test_cli_up_checks").starts  # the fixture

GPU = ActorPlacement(num_gpus=1.0, num_cpus=1.0)
EIGHT_KV_HEADS = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}  # fmt: skip


def spec(**fields: object) -> ClusterSpec:
    return ClusterSpec(engine=EngineConfig(model_dir="m"), **fields)  # type: ignore[arg-type]


def test_each_role_gets_its_tp_size_and_the_clusters_kv_layout() -> None:
    crossed = spec(prefill_tp=2, decode_tp=1)
    assert crossed.kv_layout == "head_major"
    prefill, decode = crossed.engine_for(WorkerRole.PREFILL), crossed.engine_for(WorkerRole.DECODE)
    assert (prefill.mode, prefill.tensor_parallel_size, prefill.kv_layout) == (
        EngineMode.PREFILL_ONLY, 2, "head_major"
    )  # fmt: skip
    assert (decode.mode, decode.tensor_parallel_size) == (EngineMode.COLOCATED, 1)
    assert spec(prefill_tp=2, decode_tp=2).kv_layout == "block_major"  # rank r reads rank r
    # colocated: nothing handed off, each engine resolves auto (layer_major on a GPU)
    assert spec(prefill_tp=2, decode_tp=1, colocated=True).kv_layout == "auto"
    assert spec(colocated=True).engine_for(WorkerRole.DECODE).kv_layout == "auto"
    pinned = ClusterSpec(engine=EngineConfig(model_dir="m", kv_layout="head_major"))
    assert pinned.kv_layout == "head_major"
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1, got 0"):
        spec(decode_tp=0).engine_for(WorkerRole.DECODE)
    with pytest.raises(ValueError, match="set prefill_tp / decode_tp"):
        ClusterSpec(engine=EngineConfig(model_dir="m", tensor_parallel_size=2))


@pytest.mark.parametrize(
    ("fields", "lends"),
    [
        ({}, True),
        ({"decode_tp": 2}, False),
        ({"prefill_tp": 2}, False),
        ({"prefill_tp": 2, "decode_tp": 2}, False),
        ({"decode_pp": 2}, False),
        ({"colocated": True, "decode_tp": 2}, True),  # nothing handed off
    ],
)
def test_host_tier_hand_offs_only_between_single_rank_workers(
    fields: dict[str, object], lends: bool
) -> None:
    """A hand-off reads host-tier blocks only between workers of one rank each (kv_transfer/
    plan.py refuses them otherwise): a cluster with a TP or PP worker turns the lending off
    in every role's engine rather than failing its hand-offs at transfer time."""
    s = spec(**fields)
    assert s.host_kv_handoff is lends
    for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
        assert s.engine_for(role).host_kv_handoff is lends
    off = ClusterSpec(engine=EngineConfig(model_dir="m", host_kv_handoff=False))
    assert off.engine_for(WorkerRole.PREFILL).host_kv_handoff is False


def test_capacity_counts_every_rank_of_a_tp_worker() -> None:
    s = spec(prefill_tp=2, decode_tp=4, placement=WorkerPlacement(default=GPU))
    asks = [(r.value, s.worker_asks(r)) for r in s.initial_roles()]
    assert asks == [("prefill", GPU.times(2)), ("decode", GPU.times(4))]
    assert capacity_shortfall(asks, {"GPU": 6, "CPU": 64}) is None
    assert capacity_shortfall(asks, {"GPU": 5, "CPU": 64}) == (
        "the workers need 6 GPU (decode 4, prefill 2) but this Ray has 5: on 5 GPU(s) run "
        "colocated workers (--colocated --decode 5)"
    )
    # a rebalance that would start one more TP=4 decode worker counts it as one worker
    why = rebalance_shortfall(asks, [("decode", GPU.times(4))], {"GPU": 8, "CPU": 64})
    assert why is not None and why.startswith("the rebalance would start 1 decode worker(s)")
    assert ActorPlacement(num_cpus=0.0).bundle() == {"CPU": 0.001}
    assert GPU.bundle() == {"GPU": 1.0, "CPU": 1.0}


def test_config_show_carries_the_tp_flags(tmp_path: Path) -> None:
    result = show(tmp_path, "--prefill-tp", "2", "--decode-tp", "4", "--kv-layout", "head_major")
    assert result.exit_code == 0, result.output
    tree = yaml.safe_load(result.output)
    assert (tree["workers"]["prefill_tp"], tree["workers"]["decode_tp"]) == (2, 4)
    assert tree["workers"]["engine"]["kv_layout"] == "head_major"
    flat = show(tmp_path, "--config", write_config(tmp_path, {"prefill_tp": 2}))
    assert yaml.safe_load(flat.output)["workers"]["prefill_tp"] == 2


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--prefill-tp", "0"], "--prefill-tp: must be >= 1, got 0"),
        (["--decode-tp", "3"], "--decode-tp: tensor_parallel_size=3 does not split llama: 8 "
                               "attention heads are not divisible by 3"),
        (["--prefill-tp", "2", "--kv-layout", "block_major"],
         "--kv-layout: prefill TP=2 over 8 KV heads, "
         "block_major_v1 → decode TP=1 over 8 KV heads, block_major_v1: each decode rank reads "
         "part of a block's KV heads, which is one region per block only in head_major_v1 on "
         "both sides (kv_layout head_major; `pdserve up` picks it when prefill and decode TP "
         "sizes differ)"),
        (["--kv-layout", "nhd"],  # the engine's own check, named by the flag that set it
         "--kv-layout: one of auto, block_major, head_major, layer_major, got 'nhd'"),
    ],
)  # fmt: skip
def test_up_refuses_tp_sizes_or_a_layout_that_cannot_serve_the_model(
    tmp_path: Path, starts: StartRecorder, args: list[str], line: str
) -> None:
    model = make_checkpoint(tmp_path / "model", EIGHT_KV_HEADS)
    assert_refused(up(tmp_path, "--model", str(model), *args), line, starts)


def test_up_takes_a_pair_of_tp_sizes_that_a_plan_serves(
    tmp_path: Path, starts: StartRecorder
) -> None:
    model = make_checkpoint(tmp_path / "model", EIGHT_KV_HEADS)
    result = up(tmp_path, "--model", str(model), "--prefill-tp", "2", "--decode-tp", "4")
    assert result.exit_code == 1, result.output  # got as far as starting (the stub refused)
    (config,) = starts.started
    workers = config.workers
    assert (workers.prefill_tp, workers.decode_tp, workers.kv_layout) == (2, 4, "head_major")
