"""The CLI without a cluster: --help everywhere, the config file (flags over file over
defaults; placement and planner sections; typos refused), and what `up --detach` hands on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from deploy.cli.app import app
from deploy.cli.options import ConfigArgs, config_input, effective_config, load_config
from planner.core import RoleBounds
from vocabulary.worker_api import ActorPlacement

COMMANDS = ("make-model", "up", "down", "status", "generate", "rebalance", "drain", "bench")


def options(config: dict[str, Any], **flags: Any) -> Any:
    return effective_config(config_input(config, flags))


def test_root_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    (callback,) = [
        c.callback
        for c in app.registered_commands
        if c.callback and (c.name or c.callback.__name__.replace("_", "-")) == command
    ]
    summary = (callback.__doc__ or "").splitlines()[0]
    assert summary and " ".join(summary.split()) in " ".join(result.output.split())


def test_up_help_documents_planner_config_and_address() -> None:
    out = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--planner", "--no-planner", "--config", "--address", "--redis-url",
                 "--detach", "--prefill", "--decode"):  # fmt: skip
        assert flag in out


def test_defaults_without_config() -> None:
    cfg = options({})
    assert (cfg.workers.num_prefill, cfg.workers.num_decode) == (1, 1)
    assert (cfg.router.grpc_port, cfg.router.metrics_port, cfg.cluster.address) == (
        50051,
        9464,
        None,
    )
    assert cfg.cluster.redis_url is None and not cfg.workers.planner.enabled
    assert cfg.workers.placement.prefill is None and cfg.workers.placement.decode is None


def test_config_file_then_flags_win(tmp_path: Path) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "prefill": 3,
                "decode": 2,
                "grpc_port": 6000,
                "address": "10.0.0.1:6379",
                "redis_url": "redis://10.0.0.2:6379/0",
                "engine": {"num_kv_blocks": 64, "max_model_len": 256},
                "thresholds": {"max_inflight_requests": 7},
                "placement": {
                    "default": {"num_cpus": 0},
                    "prefill": {"num_gpus": 1, "num_cpus": 2, "resources": {"prefill": 1}},
                    "decode": {"num_gpus": 1, "resources": {"decode": 1}},
                },
                "planner": {
                    "enabled": False,
                    "interval_s": 2,
                    "ttft_slo_ms": 800,
                    "prefill": {"max_workers": 4},
                },
            }
        )
    )
    cfg = options(load_config(path), prefill=1, grpc_port=7000, planner=True)
    workers = cfg.workers
    assert workers.num_prefill == 1 and cfg.router.grpc_port == 7000  # flags
    assert workers.num_decode == 2 and cfg.cluster.address == "10.0.0.1:6379"  # file
    assert cfg.cluster.redis_url == "redis://10.0.0.2:6379/0"
    assert workers.engine.num_kv_blocks == 64 and workers.engine.max_model_len == 256
    assert cfg.router.admission.thresholds.max_inflight_requests == 7
    assert workers.placement.default == ActorPlacement(num_cpus=0)
    assert workers.placement.prefill == ActorPlacement(
        num_gpus=1, num_cpus=2, resources=(("prefill", 1.0),)
    )
    assert workers.placement.decode == ActorPlacement(num_gpus=1, resources=(("decode", 1.0),))
    assert workers.planner.enabled  # --planner over the file's enabled: false
    assert workers.planner.interval_s == 2 and workers.planner.config.ttft_slo_ms == 800
    assert workers.planner.config.prefill == RoleBounds(1, 4)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"prefil": 2}, "config prefil: unknown key"),
        ({"engine": {"kv_blocks": 3}}, "config engine.kv_blocks: unknown key"),
        ({"placement": {"router": {}}}, "config placement.router: unknown key"),
        ({"placement": {"prefill": {"gpus": 1}}}, "config placement.prefill.gpus: unknown key"),
        ({"planner": {"ttft_slo": 1}}, "config planner.ttft_slo: unknown key"),
        ({"planner": {"prefill": {"min_workers": 3, "max_workers": 1}}}, "min <= max"),
    ],
)
def test_config_mistakes_are_refused_with_the_field_named(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(typer.BadParameter) as e:
        options(config)
    assert message in str(e.value)


def test_config_file_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(typer.BadParameter, match="expected a mapping"):
        load_config(path)


def test_up_refuses_a_bad_config_before_starting_anything(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("prefil: 2\n")
    result = CliRunner().invoke(
        app,
        ["up", "--config", str(path)],
        env={"PDSERVE_STATE_FILE": str(tmp_path / "state.json")},
    )
    assert result.exit_code == 2
    assert result.output == "error: config prefil: unknown key\n"


def test_detached_up_gets_the_given_options_only(tmp_path: Path) -> None:
    args = ConfigArgs(tmp_path / "c.yaml", {"prefill": 2, "grpc_port": 0, "planner": False})
    assert args.argv() == [
        "--prefill", "2", "--grpc-port", "0", "--no-planner",
        "--config", str((tmp_path / "c.yaml").resolve()),
    ]  # fmt: skip
