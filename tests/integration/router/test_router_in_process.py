"""A RouterServer run in the test's own event loop against the cluster's worker actors
(StaticDirectory), for registries the shared cluster cannot show: no live decode worker,
and workers that register after the router started."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_harness import MAX_MODEL_LEN, RouterCluster

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from router.cluster_view import StaticDirectory
from router.router_server import RouterConfig, RouterServer
from vocabulary.worker_api import WorkerRole

T = TypeVar("T")


@ray.remote(num_cpus=0)
class _Gone:
    def load(self) -> None:
        raise AssertionError("never called: the actor is killed first")


def _run(
    cluster: RouterCluster,
    directory: StaticDirectory,
    body: Callable[[RouterServer, grpc.aio.Channel], Awaitable[T]],
) -> T:
    async def scenario() -> T:
        server = RouterServer(
            RouterConfig(model_dir=str(cluster.model_dir), grpc_port=0), directory
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await body(server, ch)
        finally:
            await server.stop()

    return asyncio.run(scenario())


async def _generate_error(ch: grpc.aio.Channel, **fields: Any) -> grpc.aio.AioRpcError:
    try:
        async for _ in pb_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(**fields), timeout=30
        ):
            pass
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError("expected an error")


def test_no_live_decode_worker_is_unavailable_and_not_serving(
    router_cluster: RouterCluster,
) -> None:
    (prefill_id, *_) = router_cluster.worker_ids(WorkerRole.PREFILL)
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    dead = _Gone.remote()
    ray.kill(dead)
    dead_info = replace(router_cluster.workers[decode_id][0], worker_id="decode-dead")
    directory = StaticDirectory([router_cluster.workers[prefill_id], (dead_info, dead)])

    async def body(server: RouterServer, ch: grpc.aio.Channel) -> None:
        err = await _generate_error(ch, prompt="The river", max_tokens=4)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        assert "decode" in (err.details() or "")
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "pdserve.v1.Generation"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING, service

    _run(router_cluster, directory, body)


def test_context_limit_follows_workers_that_register_after_start(
    router_cluster: RouterCluster,
) -> None:
    """The workers serve MAX_MODEL_LEN tokens, less than the checkpoint's 4096: a router that
    started before they registered must still refuse longer prompts as INVALID_ARGUMENT."""
    directory = StaticDirectory([])

    async def body(server: RouterServer, ch: grpc.aio.Channel) -> None:
        directory.workers = list(router_cluster.workers.values())
        await server.wait_ready(min_decode=1, timeout_s=30)
        err = await _generate_error(ch, token_ids=[7] * (MAX_MODEL_LEN + 100), max_tokens=4)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert (err.details() or "").startswith("prompt: "), err.details()

    _run(router_cluster, directory, body)
