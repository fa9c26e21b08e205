"""`pdserve up`'s options: flags over a YAML config file over the defaults.

The file is a mapping of the `up` flags (`prefill: 2`, `grpc_port: 0`, ...) plus sections:
`engine:` (EngineConfig fields), `thresholds:` and `tenants:` (admission), `placement:`
(`default` / `prefill` / `decode` Ray resources per worker), `router_resources:` and
`planner:` (PlannerSettings and PlannerConfig fields). Unknown keys and fields are refused with
their name, so a typo never falls back to a default silently. See docs/operations.md.

Every value is checked before anything starts (no Ray, no Redis): counts and ports are whole
numbers in range, and `--model` is a checkpoint folder the engine can load. A refusal is a
`typer.BadParameter` whose message starts with where the value came from (`--prefill`, or
`config prefill` for the file), so the CLI prints it as one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
import yaml

if TYPE_CHECKING:
    from deploy.cluster import ClusterOptions
    from deploy.workers import ActorPlacement
    from planner.loop import PlannerSettings


MAX_PORT = 65535


def load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise typer.BadParameter(f"--config: cannot read {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise typer.BadParameter(f"--config: {path} is not YAML{where}: {problem}") from e
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{path}: expected a mapping of option names")
    return data


def source(flag: Any, key: str) -> str:
    """How a refusal names a value: the flag when it was given, else the config file's key."""
    return f"--{key.replace('_', '-')}" if flag is not None else f"config {key}"


def check_count(value: Any, where: str, minimum: int = 0) -> int:
    """`value` when it is a whole number >= `minimum` (a bool or 2.5 is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise typer.BadParameter(f"{where}: expected a whole number, got {value!r}")
    if value < minimum:
        raise typer.BadParameter(f"{where}: must be >= {minimum}, got {value}")
    return value


def check_port(value: Any, where: str, replicas: int = 1) -> int:
    """A TCP port (0: a free one); `replicas` listen on value, value + 1, ... (all <= 65535)."""
    port = check_count(value, where)
    last = port + replicas - 1 if port else 0
    if last > MAX_PORT:
        span = f" (with {replicas} routers, up to {last})" if replicas > 1 else ""
        raise typer.BadParameter(f"{where}: must be a port in 0..{MAX_PORT}, got {port}{span}")
    return port


def check_seconds(value: Any, where: str, *, allow_zero: bool) -> float:
    """A finite number of seconds, > 0 (or >= 0 with `allow_zero`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise typer.BadParameter(f"{where}: expected a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise typer.BadParameter(f"{where}: must be a finite number {bound}, got {value}")
    return seconds


def check_model_dir(model_dir: str | None, where: str = "--model") -> None:
    """Refuse a folder the engine could not load, before anything starts: it must exist and
    hold a Llama-family config.json (read as the engine reads it), the *.safetensors files
    (every shard a model.safetensors.index.json lists) and tokenizer.json. None (the tiny
    model, written on demand) passes."""
    if model_dir is None:
        return
    from engine.model_config import ModelConfig
    from engine.weights import checkpoint_files  # what the loader reads, shards and all

    root = Path(model_dir)
    hint = "a Hugging Face checkpoint folder (`pdserve make-model DIR` writes one)"
    if not root.exists():
        raise typer.BadParameter(f"{where}: {model_dir} does not exist; expected {hint}")
    if not root.is_dir():
        raise typer.BadParameter(f"{where}: {model_dir} is not a folder; expected {hint}")
    config = root / "config.json"
    try:
        ModelConfig.from_pretrained(root)
    except FileNotFoundError as e:
        raise typer.BadParameter(f"{where}: {model_dir} has no config.json; expected {hint}") from e
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"{where}: {config} is not JSON: {e.msg} (line {e.lineno})") from e
    except ValueError as e:  # the engine's own words, e.g. an unsupported model_type
        raise typer.BadParameter(f"{where}: {model_dir}: {e}") from e
    except (KeyError, TypeError, AttributeError) as e:
        detail = f"no {e.args[0]!r}" if isinstance(e, KeyError) else str(e)
        raise typer.BadParameter(f"{where}: {config}: not a Llama-family config ({detail})") from e
    try:
        shards = checkpoint_files(root)
    except FileNotFoundError as e:
        raise typer.BadParameter(f"{where}: {model_dir} has no *.safetensors weights") from e
    except (ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(
            f"{where}: {root / 'model.safetensors.index.json'} has no usable weight_map"
        ) from e
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise typer.BadParameter(
            f"{where}: {model_dir} lacks weight files its index lists: {', '.join(missing)}"
        )
    if not (root / "tokenizer.json").is_file():
        raise typer.BadParameter(f"{where}: {model_dir} has no tokenizer.json")


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
    from planner.loop import PlannerSettings, settings_from_dict

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
    """Flags over the config file over the defaults; every count and port checked (the
    model folder is not: see `check_model_dir`)."""
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
    if model_dir is not None and not isinstance(model_dir, str):
        raise typer.BadParameter(f"config model: expected a folder path, got {model_dir!r}")
    is_colocated = pick(colocated, config, "colocated", False)
    if not isinstance(is_colocated, bool):
        raise typer.BadParameter(f"config colocated: expected true or false, got {is_colocated!r}")
    num_routers = check_count(pick(routers, config, "routers", 1), source(routers, "routers"), 1)
    port = check_port(
        pick(grpc_port, config, "grpc_port", 50051), source(grpc_port, "grpc_port"), num_routers
    )
    metrics = pick(metrics_port, config, "metrics_port", 9464)  # None (null): no metrics
    if metrics is not None:
        metrics = check_port(metrics, source(metrics_port, "metrics_port"), num_routers)
    engine_fields = {f.name for f in fields(EngineConfig)}
    engine_cfg = dict(config.get("engine") or {})
    unknown = set(engine_cfg) - engine_fields
    if unknown:
        raise typer.BadParameter(f"engine: unknown fields {sorted(unknown)}")
    try:
        engine = EngineConfig(model_dir=model_dir or "", **engine_cfg)
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(f"engine: {e}") from e
    router = None
    if config.get("thresholds") or config.get("tenants"):
        try:
            thresholds = AdmissionThresholds(**(config.get("thresholds") or {}))
        except (ValueError, TypeError) as e:
            raise typer.BadParameter(f"thresholds: {e}") from e
        router = RouterConfig(
            model_dir=model_dir or "",
            admission=AdmissionConfig(thresholds=thresholds),
            tenants=tuple(config.get("tenants") or ()),
        )
    return ClusterOptions(
        model_dir=model_dir,
        num_prefill=check_count(pick(prefill, config, "prefill", 1), source(prefill, "prefill")),
        num_decode=check_count(pick(decode, config, "decode", 1), source(decode, "decode"), 1),
        colocated=is_colocated,
        host=str(pick(host, config, "host", "127.0.0.1")),
        grpc_port=port,
        metrics_port=metrics,
        num_routers=num_routers,
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
