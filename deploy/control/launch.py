"""Launch a pdserve cluster: Redis (embedded unless a URL is given), Ray (local unless an
address is given), the controller with its workers, and the router replica(s).

Before anything starts, `Cluster.start()` loads the API keys and refuses a router bound beyond
loopback without them (deploy/control/security.py); the block-hash algorithm reaches every router
and worker through the actors' environment (`PDSERVE_BLOCK_HASH`, inherited by the controller's
workers), and so do the `OTEL_*` variables that configure tracing (vocabulary/tracing.py).
`Cluster.start()` returns once every router answers; `Cluster.stop()` undoes everything it started,
in reverse order, including the detached controller (and with it the workers it owns) on a Ray
cluster that outlives this driver. `pdserve up` runs this in the foreground (or in a detached daemon
process with `--detach`); tests use it directly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.control.cluster_controller import (
    CONTROLLER_NAME,
    ROUTER_PREFIX,
    Controller,
)
from deploy.control.cluster_spec import ClusterSpec
from deploy.control.config_tree import DEFAULT_CLUSTER_NAME, PdserveConfig
from deploy.control.embedded_redis import EmbeddedRedis
from deploy.control.local_ray import loopback_env
from deploy.control.security import (
    Access,
    SecurityError,
    cluster_access,
    exposure_refusal,
    resolve_block_hash,
)
from deploy.control.worker_actors import NO_TASK_EVENTS, capacity_shortfall
from planner.perf_profile import PerfProfileError, load_perf_profile
from planner.predictive import PlannerMode
from router.router_server import RouterActor
from vocabulary.block_hash import BLOCK_HASH_ENV
from vocabulary.malloc_trim import malloc_trim_env
from vocabulary.tracing import tracing_env

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster cannot start as asked (the message says why and what to do)."""


@dataclass(frozen=True)
class Endpoint:
    grpc: tuple[str, ...]
    metrics: tuple[str, ...]
    redis_url: str
    """Secret when it holds a password (the embedded Redis's does): show `redact_url(...)`."""
    model_dir: str
    ray_address: str = ""
    """GCS address of the Ray cluster the workers run on."""
    admin: tuple[str, ...] = ()
    """Each router's admin plane (HOST:PORT)."""
    block_hash: str = ""
    """The block-hash algorithm the routers and workers run with."""

    @property
    def target(self) -> str:
        return self.grpc[0]


class Cluster:
    """A running pdserve cluster, started from its config tree (`PdserveConfig`)."""

    def __init__(self, config: PdserveConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.controller: Any = None
        self.routers: list[Any] = []
        self.endpoint: Endpoint | None = None
        self.access = Access()
        """The API keys and the CLI's admin key (set by `start`)."""
        self._ray_started = False

    def start(self) -> Endpoint:
        import ray

        from deploy.checkpoints.make_model import cached_tiny_model

        cfg, launch = self.config, self.config.cluster
        try:
            self.access = cluster_access(cfg)
        except SecurityError as e:
            raise ClusterError(str(e)) from None
        refusal = exposure_refusal(cfg, self.access)
        if refusal is not None:
            raise ClusterError(refusal)
        block_hash = resolve_block_hash(cfg).value
        model_dir = cfg.model or str(cached_tiny_model())
        try:
            prefill_cost = cfg.prefill_cost_model(model_dir)
        except PerfProfileError as e:
            raise ClusterError(f"router.orchestrator.local_prefill.profile: {e}") from None
        planner = cfg.workers.planner
        if planner.enabled and planner.kind is PlannerMode.PREDICTIVE:
            if planner.predictive.profile is None:
                raise ClusterError(
                    "workers.planner.predictive.profile: required in predictive mode"
                )
            try:
                load_perf_profile(Path(planner.predictive.profile))
            except PerfProfileError as e:
                raise ClusterError(f"workers.planner.predictive.profile: {e}") from None
        # Every actor (the controller's workers inherit it) hashes with the cluster's algorithm
        # and traces as this process's OTEL_* say (off without OTEL_TRACES_EXPORTER).
        trim = malloc_trim_env(launch.malloc_trim_s, launch.malloc_arena_max)
        env = {BLOCK_HASH_ENV: block_hash, **trim}
        runtime_env = {"env_vars": {**env, **tracing_env()}}
        try:
            redis_url = launch.redis_url
            if redis_url is None:
                self.redis = EmbeddedRedis()
                redis_url = self.redis.start()
            local = launch.address is None
            if local:
                loopback_env()
            if not ray.is_initialized():
                ray.init(
                    address=launch.address,
                    namespace=launch.name,
                    include_dashboard=False,
                    num_cpus=launch.num_cpus if local else None,
                    object_store_memory=launch.object_store_bytes if local else None,
                    log_to_driver=True,
                    _node_ip_address="127.0.0.1" if local else None,
                )
                self._ray_started = True
            _refuse_running_controller(launch.name)
            fixed = self._ray_started and local  # a Ray of our own: it has what it started with
            spec = cfg.controller_spec(model_dir, redis_url, fixed_capacity=fixed)
            if fixed:
                _refuse_unplaceable(spec)
            options = {
                **controller_options(launch.name, node_id=head_node_id()),
                "runtime_env": runtime_env,
            }
            self.controller = ray.remote(Controller).options(**options).remote(spec)
            ray.get(self.controller.start.remote())
            host, admin_host = _address(cfg.router.host), _address(cfg.router.admin_host)
            grpc_addrs, metrics_addrs, admin_addrs = [], [], []
            for i in range(launch.routers):
                router: Any = (
                    ray.remote(RouterActor)
                    .options(
                        name=f"{ROUTER_PREFIX}{i}",
                        namespace=launch.name,
                        num_cpus=0,
                        resources=dict(launch.router_resources),
                        runtime_env=runtime_env,
                        **NO_TASK_EVENTS,
                    )
                    .remote(
                        cfg.replica_config(
                            i, model_dir, redis_url, self.access.keys, block_hash, prefill_cost
                        ),
                        CONTROLLER_NAME,
                        launch.name,
                    )
                )
                self.routers.append(router)
                ports = ray.get(router.start.remote())
                ray.get(self.controller.register_router.remote(router))
                grpc_addrs.append(f"{host}:{ports.grpc}")
                admin_addrs.append(f"{admin_host}:{ports.admin}")
                if ports.metrics is not None:
                    metrics_addrs.append(f"http://{host}:{ports.metrics}/metrics")
            self.endpoint = Endpoint(
                tuple(grpc_addrs),
                tuple(metrics_addrs),
                redis_url,
                model_dir,
                ray.get_runtime_context().gcs_address,
                tuple(admin_addrs),
                block_hash,
            )
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
                _wait_name_released(CONTROLLER_NAME, self.config.cluster.name, timeout_s=10.0)
            if self._ray_started:
                ray.shutdown()
        self.routers = []
        self.controller = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def control_log(self, since: int) -> tuple[int, list[str]]:
        """The controller's events (worker lifecycle, planner actions) numbered `since` and
        later, and the number to pass next time."""
        import ray

        if self.controller is None:
            return since, []
        seq, lines = ray.get(self.controller.events_since.remote(since), timeout=10)
        return int(seq), list(lines)

    def planner_decisions(self, since_tick: int = 0) -> list[tuple[int, str]]:
        """The planner's decisions with their reasons from tick `since_tick` on, as
        (tick, line); empty when it is off."""
        import ray

        if self.controller is None:
            return []
        got = ray.get(self.controller.planner_decisions.remote(since_tick), timeout=10)
        return [(int(t), str(line)) for t, line in got]

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def controller_options(
    namespace: str, detached: bool = True, node_id: str | None = None
) -> dict[str, Any]:
    """The controller actor's options. `node_id`: the node it must run on (`up` passes the
    head's, `head_node_id`, as Ray Serve places its controller: not a worker node that may drop
    off the network with its workers; the head holds the GCS, so a cluster that lost it is lost
    anyway). None: Ray picks."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {
        "name": CONTROLLER_NAME,
        "namespace": namespace,
        "num_cpus": 0,
        "max_concurrency": 1000,
        # A controller that dies comes back and adopts the workers and routers
        # (deploy/control/cluster_controller.py `Controller._adopt`).
        "max_restarts": -1,
        **NO_TASK_EVENTS,
    }
    if detached:
        opts["lifetime"] = "detached"
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return opts


def head_node_id() -> str | None:
    """The Ray head node's id (the node with Ray's `node:__internal_head__` resource), None
    when no live node has it."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def _address(host: str) -> str:
    """`host` as the host part of HOST:PORT (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _refuse_running_controller(name: str) -> None:
    """A detached controller outlives a driver that died without `pdserve down`: refuse to
    start a second cluster of the same name next to it (names would clash), and say how to
    remove it or where else to start."""
    import ray

    try:
        ray.get_actor(CONTROLLER_NAME, namespace=name)
    except ValueError:
        return
    raise ClusterError(
        f"a pdserve cluster named {name!r} already runs on this Ray cluster; stop it with "
        "`pdserve down --address ADDRESS`, or give this one another name (--cluster-name)"
    )


def _refuse_unplaceable(spec: ClusterSpec) -> None:
    """A local Ray has the resources it started with (no autoscaler adds nodes): refuse at
    once, saying what is short, workers that could never be placed (else `up` would wait for
    them until its start timeout)."""
    import ray

    wanted = [(role.value, spec.worker_asks(role)) for role in spec.initial_roles()]
    why = capacity_shortfall(wanted, ray.cluster_resources())
    if why is not None:
        raise ClusterError(why)


def _wait_name_released(name: str, namespace: str, timeout_s: float) -> None:
    """`ray.kill` returns before the GCS frees the actor's name; a cluster started next in the
    same Ray (tests, benchmarks) would find it taken."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    log.warning("actor name %s still registered %.0fs after ray.kill", name, timeout_s)


def remove_leftovers(address: str, name: str = DEFAULT_CLUSTER_NAME) -> list[str]:
    """Kill the actors of cluster `name` (controller, its workers, routers) left on a Ray
    cluster by a driver that died without stopping them; returns the names killed."""
    import ray

    from vocabulary.worker_api import ACTOR_NAME_PREFIX

    ray.init(address=address, namespace=name, log_to_driver=False)
    killed = []
    try:
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == name
        ]
        # The controller first: its workers share its fate; routers are killed by name.
        ordered = sorted(names, key=lambda n: (n != CONTROLLER_NAME, n))
        for actor_name in ordered:
            if actor_name == CONTROLLER_NAME or actor_name.startswith(
                (ROUTER_PREFIX, ACTOR_NAME_PREFIX)
            ):
                try:
                    actor = ray.get_actor(actor_name, namespace=name)
                    if actor_name == CONTROLLER_NAME:
                        with contextlib.suppress(Exception):
                            ray.get(actor.shutdown.remote(), timeout=60)
                    ray.kill(actor)
                    killed.append(actor_name)
                except ValueError:
                    pass  # already gone with the controller
    finally:
        ray.shutdown()
    return killed
