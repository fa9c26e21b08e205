"""The control surface of a router: Admin (status, thresholds, drain, rebalance) on its own
port, the standard health service, server reflection (what grpcurl uses) and the Prometheus
endpoint."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import ray
import torch
from google.protobuf import descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from router_client import GENERATE_METHOD, generate, rpc_error
from router_harness import KV_BLOCKS, RouterCluster

from engine.loading.loaders import load_model
from pdserve.v1 import serving_pb2 as pb
from vocabulary.model_config import ModelConfig
from vocabulary.worker_api import WorkerRole


def test_status_reports_every_worker_and_the_router(router_cluster: RouterCluster) -> None:
    generate(router_cluster.generation(0), prompt="The river runs", max_tokens=3)
    status = router_cluster.admin(0).Status(pb.StatusRequest(), timeout=10)
    assert status.model == router_cluster.model_id
    assert status.redis_ok
    assert status.router_inflight_requests == 0
    assert status.thresholds == router_cluster.admin(0).GetThresholds(
        pb.GetThresholdsRequest(), timeout=10
    )
    by_id = {w.worker_id: w for w in status.workers}
    assert set(by_id) == set(router_cluster.workers)
    cfg = ModelConfig.from_pretrained(router_cluster.model_dir)
    weight_bytes = load_model(router_cluster.model_dir, torch.float32).weight_bytes
    block_bytes = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    for wid, (info, _) in router_cluster.workers.items():
        w = by_id[wid]
        assert w.role == info.role.value
        assert w.state == pb.WORKER_STATE_READY
        assert w.kv_blocks_total == KV_BLOCKS
        assert w.node == info.node and w.device == "cpu"
        assert (w.weights_dtype, w.quantization) == ("float32", "none")
        assert w.weight_bytes == weight_bytes
        assert (w.kv_cache_dtype, w.kv_cache_bytes) == ("float32", KV_BLOCKS * block_bytes)
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    assert by_id[decode_id].tpot_p50_ms > 0
    assert any(by_id[p].ttft_p50_ms > 0 for p in router_cluster.worker_ids(WorkerRole.PREFILL))

    def decode_done() -> int:  # loads in Status are the router's polls (every 50 ms)
        workers = router_cluster.admin(0).Status(pb.StatusRequest(), timeout=10).workers
        return next(w.requests_done for w in workers if w.worker_id == decode_id)

    _wait(lambda: decode_done() >= 1, "the decode worker reports a finished request")


def test_set_thresholds_changes_only_the_given_fields_of_that_router(
    router_cluster: RouterCluster,
) -> None:
    admin = router_cluster.admin(0)
    with router_cluster.restored_thresholds(0) as before:
        got = admin.SetThresholds(pb.AdmissionThresholds(max_inflight_requests=7), timeout=10)
        assert got.max_inflight_requests == 7
        assert got.max_estimated_ttft_ms == before.max_estimated_ttft_ms
        assert got.max_decode_kv_utilization == before.max_decode_kv_utilization
        assert admin.GetThresholds(pb.GetThresholdsRequest(), timeout=10) == got
        other = router_cluster.admin(1).GetThresholds(pb.GetThresholdsRequest(), timeout=10)
        assert other.max_inflight_requests == before.max_inflight_requests
    assert admin.GetThresholds(pb.GetThresholdsRequest(), timeout=10).max_inflight_requests == (
        before.max_inflight_requests
    )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(max_decode_kv_utilization=1.5), "max_decode_kv_utilization"),
        (dict(max_estimated_ttft_ms=-5.0), "max_estimated_ttft_ms"),
        (dict(max_queue_wait_ms=-1.0), "max_queue_wait_ms"),
        (dict(max_queue_wait_ms=float("nan")), "max_queue_wait_ms"),
    ],
)
def test_bad_threshold_is_invalid_argument_and_changes_nothing(
    router_cluster: RouterCluster, fields: dict[str, float], field: str
) -> None:
    admin = router_cluster.admin(0)
    before = admin.GetThresholds(pb.GetThresholdsRequest(), timeout=10)
    err = rpc_error(admin.SetThresholds, pb.AdmissionThresholds(**fields), timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"{field}: "), err.details()
    assert admin.GetThresholds(pb.GetThresholdsRequest(), timeout=10) == before


def test_drain_stops_a_worker_and_the_router_stops_placing_on_it(
    router_cluster: RouterCluster,
) -> None:
    admin = router_cluster.admin(0)
    controller = router_cluster.cluster.controller
    info = ray.get(controller.add_worker.remote("prefill"), timeout=300)
    listed = lambda: {w.worker_id for w in admin.Status(pb.StatusRequest(), timeout=10).workers}  # noqa: E731
    _wait(lambda: info.worker_id in listed(), "router sees the new worker")
    reply = admin.Drain(pb.DrainRequest(worker_id=info.worker_id, stop=True, timeout_s=60),
                        timeout=90)  # fmt: skip
    assert reply.drained, reply.message
    assert reply.worker_id == info.worker_id
    _wait(lambda: info.worker_id not in listed(), "router drops the stopped worker")
    assert listed() == set(router_cluster.workers)
    out = generate(router_cluster.generation(0), prompt="The river runs", max_tokens=2)
    assert out.final.timings.prefill_worker != info.worker_id


def test_drain_unknown_worker_is_not_found(router_cluster: RouterCluster) -> None:
    err = rpc_error(router_cluster.admin(0).Drain, pb.DrainRequest(worker_id="nope"), timeout=10)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details().startswith("worker_id: ")


def test_rebalance_to_no_decode_worker_is_invalid_argument(router_cluster: RouterCluster) -> None:
    err = rpc_error(
        router_cluster.admin(0).Rebalance, pb.RebalanceRequest(prefill=1, decode=0), timeout=10
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("decode: ")


def _wait(cond: object, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ("", health_pb2.HealthCheckResponse.SERVING),
        ("pdserve.v1.Generation", health_pb2.HealthCheckResponse.SERVING),
        ("pdserve.v1.Admin", health_pb2.HealthCheckResponse.SERVING),
    ],
)
def test_health_check_reports_serving(
    router_cluster: RouterCluster, service: str, expected: int
) -> None:
    for i in range(len(router_cluster.targets)):
        stub = health_pb2_grpc.HealthStub(router_cluster.channel(i))
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == expected


def test_health_check_of_an_unknown_service_is_not_found(router_cluster: RouterCluster) -> None:
    stub = health_pb2_grpc.HealthStub(router_cluster.channel(0))
    err = rpc_error(stub.Check, health_pb2.HealthCheckRequest(service="no.Such"), timeout=10)
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lets_a_generic_client_call_generate(router_cluster: RouterCluster) -> None:
    """What grpcurl does: list services, resolve the method and its types, build the request
    from the reflected descriptors alone (no generated code) and call it."""
    db = ProtoReflectionDescriptorDatabase(router_cluster.channel(0))
    services = set(db.get_services())
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= services
    assert "pdserve.v1.Admin" not in services  # the admin plane has its own port
    pool = descriptor_pool.DescriptorPool(db)
    method = pool.FindMethodByName("pdserve.v1.Generation.Generate")
    assert method.server_streaming and not method.client_streaming
    request_cls = GetMessageClass(method.input_type)
    response_cls = GetMessageClass(method.output_type)
    fields = set(method.input_type.fields_by_name)
    assert {"prompt", "token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "ignore_eos"} <= fields  # fmt: skip
    assert {"token_ids", "text"} <= set(method.output_type.fields_by_name)
    call = router_cluster.channel(0).unary_stream(
        GENERATE_METHOD,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )
    replies = list(call(request_cls(prompt="The river", max_tokens=3), timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 3
    admin_db = ProtoReflectionDescriptorDatabase(router_cluster.admin_channels[0])
    assert "pdserve.v1.Admin" in set(admin_db.get_services())
    admin = descriptor_pool.DescriptorPool(admin_db).FindServiceByName("pdserve.v1.Admin")
    assert {"Status", "GetThresholds", "SetThresholds", "Drain", "Rebalance"} <= set(
        admin.methods_by_name
    )


def _scrape(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    series = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def test_prometheus_endpoint_serves_the_pdserve_series(router_cluster: RouterCluster) -> None:
    url = router_cluster.metrics_urls[0]
    before = _scrape(url)
    generate(router_cluster.generation(0), prompt="The baker opens", max_tokens=3)
    rpc_error(router_cluster.generation(0).Generate, pb.GenerateRequest(prompt=""), timeout=10)
    time.sleep(0.2)  # worker gauges follow the router's load polls
    after = _scrape(url)
    ok, invalid = (
        'pdserve_requests_total{outcome="ok"}',
        'pdserve_requests_total{outcome="invalid"}',
    )
    assert after[ok] == before.get(ok, 0) + 1
    assert after[invalid] == before.get(invalid, 0) + 1
    count = "pdserve_ttft_seconds_count"
    assert after[count] == before.get(count, 0) + 1  # one TTFT per request, not per path
    names = {key.split("{")[0] for key in after}
    for expected in (
        "pdserve_ttft_seconds_bucket", "pdserve_tpot_seconds_count", "pdserve_e2e_seconds_sum",
        "pdserve_queue_seconds_count", "pdserve_transfer_seconds_count",
        "pdserve_admission_decisions_total", "pdserve_router_inflight_requests",
        "pdserve_worker_kv_blocks_total", "pdserve_worker_kv_blocks_used",
        "pdserve_worker_queued_prefill_tokens", "pdserve_worker_leased_blocks",
    ):  # fmt: skip
        assert expected in names, expected
    for wid in router_cluster.workers:
        role = router_cluster.workers[wid][0].role.value
        key = f'pdserve_worker_kv_blocks_total{{role="{role}",worker="{wid}"}}'
        assert after[key] == KV_BLOCKS, key
    assert len(router_cluster.metrics_urls) == 2
    assert _scrape(router_cluster.metrics_urls[1])  # each replica serves its own


def test_set_thresholds_can_disable_queueing(router_cluster: RouterCluster) -> None:
    admin = router_cluster.admin(0)
    with router_cluster.restored_thresholds(0):
        got = admin.SetThresholds(pb.AdmissionThresholds(max_queue_wait_ms=0.0), timeout=10)
        assert got.max_queue_wait_ms == 0.0
