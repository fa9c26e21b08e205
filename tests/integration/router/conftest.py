"""One real pdserve cluster shared by the router tests: Ray (the session's `ray_cluster`),
an embedded redis-server, the controller with 2 prefill + 1 decode workers (tiny model, NIXL
over UCX on loopback) and 2 router replicas, each with its own admission controller.

Router 0 disaggregates every prompt (local_prefill_threshold_tokens=0); tests that want the
decode worker to prefill locally raise the threshold on router 1 and put it back. Tests that
change thresholds restore them (`restored_thresholds`) so test order does not matter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from cpu_engine import cpu_engine
from directory_scope import stop_with_directory
from router_client import http_url
from router_harness import (
    KV_BLOCKS,
    MAX_MESSAGE_BYTES,
    MAX_MODEL_LEN,
    SERVED_LORA,
    STALL_TIMEOUT_S,
    TENANTS,
    TOKEN_GAP_S,
    LoraAdapters,
    RouterCluster,
)

from admission.config import AdmissionConfig, AdmissionThresholds


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoraAdapters:
    """Two random PEFT adapters on the tiny model: "tiny-sql" (served from the start) and
    "tiny-chat" (loaded at run time by test_router_lora)."""
    from lora_reference import ATTENTION, MLP, make_adapter

    root = tmp_path_factory.mktemp("router-lora")
    return LoraAdapters(
        sql=make_adapter(tiny_model_dir, root / "sql", 1, r=8, lora_alpha=16,
                         target_modules=ATTENTION + MLP),
        chat=make_adapter(tiny_model_dir, root / "chat", 2, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj", "down_proj"]),
    )  # fmt: skip


@pytest.fixture(scope="session")
def router_cluster(
    request: pytest.FixtureRequest,
    ray_cluster: None,
    tiny_model_dir: Path,
    lora_adapters: LoraAdapters,
) -> Iterator[RouterCluster]:
    import ray

    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.orchestrator import OrchestratorConfig
    from router.router_server import RouterConfig, RouterLimits

    engine = cpu_engine(
        tiny_model_dir,
        num_kv_blocks=KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        loras=((SERVED_LORA, str(lora_adapters.sql)),),  # test_router_lora
    )
    router = RouterConfig(
        grpc_port=0,
        metrics_port=0,
        http_port=0,  # the OpenAI HTTP API (test_openai_*)
        tenants=TENANTS,
        limits=RouterLimits(max_message_bytes=MAX_MESSAGE_BYTES),
        admission=AdmissionConfig(thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)),
        # test_router_faults stops workers: short stage deadlines and stall checks
        orchestrator=OrchestratorConfig(token_gap_timeout_s=TOKEN_GAP_S),
    )
    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name="router-tests", routers=2),
        router=router,
        workers=ClusterSpec(
            engine=engine, num_prefill=2, num_decode=1, stall_timeout_s=STALL_TIMEOUT_S
        ),
    )
    cluster = Cluster(config)
    stop_with_directory(request, cluster.stop)
    with cluster:
        ep = cluster.endpoint
        assert ep is not None
        listed = ray.get(cluster.controller.list_workers.remote())
        workers = {info.worker_id: (info, handle) for info, handle in listed}
        channels = [grpc.insecure_channel(t) for t in ep.grpc]
        admin_channels = [grpc.insecure_channel(t) for t in ep.admin]
        try:
            yield RouterCluster(
                cluster=cluster,
                targets=ep.grpc,
                metrics_urls=ep.metrics,
                redis_url=ep.redis_url,
                model_dir=Path(ep.model_dir),
                model_id=next(iter(workers.values()))[0].model_id,
                workers=workers,
                channels=channels,
                admin_targets=ep.admin,
                admin_channels=admin_channels,
            )
        finally:
            for ch in channels + admin_channels:
                ch.close()


@pytest.fixture(scope="module")
def client(router_cluster: RouterCluster) -> Iterator[openai.OpenAI]:
    """The `openai` SDK on router 0's HTTP API (no retries: a test sees every error)."""
    with openai.OpenAI(
        base_url=http_url(router_cluster) + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def clients(router_cluster: RouterCluster) -> Iterator[list[openai.OpenAI]]:
    """The `openai` SDK on each router's HTTP API: router 0 disaggregates every prompt,
    router 1 prefills short ones on the decode worker."""
    made = [
        openai.OpenAI(base_url=http_url(router_cluster, r) + "/v1", api_key="unused",
                      max_retries=0, timeout=60)
        for r in (0, 1)
    ]  # fmt: skip
    yield made
    for c in made:
        c.close()
