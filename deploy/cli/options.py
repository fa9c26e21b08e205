"""The config tree from the command line: the `--config` YAML file, then the flags over it,
over the defaults (`PdserveConfig`, deploy/control/config_tree.py).

A flag is one line of `FLAGS`: its name, the tree field it sets and its help; `up` and
`config show` both take every flag (`config_options`). The file is the tree itself (what
`pdserve config show` prints); the flat keys of the format before the tree (`prefill: 2`,
`engine:`, `thresholds:`, `placement:`, a flat `planner:` ...) are read too (`FLAT_KEYS`).
Unknown keys are refused with their path, so a typo never falls back to a default silently.
See docs/operations.md.

Every value is checked before anything starts (no Ray, no Redis): the tree's types and each
dataclass's own validation as the file is read, then counts and ports in range, and (`up`)
that the model is a checkpoint folder the engine can load. A refusal is a
`typer.BadParameter` whose message starts with where the value came from (`--prefill`, or
`config prefill` / `config workers.num_prefill` for the file, as the file spells it), so the
CLI prints it as one line.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

from engine.config import (
    FP8_ACTIVATION_SCALES,
    KV_CACHE_DTYPES,
    KV_LAYOUT_CHOICES,
    LOAD_FORMATS,
    QUANTIZATIONS,
)
from planner.predictive import PlannerMode
from router.prefill_cost import LocalPrefillPolicy
from vocabulary.block_hash import ALGORITHMS as HASH_ALGORITHMS

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig


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


def check_count(value: Any, where: str, minimum: int = 0) -> int:
    """`value` when it is a whole number >= `minimum` (a bool or 2.5 is not)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise typer.BadParameter(f"{where}: expected a whole number, got {value!r}")
    if value < minimum:
        raise typer.BadParameter(f"{where}: must be >= {minimum}, got {value}")
    return value


def check_model_fit(config: PdserveConfig, given: ConfigInput) -> None:
    """Refuse TP sizes and pipeline stages that cannot serve the model or a pair of layouts no
    hand-off reads (deploy/control/cluster_spec.py `tp_refusal`), and a `cost` local-prefill
    profile made for another model, block size, TP or dtype
    (`PdserveConfig.prefill_cost_model`), naming the flag or key at fault, before anything
    starts (the tiny model is written now if it is not there yet)."""
    from deploy.checkpoints.make_model import cached_tiny_model
    from planner.perf_profile import PerfProfileError
    from vocabulary.model_config import ModelConfig

    workers = config.workers
    if config.router.orchestrator.local_prefill.profile is not None:
        try:
            config.prefill_cost_model(config.model or str(cached_tiny_model()))
        except PerfProfileError as e:
            where = given.where("router.orchestrator.local_prefill.profile")
            raise typer.BadParameter(f"{where}: {e}") from None
    if workers.prefill_tp == workers.decode_tp == workers.prefill_pp == workers.decode_pp == 1:
        return
    model = ModelConfig.from_pretrained(config.model or cached_tiny_model())
    refusal = workers.tp_refusal(model)
    if refusal is not None:
        field, why = refusal
        raise typer.BadParameter(f"{given.where('workers.' + field)}: {why}")


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


def check_model_dir(model_dir: str | None, where: str = "--model", weights: bool = True) -> None:
    """Refuse a folder the engine could not load, before anything starts: it must exist and
    hold a Llama-family config.json (read as the engine reads it, its quantization_config
    too), the *.safetensors files (every shard a model.safetensors.index.json lists; not
    with `weights` False: --load-format dummy) and tokenizer.json. None (the tiny model,
    written on demand) passes."""
    if model_dir is None:
        return
    from engine.loading.checkpoint_scheme import read_checkpoint_scheme
    from engine.loading.hf_checkpoint import (
        checkpoint_files,  # what the loader reads, shards and all
    )
    from vocabulary.model_config import ModelConfig

    root = Path(model_dir)
    hint = "a Hugging Face checkpoint folder (`pdserve make-model DIR` writes one)"
    if not root.exists():
        raise typer.BadParameter(f"{where}: {model_dir} does not exist; expected {hint}")
    if not root.is_dir():
        raise typer.BadParameter(f"{where}: {model_dir} is not a folder; expected {hint}")
    config = root / "config.json"
    try:
        ModelConfig.from_pretrained(root)
        read_checkpoint_scheme(json.loads(config.read_text()))
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
        shards = checkpoint_files(root) if weights else []
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


def check_loras(
    loras: tuple[tuple[str, str], ...], model_dir: str | None, max_rank: int, where: str
) -> None:
    """Refuse, before anything starts, a LoRA adapter folder the engine would refuse: it must
    be a PEFT folder whose tensors fit the model (checked against `model_dir`'s config.json;
    for the tiny model, written on demand, only that the folder exists)."""
    from engine.lora.lora_adapter import read_adapter_spec
    from vocabulary.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(Path(model_dir)) if model_dir is not None else None
    for name, path in loras:
        if not Path(path).is_dir():
            raise typer.BadParameter(f"{where} {name}: {path} is not a folder (a PEFT adapter)")
        if cfg is None:
            continue
        try:
            read_adapter_spec(path, cfg, max_rank)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"{where} {name}: {e}") from e


# ---- flags ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One flag of `up` and `config show`: the tree field it sets (a dotted path)."""

    name: str
    """Parameter name; the flag is --name with dashes (`grpc_port`: --grpc-port)."""
    path: str
    """The field of PdserveConfig it sets (`workers.num_prefill`)."""
    type: type
    """int, float, str or bool (the field's type; tests check it)."""
    help: str
    """`--help` text; a [default] in it is the tree's default (tests check it)."""
    switch: str = ""
    """A bool flag's declaration: "--on" (given or not) or "--on/--off"."""
    choices: tuple[str, ...] = ()
    """The values a str flag takes (checked, from the flag or the file); empty: any."""
    repeated: bool = False
    """A str flag given any number of times as NAME=VALUE, setting a mapping field
    (`tuple[tuple[str, str], ...]`); the file's entries stay, the flag's win by name."""

    @property
    def option_type(self) -> Any:
        """The type typer parses the option's values into (a list of them when repeated)."""
        return list[self.type] if self.repeated else self.type  # type: ignore[name-defined]

    @property
    def option(self) -> str:
        return f"--{self.name.replace('_', '-')}"

    def argv(self, value: Any) -> list[str]:
        """The flag with `value` as command-line arguments again."""
        if self.repeated:
            return [arg for item in value for arg in (self.option, item)]
        if self.type is bool:
            on, _, off = (self.switch or self.option).partition("/")
            return [on if value else off]
        return [self.option, str(value)]


FLAGS: tuple[Flag, ...] = (
    Flag("model", "model", str, "Checkpoint folder (default: tiny model)."),
    Flag("prefill", "workers.num_prefill", int, "Prefill workers [1]."),
    Flag("decode", "workers.num_decode", int, "Decode workers [1]."),
    Flag("colocated", "workers.colocated", bool, "Baseline: no disaggregation.", "--colocated"),
    Flag("split", "workers.num_split", int, "Split workers: prefill and decode in one worker "
         "on one device, each loop in its own partition of the SMs [0]; with --split and "
         "neither --prefill nor --decode (flag or file), split workers only."),
    Flag("prefill_tp", "workers.prefill_tp", int, "Tensor-parallel ranks (devices, on one "
         "node) of each prefill worker [1]."),
    Flag("decode_tp", "workers.decode_tp", int, "Tensor-parallel ranks of each decode worker "
         "[1]; one that differs from --prefill-tp makes every worker's KV pool head-major."),
    Flag("prefill_pp", "workers.prefill_pp", int, "Pipeline stages of each prefill worker [1]: "
         "a worker is --prefill-pp x --prefill-tp ranks (devices), stage s holding its share "
         "of the layers (workers.prefill_pp_layers in the config file: each stage's count)."),
    Flag("decode_pp", "workers.decode_pp", int, "Pipeline stages of each decode worker [1] "
         "(workers.decode_pp_layers: each stage's layer count)."),
    Flag("kv_layout", "workers.engine.kv_layout", str, "KV pool layout: block_major, "
         "head_major, layer_major, or auto (disaggregated: head_major when prefill and "
         "decode TP differ, else block_major; colocated: layer_major on a GPU) [auto].",
         choices=KV_LAYOUT_CHOICES),
    Flag("grpc_port", "router.grpc_port", int, "gRPC port [50051]; 0: a free one."),
    Flag("metrics_port", "router.metrics_port", int, "Prometheus port [9464]; 0: a free one."),
    Flag("http_port", "router.http_port", int, "OpenAI-compatible HTTP API port [8000]; 0: a "
         "free one (http_port: null in the config file turns it off)."),
    Flag("redis_url", "cluster.redis_url", str, "Redis URL (default: start an embedded one)."),
    Flag("address", "cluster.address", str, "Ray address of a cluster (default: a local Ray)."),
    Flag("routers", "cluster.routers", int, "Router replicas [1]."),
    Flag("cluster_name", "cluster.name", str, "The cluster's name: its Ray namespace and its "
         "Redis keys' prefix; clusters of different names share a Ray cluster and a Redis "
         "[pdserve]."),
    Flag("host", "router.host", str, "Address routers bind [127.0.0.1]."),
    Flag("planner", "workers.planner.enabled", bool, "Run the planner (scales roles, asks Ray's "
         "autoscaler for nodes); off unless given.", "--planner/--no-planner"),
    Flag("planner_mode", "workers.planner.mode", str, "The planner: reactive (scale on "
         "latency, queue and rate over the SLOs) or predictive (worker targets from "
         "--planner-profile at a forecast load, a worker's start-up ahead; the reactive rules "
         "as a guard) [reactive].", choices=tuple(m.value for m in PlannerMode)),
    Flag("planner_profile", "workers.planner.predictive.profile", str, "The workers' "
         "`pdserve profile` file the predictive planner sizes each role with."),
    Flag("overlap_scheduling", "workers.engine.overlap_scheduling", bool, "Engines schedule "
         "and launch the next step while the device runs the current one [on].",
         "--overlap-scheduling/--no-overlap-scheduling"),
    Flag("quantization", "workers.engine.quantization", str, "Decoder weights: none or fp8 (e4m3, "
         "quantized at load; an FP8 checkpoint loads as FP8 anyway) [none].",
         choices=QUANTIZATIONS),
    Flag("fp8_activation_scales", "workers.engine.fp8_activation_scales", str, "FP8 "
         "activations: checkpoint (as the checkpoint declares, e.g. per token) or calibrated "
         "(opt-in: one static scale per projection, shared by every request; faster) "
         "[checkpoint].", choices=FP8_ACTIVATION_SCALES),
    Flag("kv_cache_dtype", "workers.engine.kv_cache_dtype", str, "KV cache: auto (the weights' "
         "dtype) or fp8 (e4m3, scales calibrated at load) [auto].", choices=KV_CACHE_DTYPES),
    Flag("load_format", "workers.engine.load_format", str, "Weights: auto (the checkpoint's) or "
         "dummy (random, made on the device from config.json) [auto].", choices=LOAD_FORMATS),
    Flag("host_kv_gb", "workers.engine.host_kv_gb", float, "Host-memory KV tier per worker, "
         "GiB: evicted prefix blocks kept in (pinned) RAM and onboarded on a hit; -1: a tenth "
         "of available RAM (at most 64 GiB, 8 device pools), 0: off [-1.0]."),
    Flag("migration_limit", "router.orchestrator.migration_limit", int, "Times a running "
         "request moves to other workers when its decode worker fails [3]; 0: never."),
    Flag("local_prefill_policy", "router.orchestrator.local_prefill.policy", str, "When a "
         "decode worker prefills a prompt itself: threshold (the uncached prompt is at most "
         "the admission threshold local_prefill_threshold_tokens) or cost (predicted from "
         "--prefill-cost-profile: the prefill queue, the streams a local prefill stalls, the "
         "hand-off) [threshold].", choices=tuple(p.value for p in LocalPrefillPolicy)),
    Flag("prefill_cost_profile", "router.orchestrator.local_prefill.profile", str, "The "
         "workers' `pdserve profile` file the cost policy predicts with (without one it is "
         "the threshold)."),
    Flag("admin_host", "router.admin_host", str, "Address the admin plane (status, drain, "
         "rebalance, thresholds) binds [127.0.0.1]."),
    Flag("admin_port", "router.admin_port", int, "Admin plane gRPC port [50151]; 0: a free one."),
    Flag("api_keys_file", "cluster.api_keys_file", str, "API keys file, one `KEY TENANT` or "
         "`KEY TENANT admin` per line (default: $PDSERVE_API_KEYS; none: auth off, loopback "
         "only)."),
    Flag("insecure", "cluster.insecure", bool, "Serve beyond loopback without API keys.",
         "--insecure"),
    Flag("tls_cert", "router.tls.cert_file", str, "PEM certificate: TLS on gRPC and HTTP."),
    Flag("tls_key", "router.tls.key_file", str, "PEM private key of --tls-cert."),
    Flag("tls_client_ca", "router.tls.client_ca_file", str, "PEM CA of client certificates "
         "(mutual TLS)."),
    Flag("enable_lora", "workers.engine.enable_lora", bool, "Serve LoRA adapters (on with any "
         "--lora; `pdserve lora load` needs it) [off].", "--enable-lora/--no-enable-lora"),
    Flag("lora", "workers.engine.loras", str, "A LoRA adapter to serve, NAME=PATH (a PEFT "
         "folder on the workers' disk); repeat for more. Requests name it in `lora` (gRPC) or "
         "`model` (HTTP).", repeated=True),
    Flag("max_loras", "workers.engine.max_loras", int, "LoRA adapters one engine step mixes "
         "(device slots per worker) [4]."),
    Flag("max_cpu_loras", "workers.engine.max_cpu_loras", int, "LoRA adapters each worker "
         "keeps in host memory (LRU) [8]."),
    Flag("max_lora_rank", "workers.engine.max_lora_rank", int, "Largest LoRA rank served "
         "[64]."),
    Flag("block_hash", "cluster.block_hash", str, "Prefix-cache block hash: xxh3, sha256, or auto "
         "(sha256 beyond loopback) [auto].", choices=("auto", *HASH_ALGORITHMS)),
)  # fmt: skip
"""Every flag that sets a field of the tree; the rest of the tree is set in the file."""

FLAT_KEYS: dict[str, str] = {
    "prefill": "workers.num_prefill",
    "decode": "workers.num_decode",
    "colocated": "workers.colocated",
    "split": "workers.num_split",
    "prefill_tp": "workers.prefill_tp",
    "decode_tp": "workers.decode_tp",
    "prefill_pp": "workers.prefill_pp",
    "decode_pp": "workers.decode_pp",
    "engine": "workers.engine",
    "placement": "workers.placement",
    "planner": "workers.planner",  # with PlannerConfig's fields beside the loop's
    "grpc_port": "router.grpc_port",
    "metrics_port": "router.metrics_port",
    "host": "router.host",
    "tenants": "router.tenants",
    "thresholds": "router.admission.thresholds",
    "redis_url": "cluster.redis_url",
    "address": "cluster.address",
    "routers": "cluster.routers",
    "router_resources": "cluster.router_resources",
}
"""Top-level keys of the flat format (before the tree) and the paths they stand for."""

CONFIG_HELP = (
    "YAML file of the config tree (`pdserve config show` prints one; flat keys such as "
    "`prefill: 2` are read too); flags win over it. See docs/operations.md."
)


@dataclass(frozen=True)
class ConfigArgs:
    """What a command line says about the config tree: the --config file and the flags given."""

    file: Path | None = None
    flags: Mapping[str, Any] = field(default_factory=dict)
    """Flag name -> value, for the flags given only."""

    def argv(self) -> list[str]:
        """The same as command-line arguments again (what the detached `up` is started with)."""
        argv = [arg for f in FLAGS if f.name in self.flags for arg in f.argv(self.flags[f.name])]
        return argv + (["--config", str(self.file.resolve())] if self.file else [])


def config_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with --config and every flag of FLAGS as options; it is called with
    `config=ConfigArgs(...)` in their place."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    signature = inspect.signature(command, eval_str=True)  # the Annotated options, not text
    own = [p.replace(kind=keyword) for p in signature.parameters.values() if p.name != "config"]
    added = [
        inspect.Parameter(
            "config", keyword, default=None,
            annotation=Annotated[Path | None, typer.Option(help=CONFIG_HELP)],
        ),
        *(
            inspect.Parameter(
                f.name, keyword, default=None,
                annotation=Annotated[
                    f.option_type | None,
                    typer.Option(*filter(None, [f.switch]), help=f.help),
                ],
            )
            for f in FLAGS
        ),
    ]  # fmt: skip

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        file = kwargs.pop("config")
        given = {f.name: kwargs.pop(f.name) for f in FLAGS}
        flags = {name: value for name, value in given.items() if value not in (None, [])}
        command(config=ConfigArgs(file, flags), **kwargs)

    params = [*added, *own]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


# ---- file + flags -> tree -------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigInput:
    """The file and the flags merged in the tree's shape (plain data, flags over the file),
    and where each value came from, for the refusals."""

    data: dict[str, Any]
    set_by_flag: dict[str, str]
    """Tree path -> the flag that set it."""
    file_keys: dict[str, str]
    """Tree path -> the file's own key for it, where the file used a flat key."""

    def get(self, path: str) -> Any:
        """The value given at `path` (None when none was)."""
        node: Any = self.data
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return node

    def where(self, path: str) -> str:
        """How a refusal names the value at `path`: its flag, else its key in the file."""
        if path in self.set_by_flag:
            return self.set_by_flag[path]
        for prefix in sorted(self.file_keys, key=len, reverse=True):
            if path == prefix or path.startswith((f"{prefix}.", f"{prefix}[")):
                return f"config {self.file_keys[prefix]}{path[len(prefix) :]}"
        return f"config {path}" if path else "config"


def read_config(args: ConfigArgs) -> ConfigInput:
    """The --config file (flat keys moved to their paths) with the flags given over it.
    Imports no Ray: `up` reads `cluster.address` from it before Ray is imported."""
    return config_input(load_config(args.file), args.flags)


def config_input(raw: dict[str, Any], flags: Mapping[str, Any]) -> ConfigInput:
    """`raw` (a config file's mapping) with `flags` (name -> value given) over it."""
    data = {k: v for k, v in raw.items() if k not in FLAT_KEYS}
    file_keys: dict[str, str] = {}
    for key, path in FLAT_KEYS.items():
        if key in raw:
            value = raw[key]
            if key == "planner" and isinstance(value, dict) and _flat_planner(value):
                value = _nested_planner(value)
                file_keys[f"{path}.config"] = key
            _put(data, path, value, f"config {key}", replace=False)
            file_keys[path] = key
    set_by_flag = {}
    for f in FLAGS:
        if f.name in flags:
            value = flags[f.name]
            if f.repeated:
                value = _merged_pairs(f, data, value)
            _put(data, f.path, value, f.option, replace=True)
            set_by_flag[f.path] = f.option
    if flags.get("split"):  # split workers alone, unless prefill or decode workers are asked for
        for path in ("workers.num_prefill", "workers.num_decode"):
            if path not in set_by_flag and _get(data, path) is None:
                _put(data, path, 0, "--split", replace=True)
                set_by_flag[path] = "--split"
    return ConfigInput(data, set_by_flag, file_keys)


def _get(data: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of the tree's plain data (None: not there)."""
    value: Any = data
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def effective_config(given: ConfigInput) -> PdserveConfig:
    """The tree `given` describes, every value checked (the model folder is not: see
    `check_model_dir`)."""
    from deploy.control.config_codec import ConfigError
    from deploy.control.config_tree import config_from_data

    try:
        config = config_from_data(given.data)
    except ConfigError as e:
        raise typer.BadParameter(f"{given.where(e.path)}: {e.problem}") from e
    routers = check_count(config.cluster.routers, given.where("cluster.routers"), 1)
    check_port(config.router.grpc_port, given.where("router.grpc_port"), routers)
    check_port(config.router.admin_port, given.where("router.admin_port"), routers)
    if config.router.metrics_port is not None:  # None (null): no metrics
        check_port(config.router.metrics_port, given.where("router.metrics_port"), routers)
    if config.router.http_port is not None:  # None (null): no HTTP API
        check_port(config.router.http_port, given.where("router.http_port"), routers)
    check_count(config.workers.num_prefill, given.where("workers.num_prefill"))
    check_count(config.workers.num_split, given.where("workers.num_split"))
    decode_at_least = 0 if config.workers.num_split else 1
    check_count(config.workers.num_decode, given.where("workers.num_decode"), decode_at_least)
    if not config.cluster.malloc_trim_s >= 0:  # also NaN
        raise typer.BadParameter(
            f"{given.where('cluster.malloc_trim_s')}: seconds between trims, >= 0 (0: off), "
            f"got {config.cluster.malloc_trim_s}"
        )
    check_count(config.cluster.malloc_arena_max, given.where("cluster.malloc_arena_max"))
    check_count(config.workers.prefill_tp, given.where("workers.prefill_tp"), 1)
    check_count(config.workers.decode_tp, given.where("workers.decode_tp"), 1)
    check_count(config.workers.prefill_pp, given.where("workers.prefill_pp"), 1)
    check_count(config.workers.decode_pp, given.where("workers.decode_pp"), 1)
    for f in FLAGS:
        if f.choices:
            value: Any = config
            for key in f.path.split("."):
                value = getattr(value, key)
            if value not in f.choices:
                raise typer.BadParameter(
                    f"{given.where(f.path)}: one of {', '.join(f.choices)}, got {value!r}"
                )
    return config


def _flat_planner(planner: dict[str, Any]) -> list[str]:
    """The keys of a `planner:` mapping that are not the loop's own (PlannerConfig's, which
    the flat format put beside them)."""
    from dataclasses import fields

    from planner.loop import PlannerSettings

    loop = {f.name for f in fields(PlannerSettings)}
    return [k for k in planner if k not in loop]


def _nested_planner(planner: dict[str, Any]) -> dict[str, Any]:
    flat = _flat_planner(planner)
    nested = {k: v for k, v in planner.items() if k not in flat}
    core = nested.get("config")
    nested["config"] = {**(core if isinstance(core, dict) else {}), **{k: planner[k] for k in flat}}
    return nested


def _merged_pairs(flag: Flag, data: dict[str, Any], items: list[str]) -> dict[str, Any]:
    """A repeated NAME=VALUE flag's items over the mapping the file gave at its path."""
    node: Any = data
    for key in flag.path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    merged = dict(node) if isinstance(node, dict) else {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise typer.BadParameter(f"{flag.option}: expected NAME=PATH, got {item!r}")
        merged[name.strip()] = str(Path(value.strip()).expanduser().absolute())
    return merged


def _put(data: dict[str, Any], path: str, value: Any, source: str, *, replace: bool) -> None:
    """Set `path` in `data`; without `replace`, a value already there is refused (the file
    gave it twice: a flat key and its path)."""
    *parents, leaf = path.split(".")
    node, walked = data, []
    for key in parents:
        walked.append(key)
        child = node.setdefault(key, {})
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise typer.BadParameter(
                f"config {'.'.join(walked)}: expected a mapping, got {child!r}"
            )
        node = child
    if not replace and leaf in node:
        raise typer.BadParameter(f"{source}: given twice, also as {path}")
    node[leaf] = value
