"""The router's token channel to a decode worker (one subscription per router and worker,
tokens of all its requests there in one Ray item per engine step), seen through gRPC:
concurrent requests each get exactly their own tokens; a client that cancels leaves the
others on the channel streaming and nothing registered; a decode worker killed mid-stream
fails every request on its channel at once with UNAVAILABLE."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import pytest
import ray
from references import Reference
from router_client import Streamed, greedy_request
from router_harness import KV_BLOCKS, MAX_MODEL_LEN, RouterCluster

from admission.config import AdmissionConfig, AdmissionThresholds
from deploy.control.worker_actors import create_worker
from engine.config import EngineConfig
from kv_transfer.config import KVTransferConfig
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from router.cluster_view import StaticDirectory
from router.decode_channel import ChannelState
from router.router_server import RouterConfig, RouterServer
from vocabulary.worker_api import ActorPlacement, WorkerRole
from worker_runtime.runtime import WorkerConfig

pytestmark = pytest.mark.timeout(240)

ERROR_WITHIN_S = 30.0


def channel_state(cluster: RouterCluster, router: int, worker_id: str) -> tuple[str, int, int]:
    """(channel id, open requests, batches received) of a router actor's channel."""

    def probe(actor: Any) -> tuple[str, int, int]:
        entry = actor.server.view.entries[worker_id]
        ch = entry.channel
        return (ch.channel_id, ch.num_open, ch.num_batches) if ch else ("", 0, 0)

    return ray.get(cluster.cluster.routers[router].__ray_call__.remote(probe), timeout=30)


def test_concurrent_requests_share_one_channel_and_each_get_exactly_their_tokens(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    router_cluster.wait_idle()
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    stub = router_cluster.generation(0)
    prompts = [corpus_ids[60 * i + 5 : 60 * i + 45 + 3 * i] for i in range(16)]
    max_tokens = 20
    calls = [stub.Generate(pb.GenerateRequest(**greedy_request(p, max_tokens)), timeout=120)
             for p in prompts]  # fmt: skip
    outs: list[Streamed | None] = [None] * len(calls)

    def read(i: int) -> None:
        outs[i] = Streamed(tuple(calls[i]))

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out is not None
        assert out.token_ids == hf_greedy(prompt, max_tokens)
        assert out.final.usage.completion_tokens == max_tokens
        assert not out.final.timings.local_prefill
        assert out.final.usage.transferred_prompt_tokens > 0
    cid, num_open, _ = channel_state(router_cluster, 0, decode_id)
    assert num_open == 0
    held = ray.get(router_cluster.handle(decode_id).channels.remote(), timeout=30)
    assert cid in {c.channel_id for c in held}
    router_cluster.wait_idle()


def test_client_cancel_leaves_the_other_requests_on_the_channel_streaming(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    router_cluster.wait_idle()
    (decode_id,) = router_cluster.worker_ids(WorkerRole.DECODE)
    stub = router_cluster.generation(0)
    prompts = [corpus_ids[1000 + 50 * i : 1040 + 50 * i] for i in range(4)]
    calls = [stub.Generate(pb.GenerateRequest(**greedy_request(p, 40)), timeout=120)
             for p in prompts]  # fmt: skip
    heads = [[next(c) for _ in range(3)] for c in calls]  # every request is decoding
    calls[0].cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(calls[0])
    assert err.value.code() == grpc.StatusCode.CANCELLED
    for prompt, call, head in zip(prompts[1:], calls[1:], heads[1:], strict=True):
        out = Streamed(tuple(head) + tuple(call))
        assert out.token_ids == hf_greedy(prompt, 40)
    router_cluster.wait_idle(timeout_s=KVTransferConfig().lease_s - 3)
    assert channel_state(router_cluster, 0, decode_id)[1] == 0


def test_killing_the_decode_worker_fails_every_request_on_its_channel_at_once(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    """An in-process router over the cluster's prefill worker and a decode worker of this
    test's own (which prefills locally); six requests mid-decode when it is killed."""
    (prefill_id, *_) = router_cluster.worker_ids(WorkerRole.PREFILL)
    engine = EngineConfig(
        model_dir=str(router_cluster.model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        attention_backend="torch",
        cuda_graphs=False,
    )
    victim = create_worker(
        WorkerConfig("chan-victim", WorkerRole.DECODE, engine),
        KVTransferConfig(),
        ActorPlacement(num_cpus=0),
    )
    info = ray.get(victim.start.remote(), timeout=240)
    directory = StaticDirectory([router_cluster.workers[prefill_id], (info, victim)])
    thresholds = AdmissionThresholds(local_prefill_threshold_tokens=MAX_MODEL_LEN)
    config = RouterConfig(
        model_dir=str(router_cluster.model_dir),
        grpc_port=0,
        admission=AdmissionConfig(thresholds=thresholds),
    )

    async def scenario() -> None:
        server = RouterServer(config, directory)
        port = await server.start()
        try:
            await server.wait_ready(min_decode=1, timeout_s=30)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GenerationStub(ch)
                calls = [
                    stub.Generate(pb.GenerateRequest(**greedy_request(
                        corpus_ids[100 * i : 100 * i + 30], 300)), timeout=120)
                    for i in range(6)
                ]  # fmt: skip
                for c in calls:
                    for _ in range(2):
                        msg = await asyncio.wait_for(c.read(), 60)
                        assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
                entry = server.view.entries["chan-victim"]
                assert entry.channel is not None and entry.channel.num_open == 6
                ray.kill(victim, no_restart=True)
                t0 = time.monotonic()
                for c in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        while await asyncio.wait_for(c.read(), ERROR_WITHIN_S) is not None:
                            pass
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert time.monotonic() - t0 < ERROR_WITHIN_S
                assert entry.channel.state is ChannelState.BROKEN
                assert entry.channel.num_open == 0
                assert not entry.alive  # out of placement before the next load poll
        finally:
            await server.stop()

    try:
        asyncio.run(scenario())
    finally:
        ray.kill(victim)
