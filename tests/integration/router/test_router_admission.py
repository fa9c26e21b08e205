"""Overload, deadlines and missing workers through the real gRPC API.

Overload at several times capacity answers RESOURCE_EXHAUSTED quickly (with `retry-after-ms`)
and every admitted request still completes; a deadline too short for the request ends it
with DEADLINE_EXCEEDED and frees its blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from router_client import greedy_request, rpc_error, trailing
from router_harness import RouterCluster

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

OVERLOAD_REQUESTS = 16
OVERLOAD_MAX_TOKENS = 24


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    seconds: float
    completion_tokens: int = 0
    finish_reason: int = 0
    retry_after_ms: str | None = None


def _call(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest) -> Outcome:
    t0 = time.perf_counter()
    try:
        messages = list(stub.Generate(req, timeout=120))
    except grpc.RpcError as e:
        return Outcome(e.code(), time.perf_counter() - t0, retry_after_ms=trailing(e).get(
            "retry-after-ms"))  # fmt: skip
    final = messages[-1]
    return Outcome(
        grpc.StatusCode.OK,
        time.perf_counter() - t0,
        sum(len(m.token_ids) for m in messages),
        final.finish_reason,
    )


def test_overload_is_rejected_fast_and_every_admitted_request_completes(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    stub = router_cluster.generation(0)
    with router_cluster.restored_thresholds(0):
        router_cluster.admin(0).SetThresholds(
            pb.AdmissionThresholds(max_inflight_requests=2, max_queue_wait_ms=1), timeout=10
        )
        requests = [
            pb.GenerateRequest(
                **greedy_request(corpus_ids[i * 20 : i * 20 + 40], OVERLOAD_MAX_TOKENS)
            )
            for i in range(OVERLOAD_REQUESTS)
        ]
        with ThreadPoolExecutor(OVERLOAD_REQUESTS) as pool:
            outcomes = list(pool.map(lambda r: _call(stub, r), requests))
    admitted = [o for o in outcomes if o.code == grpc.StatusCode.OK]
    rejected = [o for o in outcomes if o.code != grpc.StatusCode.OK]
    assert len(admitted) >= 2, outcomes
    assert len(rejected) >= OVERLOAD_REQUESTS // 2, outcomes  # 8x capacity: most are shed
    for o in rejected:
        assert o.code == grpc.StatusCode.RESOURCE_EXHAUSTED, o
        assert o.retry_after_ms is not None and int(o.retry_after_ms) > 0, o
        assert o.seconds < 1.0, o  # decided before any model work, never a hang
    for o in admitted:
        assert o.completion_tokens == OVERLOAD_MAX_TOKENS, o
        assert o.finish_reason == pb.FINISH_REASON_LENGTH, o
    assert max(o.seconds for o in rejected) < max(o.seconds for o in admitted)
    router_cluster.wait_idle()


def test_deadline_too_short_is_deadline_exceeded_and_frees_the_blocks(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    req = pb.GenerateRequest(**greedy_request(corpus_ids[300:700], 600))
    t0 = time.perf_counter()
    err = rpc_error(router_cluster.generation(0).Generate, req, timeout=0.5)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.perf_counter() - t0 < 5
    router_cluster.wait_idle()
