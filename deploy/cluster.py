"""Launch a pdserve cluster: Redis (embedded unless a URL is given), Ray (local unless an
address is given), the controller with its workers, and the router replica(s).

`Cluster.start()` returns once every router answers; `Cluster.stop()` undoes everything it
started, in reverse order. `pdserve up` runs this in the foreground (or in a detached daemon
process with `--detach`); tests use it directly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy.controller import CONTROLLER_NAME, ClusterSpec, Controller, controller_options
from deploy.redis_server import EmbeddedRedis
from deploy.workers import ActorPlacement
from engine.config import EngineConfig
from router.server import RouterActor, RouterConfig

log = logging.getLogger(__name__)

NAMESPACE = "pdserve"


@dataclass(frozen=True)
class ClusterOptions:
    """Everything `pdserve up` accepts (CLI flags and the config file map onto these)."""

    model_dir: str | None = None
    """Checkpoint folder; None writes/uses the tiny model in the cache folder."""
    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    """Baseline: decode workers prefill everything themselves, no prefill workers."""
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    metrics_port: int | None = 9464
    num_routers: int = 1
    """Router replicas; replica i listens on grpc_port + i (metrics_port + i)."""
    redis_url: str | None = None
    """None starts an embedded redis-server on a free loopback port."""
    address: str | None = None
    """Ray address of an existing cluster; None starts a local Ray."""
    engine: EngineConfig | None = None
    """Engine settings (model_dir is filled in); None uses the defaults."""
    router: RouterConfig | None = None
    """Router settings (ports, model and Redis are filled in); None uses the defaults."""
    placement: ActorPlacement | None = None
    num_cpus: int | None = None
    """CPUs a local Ray advertises (None: what Ray detects)."""
    object_store_bytes: int = 256 << 20
    extra_spec: dict[str, Any] = field(default_factory=dict)
    """Further ClusterSpec fields (e.g. transfer=KVTransferConfig(...))."""


@dataclass(frozen=True)
class Endpoint:
    grpc: tuple[str, ...]
    metrics: tuple[str, ...]
    redis_url: str
    model_dir: str

    @property
    def target(self) -> str:
        return self.grpc[0]


def loopback_env() -> None:
    """Ray and UCX on loopback for one-machine clusters without a GPU (set before ray.init)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local Ray
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        os.environ.setdefault("UCX_TLS", "shm,tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


class Cluster:
    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.redis: EmbeddedRedis | None = None
        self.controller: Any = None
        self.routers: list[Any] = []
        self.endpoint: Endpoint | None = None
        self._ray_started = False

    def start(self) -> Endpoint:
        import ray

        from deploy.make_model import cached_tiny_model

        opts = self.options
        try:
            model_dir = opts.model_dir or str(cached_tiny_model())
            redis_url = opts.redis_url
            if redis_url is None:
                self.redis = EmbeddedRedis()
                redis_url = self.redis.start()
            loopback_env()
            if not ray.is_initialized():
                ray.init(
                    address=opts.address,
                    namespace=NAMESPACE,
                    include_dashboard=False,
                    num_cpus=opts.num_cpus if opts.address is None else None,
                    object_store_memory=opts.object_store_bytes if opts.address is None else None,
                    log_to_driver=True,
                    _node_ip_address="127.0.0.1" if opts.address is None else None,
                )
                self._ray_started = True
            engine = replace(opts.engine or EngineConfig(model_dir), model_dir=model_dir)
            spec = ClusterSpec(
                engine=engine,
                num_prefill=opts.num_prefill,
                num_decode=opts.num_decode,
                colocated=opts.colocated,
                redis_url=redis_url,
                placement=opts.placement,
                **opts.extra_spec,
            )
            self.controller = (
                ray.remote(Controller).options(**controller_options(NAMESPACE)).remote(spec)
            )
            ray.get(self.controller.start.remote())
            grpc_addrs, metrics_addrs = [], []
            for i in range(opts.num_routers):
                base = opts.router or RouterConfig(model_dir)
                mport = opts.metrics_port
                cfg = replace(
                    base,
                    model_dir=model_dir,
                    model_id=engine.model_id or Path(model_dir).name,
                    host=opts.host,
                    grpc_port=opts.grpc_port + i if opts.grpc_port else 0,
                    metrics_port=None if mport is None else (mport + i if mport else 0),
                    redis_url=redis_url,
                )
                router: Any = (
                    ray.remote(RouterActor)
                    .options(name=f"pdserve-router-{i}", namespace=NAMESPACE, num_cpus=0)
                    .remote(cfg, CONTROLLER_NAME, NAMESPACE)
                )
                self.routers.append(router)
                port, mport = ray.get(router.start.remote())
                grpc_addrs.append(f"{opts.host}:{port}")
                if mport is not None:
                    metrics_addrs.append(f"http://{opts.host}:{mport}/metrics")
            self.endpoint = Endpoint(tuple(grpc_addrs), tuple(metrics_addrs), redis_url, model_dir)
            return self.endpoint
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            for router in self.routers:
                try:
                    ray.get(router.stop.remote(), timeout=10)
                except Exception as e:
                    log.warning("router stop failed: %s", e)
                ray.kill(router)
            if self.controller is not None:
                try:
                    ray.get(self.controller.shutdown.remote(), timeout=60)
                except Exception as e:
                    log.warning("controller shutdown failed: %s", e)
                ray.kill(self.controller)
            if self._ray_started:
                ray.shutdown()
        self.routers = []
        self.controller = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
