"""Pipeline-parallel workers in the config tree and the CLI: `--prefill-pp/--decode-pp` (and
`workers.prefill_pp_layers` / `decode_pp_layers` in the file) reach `workers`, each role's
engine gets its stages, the capacity checks count every rank (stages x TP ranks), and `up`
refuses stages that do not cut the model's layers, or a PP x TP pair no hand-off plan reads,
with the numbers named, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_cli_up_checks import StartRecorder, assert_refused, make_checkpoint, up, write_config
from test_config_tree import show

from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
from deploy.control.worker_actors import capacity_shortfall
from engine.config import EngineConfig, EngineMode
from vocabulary.worker_api import ActorPlacement, WorkerRole

starts = __import__("test_cli_up_checks").starts  # the fixture

GPU = ActorPlacement(num_gpus=1.0, num_cpus=1.0)
FOUR_LAYERS = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}  # fmt: skip


def spec(**fields: object) -> ClusterSpec:
    return ClusterSpec(engine=EngineConfig(model_dir="m"), **fields)  # type: ignore[arg-type]


def test_each_role_gets_its_stages_and_split_workers_stay_one_stage() -> None:
    s = spec(prefill_pp=2, prefill_tp=2, decode_pp=4, decode_pp_layers=(1, 1, 1, 1))
    prefill, decode = s.engine_for(WorkerRole.PREFILL), s.engine_for(WorkerRole.DECODE)
    assert (prefill.mode, prefill.pipeline_parallel_size, prefill.tensor_parallel_size) == (
        EngineMode.PREFILL_ONLY, 2, 2
    )  # fmt: skip
    assert (decode.pipeline_parallel_size, decode.pipeline_layer_partition) == (4, (1, 1, 1, 1))
    assert (prefill.num_ranks, s.ranks_for(WorkerRole.PREFILL), s.ranks_for(WorkerRole.DECODE)) == (
        4, 4, 4
    )  # fmt: skip
    assert s.kv_layout == "head_major"  # TP sizes differ
    assert spec(prefill_pp=2).kv_layout == "block_major"
    with pytest.raises(ValueError, match="set prefill_pp / decode_pp"):
        ClusterSpec(engine=EngineConfig(model_dir="m", pipeline_parallel_size=2))
    with pytest.raises(ValueError, match="decode_pp: split workers run on one device"):
        spec(num_split=1, decode_pp=2)


def test_capacity_counts_every_rank_of_every_stage() -> None:
    s = spec(prefill_pp=2, prefill_tp=2, placement=WorkerPlacement(default=GPU))
    asks = [(r.value, s.worker_asks(r)) for r in s.initial_roles()]
    assert asks == [("prefill", GPU.times(4)), ("decode", GPU.times(1))]
    assert capacity_shortfall(asks, {"GPU": 5, "CPU": 64}) is None
    assert capacity_shortfall(asks, {"GPU": 4, "CPU": 64}) == (
        "the workers need 5 GPU (decode 1, prefill 4) but this Ray has 4: on 4 GPU(s) run "
        "colocated workers (--colocated --decode 4)"
    )


def test_config_show_carries_the_pp_flags_and_layer_counts(tmp_path: Path) -> None:
    result = show(tmp_path, "--prefill-pp", "2", "--decode-pp", "4")
    assert result.exit_code == 0, result.output
    tree = yaml.safe_load(result.output)
    assert (tree["workers"]["prefill_pp"], tree["workers"]["decode_pp"]) == (2, 4)
    cut = {"workers": {"prefill_pp": 2, "prefill_pp_layers": [1, 3]}}
    flat = show(tmp_path, "--config", write_config(tmp_path, cut))
    assert yaml.safe_load(flat.output)["workers"]["prefill_pp_layers"] == [1, 3]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--prefill-pp", "0"], "--prefill-pp: must be >= 1, got 0"),
        (["--prefill-pp", "3"], "--prefill-pp: 3 pipeline stages do not divide the model's 4 "
                                "layers (give a layer partition, e.g. 2,1,1)"),
        (["--decode-pp", "8"], "--decode-pp: 8 pipeline stages over 4 layers: a stage needs a "
                               "layer"),
        (["--prefill-pp", "2", "--prefill-tp", "2", "--kv-layout", "block_major"],
         "--kv-layout: prefill PP=2 over 4 layers (bounds 0,2,4) x TP=2 over 8 KV heads, "
         "block_major_v1 → decode TP=1 over 8 KV heads, block_major_v1: each decode rank reads "
         "part of a block's KV heads, which is one region per block only in head_major_v1 on "
         "both sides (kv_layout head_major; `pdserve up` picks it when prefill and decode TP "
         "sizes differ)"),
    ],
)  # fmt: skip
def test_up_refuses_stages_or_a_layout_that_cannot_serve_the_model(
    tmp_path: Path, starts: StartRecorder, args: list[str], line: str
) -> None:
    model = make_checkpoint(tmp_path / "model", FOUR_LAYERS)
    assert_refused(up(tmp_path, "--model", str(model), *args), line, starts)


def test_up_refuses_a_layer_partition_that_does_not_sum_naming_the_key(
    tmp_path: Path, starts: StartRecorder
) -> None:
    model = make_checkpoint(tmp_path / "model", FOUR_LAYERS)
    config = write_config(tmp_path, {"workers": {"decode_pp": 2, "decode_pp_layers": [1, 2]}})
    result = up(tmp_path, "--model", str(model), "--config", config)
    assert result.exit_code == 2, result.output
    assert "workers.decode_pp_layers" in result.output
    assert (
        "layer partition 1,2: needs 2 positive counts (one per stage) summing to the "
        "model's 4 layers" in result.output
    )
    assert starts.started == []


def test_up_takes_a_pp_pair_that_a_plan_serves(tmp_path: Path, starts: StartRecorder) -> None:
    model = make_checkpoint(tmp_path / "model", FOUR_LAYERS)
    result = up(tmp_path, "--model", str(model), "--prefill-pp", "2", "--decode-tp", "2")
    assert result.exit_code == 1, result.output  # got as far as starting (the stub refused)
    (config,) = starts.started
    workers = config.workers
    assert (workers.prefill_pp, workers.decode_pp, workers.decode_tp) == (2, 1, 2)
    assert workers.kv_layout == "head_major"


def test_status_shows_a_pipeline_worker_as_one_worker_of_its_stages_and_ranks() -> None:
    from deploy.cli.cluster_client import device_column

    assert device_column("cuda:0", 1, 1) == "cuda:0"
    assert device_column("cuda:0", 2, 1) == "cuda:0 x2"
    assert device_column("cuda:0", 2, 2) == "cuda:0 x4 (PP2 x TP2)"
    assert device_column("cpu", 1, 4) == "cpu x4 (PP4 x TP1)"
