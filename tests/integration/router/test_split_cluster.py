"""A cluster of one split worker (`pdserve up --split 1`: prefill and decode loops in one
worker): the router places every prompt on it, the tokens are transformers' greedy ones, the
status shows the worker's split, and the worker is idle again afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cpu_engine import cpu_engine
from references import Reference
from router_client import generate, greedy_request

from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def split_cluster(
    ray_cluster: None, tiny_model_dir: Path
) -> Iterator[tuple[grpc.Channel, grpc.Channel]]:
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.router_server import RouterConfig

    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name="split-tests"),
        router=RouterConfig(grpc_port=0, metrics_port=None, http_port=None, admin_port=0),
        workers=ClusterSpec(
            engine=cpu_engine(tiny_model_dir, num_kv_blocks=256, max_model_len=512),
            num_prefill=0,
            num_decode=0,
            num_split=1,
        ),
    )
    cluster = Cluster(config)
    with cluster:
        ep = cluster.endpoint
        assert ep is not None
        data, admin = grpc.insecure_channel(ep.grpc[0]), grpc.insecure_channel(ep.admin[0])
        try:
            yield data, admin
        finally:
            data.close()
            admin.close()


def test_split_worker_serves_greedy_tokens_of_transformers(
    split_cluster: tuple[grpc.Channel, grpc.Channel],
    corpus_ids: list[int],
    hf_greedy: Reference,
) -> None:
    data, admin = split_cluster
    stub = pb_grpc.GenerationStub(data)
    prompts = [corpus_ids[i : i + n] for i, n in ((0, 9), (40, 70), (200, 33), (500, 120))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(
            pool.map(lambda p: generate(stub, **greedy_request(p, 12)), prompts)  # type: ignore[arg-type]
        )
    for prompt, streamed in zip(prompts, streams, strict=True):
        assert streamed.token_ids == hf_greedy(prompt, 12)
    st = pb_grpc.AdminStub(admin).Status(pb.StatusRequest(), timeout=10)
    (worker,) = st.workers
    assert worker.role == "split" and worker.HasField("split")
    assert not worker.split.partitioned and "no CUDA device" in worker.split.reason
    assert worker.split.handoffs == len(prompts)
    assert 0 < worker.split.handoff_us_mean <= worker.split.handoff_us_max

    deadline = time.monotonic() + 10
    while True:  # the worker is idle again once its last stream has ended
        w = pb_grpc.AdminStub(admin).Status(pb.StatusRequest(), timeout=10).workers[0]
        if w.inflight_requests == 0 and w.running_requests == 0 and w.queued_requests == 0:
            break
        assert time.monotonic() < deadline, w
        time.sleep(0.2)
