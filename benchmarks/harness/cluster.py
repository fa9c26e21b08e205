"""The cluster the CPU suites start in-script: 1P1D on the tiny model, CPU workers (also on a
GPU host), every prompt disaggregated (local_prefill_threshold_tokens=0), a free gRPC port,
no metrics port; and the process id of one of its actors."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deploy.control.config_tree import PdserveConfig
    from deploy.control.launch import Cluster


def tiny_disaggregated(
    num_kv_blocks: int = 1024,
    worker_cpus: float = 0.5,
    ray_cpus: int | None = 4,
    http_port: int | None = None,
) -> PdserveConfig:
    """The cluster's config (deploy/control/config_tree.py); `local_cluster` starts it."""
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.checkpoints.make_model import cached_tiny_model
    from deploy.control.cluster_spec import ClusterSpec, WorkerPlacement
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from engine.config import EngineConfig
    from router.router_server import RouterConfig
    from vocabulary.worker_api import ActorPlacement

    model_dir = str(cached_tiny_model())
    return PdserveConfig(
        model=model_dir,
        cluster=LaunchConfig(num_cpus=ray_cpus),
        router=RouterConfig(
            grpc_port=0,
            http_port=http_port,
            metrics_port=None,
            admission=AdmissionConfig(
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=EngineConfig(
                model_dir,
                device="cpu",
                dtype="float32",
                num_kv_blocks=num_kv_blocks,
                attention_backend="torch",
                cuda_graphs=False,
            ),
            placement=WorkerPlacement(default=ActorPlacement(num_cpus=worker_cpus)),
        ),
    )


@contextmanager
def local_cluster(
    config: PdserveConfig | None = None, env: Mapping[str, str] | None = None
) -> Iterator[Cluster]:
    """`config` (default `tiny_disaggregated()`) started on a local Ray over loopback, `env`
    set first (before Ray starts: the cluster hands it to its actors too); stopped on exit.
    Its `endpoint` is set. Ray reads part of its environment when it is imported: import it
    inside the block, not before (deploy/control/local_ray.py)."""
    from deploy.control.local_ray import loopback_env

    loopback_env()
    os.environ.update(env or {})
    from deploy.control.launch import Cluster

    with Cluster(config if config is not None else tiny_disaggregated()) as cluster:
        assert cluster.endpoint is not None
        yield cluster


def actor_pid(actor: Any) -> int:
    """The process id of a Ray actor."""
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60))
