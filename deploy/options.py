"""`pdserve up`'s options: flags over a YAML config file over the defaults.

The file is a mapping of the `up` flags (`prefill: 2`, `grpc_port: 0`, ...) plus sections:
`engine:` (EngineConfig fields), `thresholds:` and `tenants:` (admission), `placement:`
(`default` / `prefill` / `decode` Ray resources per worker), `router_resources:` and
`planner:` (PlannerSettings and PlannerConfig fields). Unknown keys and fields are refused with
their name, so a typo never falls back to a default silently. See docs/operations.md.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

if TYPE_CHECKING:
    from deploy.cluster import ClusterOptions
    from deploy.planner_loop import PlannerSettings
    from deploy.workers import ActorPlacement


def load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path}: expected a mapping of option names")
    return data


def pick(flag: Any, config: dict[str, Any], key: str, default: Any) -> Any:
    if flag is not None:
        return flag
    return config.get(key, default)


CONFIG_KEYS = frozenset(
    {
        "model", "prefill", "decode", "colocated", "grpc_port", "metrics_port", "redis_url",
        "address", "routers", "host", "engine", "thresholds", "tenants", "planner", "placement",
        "router_resources",
    }
)  # fmt: skip


def _placement(data: Any, where: str) -> ActorPlacement | None:
    from deploy.workers import ActorPlacement

    if data is None:
        return None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{where}: expected a mapping")
    unknown = set(data) - {"num_gpus", "num_cpus", "resources", "max_restarts"}
    if unknown:
        raise typer.BadParameter(f"{where}: unknown fields {sorted(unknown)}")
    resources = tuple(sorted((str(k), float(v)) for k, v in (data.get("resources") or {}).items()))
    return ActorPlacement(
        num_gpus=float(data.get("num_gpus", 0.0)),
        num_cpus=float(data.get("num_cpus", 0.5)),
        resources=resources,
        max_restarts=int(data.get("max_restarts", 0)),
    )


def _planner_settings(data: Any, enabled: bool | None) -> PlannerSettings:
    from deploy.planner_loop import PlannerSettings, settings_from_dict

    if data is not None and not isinstance(data, dict):
        raise typer.BadParameter("planner: expected a mapping")
    try:
        settings = settings_from_dict(dict(data or {})) if data else PlannerSettings()
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(f"planner: {e}") from e
    if enabled is not None:
        settings = replace(settings, enabled=enabled)
    return settings


def build_options(
    config: dict[str, Any],
    model: str | None,
    prefill: int | None,
    decode: int | None,
    colocated: bool | None,
    grpc_port: int | None,
    metrics_port: int | None,
    redis_url: str | None,
    address: str | None,
    routers: int | None,
    host: str | None,
    planner: bool | None = None,
) -> ClusterOptions:
    """Flags over the config file over the defaults."""
    from dataclasses import fields

    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.cluster import ClusterOptions
    from engine.config import EngineConfig
    from router.server import RouterConfig

    unknown_keys = set(config) - CONFIG_KEYS
    if unknown_keys:
        raise typer.BadParameter(f"config: unknown keys {sorted(unknown_keys)}")
    placement = config.get("placement") or {}
    if not isinstance(placement, dict):
        raise typer.BadParameter("placement: expected a mapping")
    unknown_roles = set(placement) - {"default", "prefill", "decode"}
    if unknown_roles:
        raise typer.BadParameter(f"placement: unknown roles {sorted(unknown_roles)}")

    model_dir = pick(model, config, "model", None)
    engine_fields = {f.name for f in fields(EngineConfig)}
    engine_cfg = dict(config.get("engine") or {})
    unknown = set(engine_cfg) - engine_fields
    if unknown:
        raise typer.BadParameter(f"engine: unknown fields {sorted(unknown)}")
    engine = EngineConfig(model_dir=model_dir or "", **engine_cfg)
    router = None
    if config.get("thresholds") or config.get("tenants"):
        thresholds = AdmissionThresholds(**(config.get("thresholds") or {}))
        router = RouterConfig(
            model_dir=model_dir or "",
            admission=AdmissionConfig(thresholds=thresholds),
            tenants=tuple(config.get("tenants") or ()),
        )
    return ClusterOptions(
        model_dir=model_dir,
        num_prefill=int(pick(prefill, config, "prefill", 1)),
        num_decode=int(pick(decode, config, "decode", 1)),
        colocated=bool(pick(colocated, config, "colocated", False)),
        host=str(pick(host, config, "host", "127.0.0.1")),
        grpc_port=int(pick(grpc_port, config, "grpc_port", 50051)),
        metrics_port=pick(metrics_port, config, "metrics_port", 9464),
        num_routers=int(pick(routers, config, "routers", 1)),
        redis_url=pick(redis_url, config, "redis_url", None),
        address=pick(address, config, "address", None),
        engine=engine,
        router=router,
        placement=_placement(placement.get("default"), "placement.default"),
        prefill_placement=_placement(placement.get("prefill"), "placement.prefill"),
        decode_placement=_placement(placement.get("decode"), "placement.decode"),
        router_resources=tuple(
            sorted((str(k), float(v)) for k, v in (config.get("router_resources") or {}).items())
        ),
        planner=_planner_settings(config.get("planner"), planner),
    )
