"""The config tree of a pdserve cluster: one frozen dataclass whose fields are the parts each
component takes whole.

    PdserveConfig
    ├── model                    checkpoint folder (None: the tiny model)
    ├── cluster: LaunchConfig    Ray, Redis, router replicas
    ├── router: RouterConfig     (router/router_server.py) host, ports, tenants,
    │                            admission, orchestrator, view, limits
    └── workers: ClusterSpec     (deploy/control/cluster_spec.py) counts, engine, transfer, index,
                                 placement, health, planner

`pdserve up` builds it once from the `--config` file and the flags (deploy/cli/options.py) and
hands it to `Cluster`; `pdserve config show` prints it as the YAML that `--config` reads.
The YAML is the tree itself (`config_codec`), with the fields' docstrings as its reference.
The controller gets `workers` and each router replica gets `router`, with what only the
running cluster knows filled in (`controller_spec`, `replica_config`): those fields
(`FILLED_IN`) are not read from a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from deploy.control.cluster_spec import ClusterSpec
from deploy.control.config_codec import from_data, to_data
from planner.perf_profile import load_perf_profile
from prefix_index.config import PrefixIndexConfig
from router.auth import ApiKey
from router.metrics import SloTargets
from router.prefill_cost import LocalPrefillPolicy, PrefillCostModel
from router.router_server import RouterConfig
from vocabulary.block_hash import ALGORITHMS
from vocabulary.model_config import ModelConfig

DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000
DEFAULT_ADMIN_PORT = 50151
BLOCK_HASHES = ("auto", *ALGORITHMS)
DEFAULT_CLUSTER_NAME = "pdserve"


@dataclass(frozen=True)
class LaunchConfig:
    """What `Cluster.start` sets up around the controller: Ray, Redis and the routers."""

    name: str = DEFAULT_CLUSTER_NAME
    """The cluster's name: the Ray namespace its controller, routers and workers are named in,
    and the prefix of its prefix-index keys in Redis. Clusters of different names share one
    Ray cluster (and one Redis) without touching each other."""
    address: str | None = None
    """Ray address of an existing cluster; None starts a local Ray."""
    redis_url: str | None = None
    """Redis of the prefix index; None starts an embedded redis-server on a free loopback
    port."""
    routers: int = 1
    """Router replicas; replica i listens on router.grpc_port + i (http_port + i,
    metrics_port + i)."""
    router_resources: tuple[tuple[str, float], ...] = ()
    """Custom Ray resources each router asks for, to pin routers to the nodes that have them
    (e.g. the head pod behind a Kubernetes Service); empty: anywhere."""
    num_cpus: int | None = None
    """CPUs a local Ray advertises (None: what Ray detects)."""
    object_store_bytes: int = 256 << 20
    """Object store of a local Ray."""
    api_keys_file: str | None = None
    """API keys file (`KEY TENANT [admin]` lines, router/auth.py), read by `pdserve up`; None:
    $PDSERVE_API_KEYS, else no keys (auth off: loopback only, unless `insecure`)."""
    insecure: bool = False
    """Serve beyond loopback without API keys (anyone who reaches the ports may generate,
    drain and rebalance). Refused otherwise."""
    block_hash: str = "auto"
    """Block-hash algorithm of every router and worker: xxh3 (fast, craftable collisions),
    sha256 (collision resistant), or auto: sha256 when a router listens beyond loopback."""
    malloc_trim_s: float = 60.0
    """Seconds between two `malloc_trim(0)` calls in every process of the cluster (the
    controller, routers, workers and their ranks), which hand glibc's free pages back to the
    system (vocabulary/malloc_trim.py says why); 0: never."""
    malloc_arena_max: int = 2
    """glibc malloc arenas per process of the cluster (`MALLOC_ARENA_MAX` in every actor's
    environment): fewer arenas keep fewer free fragments (vocabulary/malloc_trim.py says
    why); 0: glibc's default (8 per core)."""


@dataclass(frozen=True)
class PdserveConfig:
    """Everything a pdserve cluster runs with (`pdserve config show` prints it)."""

    model: str | None = None
    """Checkpoint folder (every node reads it from its local disk); None writes/uses the tiny
    model in the cache folder."""
    cluster: LaunchConfig = field(default_factory=LaunchConfig)
    """Ray, Redis and the router replicas."""
    router: RouterConfig = field(
        default_factory=lambda: RouterConfig(
            metrics_port=DEFAULT_METRICS_PORT,
            http_port=DEFAULT_HTTP_PORT,
            admin_port=DEFAULT_ADMIN_PORT,
        )
    )
    """Each router replica (metrics on 9464, the OpenAI HTTP API on 8000 and the admin plane
    on 127.0.0.1:50151 unless set)."""
    workers: ClusterSpec = field(default_factory=ClusterSpec)
    """What the controller runs: the workers of each role, how, and the planner."""

    def controller_spec(self, model_dir: str, redis_url: str, fixed_capacity: bool) -> ClusterSpec:
        """`workers` as the controller takes it, with the running cluster's model folder and
        Redis, and whether its Ray can grow."""
        return replace(
            self.workers,
            engine=replace(self.workers.engine, model_dir=model_dir),
            redis_url=redis_url,
            fixed_capacity=fixed_capacity,
            cluster_name=self.cluster.name,
            index=self.index,
        )

    @property
    def index(self) -> PrefixIndexConfig:
        """`workers.index` under this cluster's key prefix (its name)."""
        return replace(self.workers.index, key_prefix=self.cluster.name)

    def prefill_cost_model(self, model_dir: str) -> PrefillCostModel | None:
        """The step times of the `cost` local-prefill policy, from the profile file
        `router.orchestrator.local_prefill.profile` checked against the workers (model id and
        shape, block size, prefill TP; dtype and device where the engine names them). None
        under `threshold` or without a profile. Raises PerfProfileError naming the field."""
        local = self.router.orchestrator.local_prefill
        if local.kind is not LocalPrefillPolicy.COST or local.profile is None:
            return None
        engine = self.workers.engine
        model = ModelConfig.from_pretrained(model_dir)
        plain_kv = engine.kv_cache_dtype == "auto"
        profile = load_perf_profile(
            Path(local.profile),
            model_id=engine.model_id or Path(model_dir).name,
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=engine.block_size,
            tensor_parallel_size=self.workers.prefill_tp,
            dtype=engine.dtype if engine.dtype != "auto" and plain_kv else None,
            device="cpu" if engine.device == "cpu" else None,
        )
        return profile.prefill_cost_model(f"{local.profile} ({profile.header.model_id})")

    def replica_config(
        self,
        replica: int,
        model_dir: str,
        redis_url: str,
        api_keys: tuple[ApiKey, ...] = (),
        block_hash: str = "",
        prefill_cost: PrefillCostModel | None = None,
    ) -> RouterConfig:
        """`router` as router replica `replica` takes it: the workers' model, index and block
        hash, the API keys, the `cost` policy's step times, and its own ports (each replica
        one above the last; 0 stays 0: a free one)."""
        r = self.router
        grpc, metrics, http = r.grpc_port, r.metrics_port, r.http_port
        planner = self.workers.planner.config
        local = replace(r.orchestrator.local_prefill, cost=prefill_cost)
        return replace(
            r,
            orchestrator=replace(r.orchestrator, local_prefill=local),
            model_dir=model_dir,
            model_id=self.workers.engine.model_id or Path(model_dir).name,
            slo=SloTargets(planner.ttft_slo_ms, planner.tpot_slo_ms),
            redis_url=redis_url,
            index=self.index,
            api_keys=api_keys,
            block_hash=block_hash,
            grpc_port=grpc + replica if grpc else 0,
            admin_port=r.admin_port + replica if r.admin_port else 0,
            metrics_port=None if metrics is None else (metrics + replica if metrics else 0),
            http_port=None if http is None else (http + replica if http else 0),
        )


FILLED_IN: frozenset[str] = frozenset(
    {
        "workers.engine.model_dir",  # `model`
        "workers.engine.mode",  # per role, by the controller
        "workers.redis_url",  # `cluster.redis_url`, or the embedded Redis started
        "workers.fixed_capacity",  # a local Ray that pdserve started
        "workers.cluster_name",  # `cluster.name`
        "workers.index.key_prefix",  # `cluster.name`
        "router.model_dir",  # `model`
        "router.model_id",  # `workers.engine.model_id`, or the folder's name
        "router.redis_url",  # as workers.redis_url
        "router.index",  # `workers.index`
        "router.api_keys",  # `cluster.api_keys_file` / $PDSERVE_API_KEYS, and the admin key
        "router.block_hash",  # `cluster.block_hash`, resolved
        "router.slo",  # `workers.planner.config` ttft_slo_ms / tpot_slo_ms: one set of SLOs
        "router.orchestrator.local_prefill.cost",  # from its `profile`
    }
)
"""Fields of the tree that pdserve fills in from other fields or what it started; they are
not part of the file."""


def config_from_data(data: Any) -> PdserveConfig:
    """The tree a `--config` file describes (`ConfigError` naming the key path when it does
    not fit)."""
    return from_data(PdserveConfig, data, PdserveConfig(), FILLED_IN)


def config_yaml(config: PdserveConfig) -> str:
    """`config` as the YAML that `config_from_data(yaml.safe_load(...))` reads back."""
    return str(yaml.safe_dump(to_data(config, FILLED_IN), sort_keys=False))
