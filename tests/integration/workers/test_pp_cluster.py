"""A pdserve cluster with a pipeline-parallel prefill worker (2 stages) and a one-rank decode
worker, on the session's Ray with the real controller, router, Redis and NIXL (the tiny model,
gloo):

- the PP worker is one worker to the router, the controller and the status (`pp_size` 2; its
  stage-1 rank is no worker of its own), and requests through the gRPC API give
  transformers' tokens (the decode worker reads each layer range from the stage holding it);
- killing its stage-1 rank takes the whole worker out of placement: requests in flight end
  cleanly (served, or a clean status), the controller replaces it (both stages, a new
  placement group; the old one removed), no block stays held, and the cluster serves again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import ray
from cpu_engine import cpu_engine
from references import Reference
from test_tp_cluster import TPCluster, generate, idle, prefill_id, prefill_ids, wait, workers

from deploy.control.worker_actors import follower_name, tp_group_name
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 16
NAME = "pp-tests"


@pytest.fixture(scope="module")
def pp_cluster(ray_cluster: None, tiny_model_dir: Path) -> Iterator[TPCluster]:
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.router_server import RouterConfig

    engine = cpu_engine(tiny_model_dir, num_kv_blocks=256, max_model_len=1024, tp_timeout_s=20.0)
    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name=NAME),
        router=RouterConfig(
            grpc_port=0, metrics_port=0, http_port=None, admin_port=0,
            admission=AdmissionConfig(
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=engine, num_prefill=1, num_decode=1, prefill_pp=2,
            health_interval_s=0.5, stall_timeout_s=10.0,
        ),
    )  # fmt: skip
    cluster = Cluster(config)
    with cluster:
        ep = cluster.endpoint
        assert ep is not None
        channel, admin = grpc.insecure_channel(ep.grpc[0]), grpc.insecure_channel(ep.admin[0])
        try:
            yield TPCluster(cluster, pb_grpc.GenerationStub(channel), pb_grpc.AdminStub(admin))
        finally:
            channel.close()
            admin.close()


def serve_concurrently(c: TPCluster, prompts: list[list[int]]) -> list[list[int] | Exception]:
    outcomes: list[list[int] | Exception] = [[] for _ in prompts]

    def run(i: int) -> None:
        try:
            outcomes[i] = generate(c, prompts[i])
        except grpc.RpcError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return outcomes


def test_a_pp2_prefill_worker_serves_the_cluster_as_one_worker_token_exact(
    pp_cluster: TPCluster, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    status = pp_cluster.admin.Status(pb.StatusRequest(), timeout=30)
    by_role = {w.role: w for w in status.workers}
    assert sorted(by_role) == ["decode", "prefill"]
    assert (by_role["prefill"].pp_size, by_role["prefill"].tp_size) == (2, 1)
    assert by_role["decode"].pp_size == 1
    prompts = corpus_prompts[:6]
    for i, got in enumerate(serve_concurrently(pp_cluster, prompts)):
        assert got == hf_greedy_to_eos(prompts[i], MAX_TOKENS), f"request {i}"
    for _, handle in workers(pp_cluster).values():
        wait(lambda h=handle: idle(h), "idle baseline", 30)


def test_a_killed_stage_takes_its_worker_out_and_the_controller_replaces_all_of_it(
    pp_cluster: TPCluster, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    old = prefill_id(pp_cluster)
    old_group = ray.util.get_placement_group(tp_group_name(old, NAME))
    prompts = corpus_prompts[6:14]
    killer = threading.Timer(
        0.5,
        lambda: ray.kill(ray.get_actor(follower_name(old, 1), namespace=NAME), no_restart=True),
    )
    killer.start()
    outcomes = serve_concurrently(pp_cluster, prompts)
    killer.join()
    for i, got in enumerate(outcomes):  # served (retried elsewhere) or a clean status
        if isinstance(got, grpc.RpcError):
            assert got.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        else:
            assert got == hf_greedy_to_eos(prompts[i], MAX_TOKENS), f"request {i}"
    wait(lambda: old not in workers(pp_cluster), f"{old} out of placement", 60)
    wait(lambda: any(w != old for w in prefill_ids(pp_cluster)), "a replacement", 180)
    new = prefill_id(pp_cluster)
    events = "\n".join(ray.get(pp_cluster.cluster.controller.recent_events.remote(), timeout=30))
    assert f"worker {old} is unhealthy" in events, events
    assert f"replaced a dead prefill worker with {new}" in events, events
    from ray.util import placement_group_table

    assert placement_group_table(old_group)["state"] == "REMOVED"
    stage1 = ray.get_actor(follower_name(new, 1), namespace=NAME)
    assert ray.get(stage1.ping.remote(), timeout=30) == "serving"
    for _, handle in workers(pp_cluster).values():
        wait(lambda h=handle: idle(h), "idle baseline", 30)
    for prompt in corpus_prompts[14:17]:
        assert generate(pp_cluster, prompt) == hf_greedy_to_eos(prompt, MAX_TOKENS)
