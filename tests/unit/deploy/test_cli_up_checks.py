"""`pdserve up` refuses bad values before anything starts (no Ray, no Redis, no daemon):
counts, ports and the wait timeout, from flags and from the --config file alike, and a
`--model` folder the engine could not load, a prefill-cost profile made for another model.
Each refusal is one line naming where the value came from, with exit code 2.

Before these checks, `up --prefill -1` started a cluster with no prefill worker, and
`up --model /nonexistent` started Ray and Redis, then failed inside the controller.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from sim_profiles import make_profile
from typer.testing import CliRunner

from deploy.cli.app import app

LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


class StartRecorder:
    """Stands in for what `up` starts: the foreground cluster and the detached daemon."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def spawn_detached(self, argv: list[str], log_path: Path, timeout_s: float) -> Any:
        self.started.append(argv)
        raise RuntimeError("stub: not starting a daemon in a unit test")


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> StartRecorder:
    recorder = StartRecorder()

    def cluster_start(cluster: Any) -> Any:
        recorder.started.append(cluster.config)
        raise RuntimeError("stub: not starting a cluster in a unit test")

    monkeypatch.setattr("deploy.control.launch.Cluster.start", cluster_start)
    monkeypatch.setattr("deploy.cli.daemon.spawn_detached", recorder.spawn_detached)
    return recorder


def up(tmp_path: Path, *args: str) -> Any:
    env = {"PDSERVE_STATE_FILE": str(tmp_path / "run" / "cluster.json")}
    return CliRunner().invoke(app, ["up", *args], env=env)


def write_config(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "pdserve.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def make_checkpoint(folder: Path, config: dict[str, Any] | None = None) -> Path:
    """What the model check looks for (the files' contents are the engine's business)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or LLAMA_CONFIG))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def assert_refused(result: Any, line: str, starts: StartRecorder) -> None:
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {line}\n"
    assert starts.started == []


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--prefill", "-1"], "--prefill: must be >= 0, got -1"),
        (["--decode", "0"], "--decode: must be >= 1, got 0"),
        (["--decode", "-3"], "--decode: must be >= 1, got -3"),
        (["--routers", "0"], "--routers: must be >= 1, got 0"),
        (["--grpc-port", "-1"], "--grpc-port: must be >= 0, got -1"),
        (["--grpc-port", "65536"], "--grpc-port: must be a port in 0..65535, got 65536"),
        (["--metrics-port", "70000"], "--metrics-port: must be a port in 0..65535, got 70000"),
        (
            ["--grpc-port", "65535", "--routers", "2"],
            "--grpc-port: must be a port in 0..65535, got 65535 (with 2 routers, up to 65536)",
        ),
        (["--timeout", "0"], "--timeout: must be a finite number > 0, got 0.0"),
        (["--timeout", "-5"], "--timeout: must be a finite number > 0, got -5.0"),
        (["--timeout", "nan"], "--timeout: must be a finite number > 0, got nan"),
        (["--timeout", "inf"], "--timeout: must be a finite number > 0, got inf"),
    ],
)
@pytest.mark.parametrize("detach", [False, True])
def test_bad_flags_are_refused_before_anything_starts(
    tmp_path: Path, starts: StartRecorder, args: list[str], line: str, detach: bool
) -> None:
    result = up(tmp_path, *args, *(["--detach"] if detach else []))
    assert_refused(result, line, starts)


@pytest.mark.parametrize(
    ("config", "line"),
    [
        ({"prefill": -1}, "config prefill: must be >= 0, got -1"),
        ({"decode": 0}, "config decode: must be >= 1, got 0"),
        ({"routers": 0}, "config routers: must be >= 1, got 0"),
        ({"grpc_port": 99999}, "config grpc_port: must be a port in 0..65535, got 99999"),
        ({"metrics_port": -2}, "config metrics_port: must be >= 0, got -2"),
        ({"prefill": "two"}, "config prefill: expected a whole number, got 'two'"),
        ({"prefill": 1.5}, "config prefill: expected a whole number, got 1.5"),
        ({"decode": True}, "config decode: expected a whole number, got True"),
        ({"colocated": "yes"}, "config colocated: expected true or false, got 'yes'"),
        ({"model": 7}, "config model: expected a string, got 7"),
        (
            {"cluster": {"malloc_arena_max": -1}},
            "config cluster.malloc_arena_max: must be >= 0, got -1",
        ),
        (
            {"cluster": {"malloc_arena_max": 1.5}},
            "config cluster.malloc_arena_max: expected a whole number, got 1.5",
        ),
    ],
)
def test_bad_config_values_are_refused_like_flags(
    tmp_path: Path, starts: StartRecorder, config: dict[str, Any], line: str
) -> None:
    result = up(tmp_path, "--config", write_config(tmp_path, config))
    assert_refused(result, line, starts)


def test_a_flag_over_a_bad_config_value_is_what_counts(
    tmp_path: Path, starts: StartRecorder
) -> None:
    result = up(tmp_path, "--config", write_config(tmp_path, {"prefill": -1}), "--prefill", "0")
    assert result.exit_code == 1, result.output  # got as far as starting (the stub refused)
    (config,) = starts.started
    assert config.workers.num_prefill == 0  # no prefill workers: decode prefills locally


def test_metrics_port_null_in_the_config_means_no_metrics(
    tmp_path: Path, starts: StartRecorder
) -> None:
    result = up(tmp_path, "--config", write_config(tmp_path, {"metrics_port": None}))
    assert result.exit_code == 1, result.output
    assert starts.started[0].router.metrics_port is None


def test_a_config_file_that_is_missing_or_not_yaml_is_one_line(
    tmp_path: Path, starts: StartRecorder
) -> None:
    missing = tmp_path / "nope.yaml"
    result = up(tmp_path, "--config", str(missing))
    assert_refused(result, f"--config: cannot read {missing}: No such file or directory", starts)
    broken = tmp_path / "broken.yaml"
    broken.write_text("prefill: [1\n")
    result = up(tmp_path, "--config", str(broken))
    assert result.exit_code == 2 and starts.started == []
    assert result.output.startswith(f"error: --config: {broken} is not YAML (line ")
    assert result.output.count("\n") == 1


def model_problem(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A broken checkpoint folder and the message naming what is wrong with it."""
    folder = tmp_path / "model"
    if case == "missing":
        return folder, f"{folder} does not exist; expected a Hugging Face checkpoint folder"
    if case == "file":
        folder.write_text("not a folder")
        return folder, f"{folder} is not a folder; expected a Hugging Face checkpoint folder"
    make_checkpoint(folder)
    if case == "no config":
        (folder / "config.json").unlink()
        return folder, f"{folder} has no config.json; expected a Hugging Face checkpoint folder"
    if case == "config not json":
        (folder / "config.json").write_text("{")
        return folder, f"{folder / 'config.json'} is not JSON: "
    if case == "unsupported":
        (folder / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "model_type": "gpt2"}))
        return folder, f"{folder}: config.json: model_type 'gpt2' is not supported"
    if case == "config lacks a field":
        config = {k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_size"}
        (folder / "config.json").write_text(json.dumps(config))
        return folder, f"{folder / 'config.json'}: not a Llama-family config (no 'hidden_size')"
    if case == "no weights":
        (folder / "model.safetensors").unlink()
        return folder, f"{folder} has no *.safetensors weights"
    if case == "missing shard":
        index = {"weight_map": {"a": "model-1-of-2.safetensors", "b": "model-2-of-2.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "model-1-of-2.safetensors").write_bytes(b"")
        return folder, f"{folder} lacks weight files its index lists: model-2-of-2.safetensors"
    if case == "no tokenizer":
        (folder / "tokenizer.json").unlink()
        return folder, f"{folder} has no tokenizer.json"
    raise AssertionError(case)


MODEL_CASES = ("missing", "file", "no config", "config not json", "unsupported",
               "config lacks a field", "no weights", "missing shard", "no tokenizer")  # fmt: skip


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_model_folder_the_engine_cannot_load_is_refused_before_anything_starts(
    tmp_path: Path, starts: StartRecorder, case: str
) -> None:
    folder, problem = model_problem(tmp_path, case)
    result = up(tmp_path, "--model", str(folder))
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: --model: {problem}"), result.output
    assert result.output.count("\n") == 1
    assert starts.started == []


def test_a_model_from_the_config_file_is_named_as_such(
    tmp_path: Path, starts: StartRecorder
) -> None:
    folder = tmp_path / "absent"
    result = up(tmp_path, "--config", write_config(tmp_path, {"model": str(folder)}), "--detach")
    assert result.exit_code == 2 and starts.started == []
    assert result.output.startswith(f"error: config model: {folder} does not exist")


def test_a_loadable_looking_model_folder_goes_on_to_start(
    tmp_path: Path, starts: StartRecorder
) -> None:
    folder = make_checkpoint(tmp_path / "model")
    result = up(tmp_path, "--model", str(folder))
    assert result.exit_code == 1, result.output  # the stub's refusal, after the checks
    assert "cluster failed to start: stub" in result.output
    assert starts.started[0].model == str(folder)
    (tmp_path / "sharded").mkdir()
    sharded = make_checkpoint(tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-1-of-1.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-1-of-1.safetensors").write_bytes(b"")
    result = up(tmp_path, "--model", str(sharded), "--detach")
    assert result.exit_code == 1, result.output
    assert starts.started[1][:2] == ["--model", str(sharded)]


def profile_for(tmp_path: Path, **header: Any) -> str:
    """A profile file of the checkpoint `make_checkpoint` writes (folder `model`), with
    `header` fields changed."""
    fits = {"model_id": "model", "num_layers": 2, "hidden_size": 64, "num_kv_heads": 2,
            "head_dim": 16}  # fmt: skip
    profile = make_profile()
    profile = replace(profile, header=replace(profile.header, **{**fits, **header}))
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        ({"model_id": "llama-3-8b"}, "profile model_id: made for 'llama-3-8b', but 'model'"),
        ({"num_layers": 32}, "profile num_layers: made for 32, but 2 was asked for"),
        ({"block_size": 32}, "profile block_size: made for 32, but 16 was asked for"),
        ({"tensor_parallel_size": 2}, "profile tensor_parallel_size: made for 2, but 1"),
    ],
)
def test_a_prefill_cost_profile_of_another_model_is_refused_naming_the_field(
    tmp_path: Path, starts: StartRecorder, header: dict[str, Any], problem: str
) -> None:
    folder = make_checkpoint(tmp_path / "model")
    profile = profile_for(tmp_path, **header)
    args = ["--model", str(folder), "--local-prefill-policy", "cost"]
    result = up(tmp_path, *args, "--prefill-cost-profile", profile)
    assert result.exit_code == 2 and starts.started == [], result.output
    assert result.output.startswith(f"error: --prefill-cost-profile: {problem}"), result.output
    in_file = {"router": {"orchestrator": {"local_prefill": {"profile": profile}}}}
    result = up(tmp_path, *args, "--config", write_config(tmp_path, in_file))
    assert result.exit_code == 2 and starts.started == [], result.output
    where = "config router.orchestrator.local_prefill.profile"
    assert result.output.startswith(f"error: {where}: {problem}"), result.output


def test_a_prefill_cost_profile_of_the_workers_goes_on_to_start(
    tmp_path: Path, starts: StartRecorder
) -> None:
    folder = make_checkpoint(tmp_path / "model")
    profile = profile_for(tmp_path)
    args = ["--model", str(folder), "--local-prefill-policy", "cost"]
    result = up(tmp_path, *args, "--prefill-cost-profile", profile)
    assert result.exit_code == 1, result.output  # the stub's refusal, after the checks
    local = starts.started[0].router.orchestrator.local_prefill
    assert (local.policy, local.profile, local.cost) == ("cost", profile, None)
    cost = starts.started[0].prefill_cost_model(str(folder))
    assert cost is not None and cost.source == f"{profile} (model)"
    result = up(tmp_path, "--model", str(folder), "--local-prefill-policy", "fast")
    assert result.exit_code == 2, result.output
    assert "--local-prefill-policy: one of threshold, cost, got 'fast'" in result.output
