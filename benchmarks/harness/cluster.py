"""The cluster the CPU benchmarks start in-script: 1P1D on the tiny model, CPU workers (also
on a GPU host), every prompt disaggregated (local_prefill_threshold_tokens=0), a free gRPC
port, no metrics port."""

from __future__ import annotations

from typing import Any


def tiny_disaggregated(
    num_kv_blocks: int = 1024,
    worker_cpus: float = 0.5,
    ray_cpus: int | None = 4,
    http_port: int | None = None,
) -> Any:
    """The PdserveConfig (deploy/control/config_tree.py); call
    `deploy.control.local_ray.loopback_env()` before Ray is imported."""
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
