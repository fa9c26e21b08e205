"""One live cluster for the observability tests, shared by the directory (its two files run
on one xdist worker, tests/conftest.py): 1 prefill + 1 decode worker (tiny model, NIXL over
UCX on loopback, the session's Ray and an embedded redis-server), one router, the planner on
(ticking every second, bounds that make it hold), and tracing to each actor's memory
(`TRACE_ENV`: test_tracing reads the spans back). `observed` adds a real Prometheus scraping
the router and the controller every second with the repository's rules loaded; a short load
has run once it yields, and Prometheus has scraped what it left."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from cpu_engine import cpu_engine
from directory_scope import stop_with_directory
from prometheus_server import Observed, PrometheusServer, require_prometheus

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from deploy.control.launch import Cluster

PROMPTS = (
    "The baker opens the shop before dawn and the street smells of bread.",
    "The baker opens the shop before dawn and the first customers wait outside.",
    "A river runs past the old mill, and the wheel turns slowly in the current.",
)
"""Shared prefixes (prefix-cache hits on the second of each pair)."""
REQUESTS = 12
TRACE_ENV = {"OTEL_TRACES_EXPORTER": "pdserve_memory", "OTEL_BSP_SCHEDULE_DELAY": "100"}
"""The cluster's actors keep their finished spans in the SDK's in-memory exporter. They get
it the way an operator's do: `Cluster.start` passes the driver's `OTEL_*` variables in the
actors' runtime_env (the controller's workers inherit it)."""


@pytest.fixture(scope="session")
def observed_cluster(
    request: pytest.FixtureRequest, ray_cluster: None, tiny_model_dir: Path
) -> Iterator[Cluster]:
    """The directory's cluster, started (stopped after the directory's last test)."""
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from planner.core import PlannerConfig, RoleBounds
    from planner.loop import PlannerSettings
    from router.router_server import RouterConfig

    planner = PlannerSettings(
        enabled=True,
        interval_s=1.0,
        request_resources=False,
        config=PlannerConfig(prefill=RoleBounds(1, 1), decode=RoleBounds(1, 1)),
    )
    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name="observed-tests", routers=1),
        router=RouterConfig(
            grpc_port=0,
            metrics_port=0,
            http_port=0,  # test_tracing's HTTP request
            # every prompt goes through a prefill worker and a KV hand-off
            admission=AdmissionConfig(
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=cpu_engine(tiny_model_dir, num_kv_blocks=128, max_model_len=512),
            num_prefill=1,
            num_decode=1,
            planner=planner,
        ),
    )
    cluster = Cluster(config)
    stop_with_directory(request, cluster.stop)
    with pytest.MonkeyPatch.context() as env:
        for key, value in TRACE_ENV.items():
            env.setenv(key, value)
        cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def observed(
    observed_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Observed]:
    binary = require_prometheus()
    import ray

    ep = observed_cluster.endpoint
    assert ep is not None and ep.metrics
    controller_url = ray.get(observed_cluster.controller.metrics_url.remote(), timeout=30)
    assert controller_url, "the controller serves no metrics"
    prometheus = PrometheusServer(
        binary,
        tmp_path_factory.mktemp("prometheus"),
        {"pdserve-router": list(ep.metrics), "pdserve-controller": [controller_url]},
    )
    try:
        wait_for(prometheus, ['count(up{job=~"pdserve-.*"} == 1) == 2'])  # before the load
        ok = send_load(ep.target)
        wait_for(prometheus, scraped(ok))
        yield Observed(prometheus, ep.target, ep.metrics, controller_url, ep.ray_address, ok)
    finally:
        prometheus.stop()


def send_load(target: str) -> int:
    """REQUESTS greedy requests, 4 at a time, in two waves 2 s apart (rates over a window see
    them rise, whatever the scrape phase), plus one invalid one; returns the ok count."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        def one(i: int) -> int:
            req = pb.GenerateRequest(
                prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8, temperature=0.0, ignore_eos=True
            )
            return len([m for m in stub.Generate(req, timeout=60)])

        with ThreadPoolExecutor(4) as pool:
            assert all(list(pool.map(one, range(REQUESTS // 2))))
            time.sleep(2.0)
            assert all(list(pool.map(one, range(REQUESTS // 2, REQUESTS))))
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(prompt=""), timeout=10))
    return REQUESTS


def scraped(ok: int) -> list[str]:
    """What Prometheus holds once it scraped the load: its requests, planner decisions and a
    recording rule's result over them."""
    return [
        f'sum(pdserve_requests_total{{outcome="ok"}}) >= {ok}',
        "sum(pdserve_planner_ticks_total) >= 2",
        "pdserve:ttft_seconds:p90_5m",
    ]


def wait_for(prometheus: PrometheusServer, checks: list[str], timeout_s: float = 30.0) -> None:
    """Until every query in `checks` has a finite sample."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [expr for expr in checks if not prometheus.finite(expr)]
        if not missing:
            return
        if time.monotonic() > deadline:
            got = {expr: prometheus.query(expr) for expr in missing}
            errors = [
                (r["name"], r.get("lastError"))
                for g in prometheus.api("rules")["groups"]
                for r in g["rules"]
                if r["health"] != "ok"
            ]
            raise AssertionError(f"Prometheus still lacks data after {timeout_s}s: {got} {errors}")
        time.sleep(0.5)
