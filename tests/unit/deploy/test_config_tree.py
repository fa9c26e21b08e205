"""The config tree (deploy/control/config_tree.py): `pdserve config show` prints the YAML that
`--config` reads back to the same tree, unknown keys and wrong types are refused naming their path,
the flat keys of the earlier format mean what they meant, each flag sets the field it names, and
what pdserve fills in (model, Redis, ports per replica) is filled in and not read."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from sim_profiles import make_profile
from typer.testing import CliRunner

from admission.config import AdmissionConfig, TenantLimit
from deploy.cli.app import app
from deploy.cli.options import FLAGS, FLAT_KEYS, config_input, effective_config
from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
from deploy.control.config_codec import ConfigError, from_data, to_data, type_at
from deploy.control.config_tree import (
    FILLED_IN,
    LaunchConfig,
    PdserveConfig,
    config_from_data,
    config_yaml,
)
from engine.config import EngineConfig
from kv_transfer.config import DescriptorMode
from planner.core import PlannerConfig, RoleBounds
from planner.loop import PlannerSettings
from router.router_server import RouterConfig, RouterLimits
from vocabulary.worker_api import ActorPlacement

CONFIGS = Path(__file__).parents[3] / "deploy" / "configs"


def show(tmp_path: Path, *args: str) -> Any:
    env = {"PDSERVE_STATE_FILE": str(tmp_path / "run" / "cluster.json")}
    return CliRunner().invoke(app, ["config", "show", *args], env=env)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def a_tree_unlike_the_defaults() -> PdserveConfig:
    """Every kind of field set away from its default: nested sections, None and not None
    optionals, a tuple of dataclasses, a mapping of pairs, an enum, a float given whole."""
    return PdserveConfig(
        model="/models/llama",
        cluster=LaunchConfig(
            address="10.0.0.1:6379", routers=3, router_resources=(("head", 1.0), ("b", 0.5))
        ),
        router=RouterConfig(
            host="0.0.0.0",
            grpc_port=6000,
            metrics_port=None,
            tenants=("a", "b"),
            admission=AdmissionConfig(
                tenant_limits=(TenantLimit("a", 10.0, 20.0), TenantLimit("b", 1.0, 2.0)),
                default_tenant_limit=TenantLimit("", 5.0, 5.0),
            ),
            limits=RouterLimits(max_concurrent_requests=7),
        ),
        workers=ClusterSpec(
            engine=EngineConfig(model_dir="", device="cpu", num_kv_blocks=64, model_id="m"),
            num_prefill=0,
            num_decode=2,
            placement=WorkerPlacement(
                default=ActorPlacement(num_cpus=0.0),
                prefill=ActorPlacement(num_gpus=1.0, resources=(("prefill", 1.0),)),
            ),
            transfer=replace(ClusterSpec().transfer, descriptor_mode=DescriptorMode.COALESCED),
            planner=PlannerSettings(
                enabled=True,
                trace_path="/tmp/trace.jsonl",
                config=PlannerConfig(prefill=RoleBounds(0, 4), decode_capacity_tokens_per_s=9.5),
            ),
        ),
    )


# ---- the round trip -------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [PdserveConfig(), a_tree_unlike_the_defaults()])
def test_a_tree_written_as_yaml_reads_back_equal(tree: PdserveConfig) -> None:
    assert config_from_data(yaml.safe_load(config_yaml(tree))) == tree


def test_config_show_fed_back_through_config_gives_the_same_tree(tmp_path: Path) -> None:
    flat = (CONFIGS / "pdserve-gpu.yaml").read_text()  # the shipped file, flat keys
    first = show(tmp_path, "--config", write(tmp_path, "gpu.yaml", flat), "--prefill", "3")
    assert first.exit_code == 0, first.output
    again = show(tmp_path, "--config", write(tmp_path, "shown.yaml", first.output))
    assert again.exit_code == 0, again.output
    assert again.output == first.output
    from_flat = effective_config(config_input(yaml.safe_load(flat), {"prefill": 3}))
    assert config_from_data(yaml.safe_load(first.output)) == from_flat
    assert from_flat.workers.num_prefill == 3  # the flag over the file's 2
    assert from_flat.workers.planner.config.prefill == RoleBounds(1, 16)  # flat planner keys


def test_config_show_without_a_file_prints_the_defaults(tmp_path: Path) -> None:
    result = show(tmp_path)
    assert result.exit_code == 0, result.output
    assert config_from_data(yaml.safe_load(result.output)) == PdserveConfig()
    assert list(yaml.safe_load(result.output)) == ["model", "cluster", "router", "workers"]


def test_fields_that_pdserve_fills_in_are_neither_shown_nor_read(tmp_path: Path) -> None:
    shown = yaml.safe_load(config_yaml(PdserveConfig()))
    for path in FILLED_IN:
        *parents, leaf = path.split(".")
        node = shown
        for key in parents:
            node = node[key]
        assert leaf not in node, path
    result = show(tmp_path, "--config", write(tmp_path, "c.yaml", "router: {redis_url: x}\n"))
    assert result.exit_code == 2
    assert (
        result.output
        == "error: config router.redis_url: filled in by pdserve, not read from a file\n"
    )


def test_the_controller_and_each_router_get_the_running_clusters_facts() -> None:
    tree = replace(
        a_tree_unlike_the_defaults(), router=RouterConfig(grpc_port=6000, metrics_port=9000)
    )
    spec = tree.controller_spec("/models/llama", "redis://r:1/0", fixed_capacity=True)
    assert spec == replace(
        tree.workers,
        engine=replace(tree.workers.engine, model_dir="/models/llama"),
        redis_url="redis://r:1/0",
        fixed_capacity=True,
    )
    second = tree.replica_config(1, "/models/llama", "redis://r:1/0")
    assert second == replace(
        tree.router,
        model_dir="/models/llama",
        model_id="m",  # the engine's, the same on both sides
        redis_url="redis://r:1/0",
        index=tree.workers.index,
        grpc_port=6001,
        metrics_port=9001,
    )
    free = replace(tree, router=RouterConfig(grpc_port=0, metrics_port=0), workers=ClusterSpec())
    third = free.replica_config(2, "/m/tiny", "redis://r:1/0")
    assert (third.grpc_port, third.metrics_port, third.model_id) == (0, 0, "tiny")
    off = replace(tree, router=RouterConfig(metrics_port=None)).replica_config(1, "/m", "r")
    assert off.metrics_port is None


def test_each_router_replica_gets_the_cost_policys_step_times() -> None:
    tree = PdserveConfig()
    assert tree.prefill_cost_model("/no/model") is None  # threshold: no profile is read
    model = make_profile().prefill_cost_model()
    replica = tree.replica_config(0, "/m/tiny", "redis://r:1/0", prefill_cost=model)
    assert replica.orchestrator.local_prefill.cost is model
    assert (
        "cost" not in yaml.safe_load(config_yaml(tree))["router"]["orchestrator"]["local_prefill"]
    )


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("workers: {engine: {kv_blocks: 3}}\n",
         "config workers.engine.kv_blocks: unknown key (did you mean 'num_kv_blocks'?)"),
        ("router: {admission: {thresholds: {max_ttft: 1}}}\n",
         "config router.admission.thresholds.max_ttft: unknown key"),
        ("clusters: {routers: 2}\n", "config clusters: unknown key (did you mean 'cluster'?)"),
        ("workers: {planner: {ttft_slo_ms: 1}}\n",
         "config workers.planner.ttft_slo_ms: unknown key"),  # the tree form is not flat
        ("engine: {block_size: x}\n", "config engine.block_size: expected a whole number, got 'x'"),
        ("workers: {transfer: {descriptor_mode: fast}}\n",
         "config workers.transfer.descriptor_mode: expected one of prepped, coalesced, "
         "per_block, got 'fast'"),
        ("router: {admission: {tenant_limits: [{tenant: a, tokens_per_s: 1}]}}\n",
         "config router.admission.tenant_limits[0].burst_tokens: must be set with tokens_per_s"),
        ("placement: {default: {resources: {gpu-node: many}}}\n",
         "config placement.default.resources.gpu-node: expected a number, got 'many'"),
        ("router: {tenants: abc}\n", "config router.tenants: expected a list, got 'abc'"),
        ("workers: 5\n", "config workers: expected a mapping, got 5"),
        ("prefill: 2\nworkers: {num_prefill: 3}\n",
         "config prefill: given twice, also as workers.num_prefill"),
        ("thresholds: {max_inflight_requests: 0}\n",
         "config thresholds.max_inflight_requests: must be >= 1, got 0"),
        ("cluster: {routers: 0}\n", "config cluster.routers: must be >= 1, got 0"),
        ("workers: {num_decode: 0}\n", "config workers.num_decode: must be >= 1, got 0"),
        ("router: {orchestrator: {local_prefill: {policy: fast}}}\n",
         "config router.orchestrator.local_prefill.policy: one of threshold, cost, got 'fast'"),
        ("router: {orchestrator: {local_prefill: {cost: {}}}}\n",
         "config router.orchestrator.local_prefill.cost: filled in by pdserve, not read from a "
         "file"),
    ],
)  # fmt: skip
def test_a_config_mistake_is_one_line_naming_its_key_path(
    tmp_path: Path, text: str, line: str
) -> None:
    result = show(tmp_path, "--config", write(tmp_path, "c.yaml", text))
    assert result.exit_code == 2, result.output
    assert result.output == f"error: {line}\n"


def test_a_flag_is_named_in_a_refusal_of_its_value(tmp_path: Path) -> None:
    config = write(tmp_path, "c.yaml", "workers: {num_prefill: -1}\n")
    result = show(tmp_path, "--config", config, "--prefill", "-2")
    assert result.output == "error: --prefill: must be >= 0, got -2\n"
    assert show(tmp_path, "--config", config, "--prefill", "0").exit_code == 0


def test_the_codec_refuses_a_type_it_cannot_write() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Odd:
        table: dict[str, int]

    with pytest.raises(TypeError, match="unsupported field type"):
        to_data(Odd({}))
    with pytest.raises(ConfigError, match="table: missing"):
        from_data(Odd, {})


# ---- flags and flat keys --------------------------------------------------------------------


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_each_flag_sets_the_field_it_names_with_its_type_and_default(flag: Any) -> None:
    if flag.repeated:  # NAME=VALUE items of a mapping
        assert type_at(PdserveConfig, flag.path) == tuple[tuple[str, flag.type], ...]
        tree = effective_config(config_input({}, {flag.name: ["a=/x", "b=/y", "a=/z"]}))
        for key in flag.path.split("."):
            tree = getattr(tree, key)
        assert tree == (("a", "/z"), ("b", "/y"))
        return
    assert type_at(PdserveConfig, flag.path) is flag.type
    default: Any = PdserveConfig()
    for key in flag.path.split("."):
        default = getattr(default, key)
    shown = re.findall(r"\[([^\]]+)\]", flag.help)
    if shown:
        as_shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
        assert shown == [as_shown]
    value = (
        flag.choices[-1] if flag.choices else {bool: True, int: 7, float: 2.5, str: "x"}[flag.type]
    )
    tree = effective_config(config_input({}, {flag.name: value}))
    for key in flag.path.split("."):
        tree = getattr(tree, key)
    assert tree == value


@pytest.mark.parametrize("command", [["up"], ["config", "show"]])
def test_up_and_config_show_take_every_flag(command: list[str]) -> None:
    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output
    for flag in FLAGS:
        assert (flag.switch or flag.option).split("/")[0] in out
    assert "--config" in out


def test_every_flat_key_stands_for_a_field_of_the_tree() -> None:
    for key, path in FLAT_KEYS.items():
        type_at(PdserveConfig, path)  # raises KeyError when there is none
        assert key not in ("model", "cluster", "router", "workers")


def test_a_flat_file_and_its_tree_form_are_the_same_tree() -> None:
    flat = {
        "prefill": 2, "decode": 3, "colocated": False, "grpc_port": 0, "metrics_port": None,
        "host": "0.0.0.0", "redis_url": "redis://r:1/0", "address": "auto", "routers": 2,
        "engine": {"device": "cpu"}, "thresholds": {"max_inflight_requests": 7},
        "tenants": ["a"], "router_resources": {"head": 1},
        "placement": {"decode": {"num_cpus": 2}},
        "planner": {"enabled": True, "interval_s": 2, "ttft_slo_ms": 800,
                    "prefill": {"max_workers": 4}},
    }  # fmt: skip
    tree = {
        "workers": {
            "num_prefill": 2, "num_decode": 3, "colocated": False,
            "engine": {"device": "cpu"}, "placement": {"decode": {"num_cpus": 2}},
            "planner": {"enabled": True, "interval_s": 2,
                        "config": {"ttft_slo_ms": 800, "prefill": {"max_workers": 4}}},
        },
        "router": {"grpc_port": 0, "metrics_port": None, "host": "0.0.0.0", "tenants": ["a"],
                   "admission": {"thresholds": {"max_inflight_requests": 7}}},
        "cluster": {"redis_url": "redis://r:1/0", "address": "auto", "routers": 2,
                    "router_resources": {"head": 1}},
    }  # fmt: skip
    assert effective_config(config_input(flat, {})) == effective_config(config_input(tree, {}))


def test_up_reads_the_ray_address_before_building_the_tree() -> None:
    assert config_input({"address": "auto"}, {}).get("cluster.address") == "auto"
    assert (
        config_input({"cluster": {"address": "a"}}, {"address": "b"}).get("cluster.address") == "b"
    )
    assert config_input({}, {}).get("cluster.address") is None


def test_refusals_from_the_file_are_typer_bad_parameters() -> None:
    with pytest.raises(typer.BadParameter, match=r"^config engine\.seed: expected a whole"):
        effective_config(config_input({"engine": {"seed": 1.5}}, {}))


def test_a_repeated_flag_adds_to_the_files_mapping_and_refuses_a_bad_item() -> None:
    raw = {"workers": {"engine": {"loras": {"a": "/file/a", "b": "/file/b"}}}}
    tree = effective_config(config_input(raw, {"lora": ["b=/flag/b", "c=/flag/c"]}))
    assert tree.workers.engine.loras == (("a", "/file/a"), ("b", "/flag/b"), ("c", "/flag/c"))
    with pytest.raises(typer.BadParameter, match="--lora: expected NAME=PATH, got 'nopath'"):
        config_input({}, {"lora": ["nopath"]})
