"""A pdserve cluster with a tensor-parallel prefill worker (TP 2) and a one-rank decode worker,
on the session's Ray with the real controller, router, Redis and NIXL (the tiny model, gloo):

- the TP worker is one worker to the router, the controller and the status (its follower is
  no worker of its own), and requests through the gRPC API give transformers' tokens (the
  hand-off from 2 ranks to 1 reads head slices of a head-major pool: `up` picks it because
  prefill and decode TP differ);
- killing its follower rank takes the whole worker out of placement: requests in flight end
  cleanly (served, or a clean status), the controller replaces it (both ranks, a new
  placement group; the old one removed), no block stays held, and the cluster serves again;
- a controller that dies and comes back adopts the TP worker with its follower rank and
  placement group (none started again), and it goes on serving; a worker-named actor that
  is not the cluster's is left alone;
- a rebalance starts and drains a TP worker as one worker (its ranks go with it), through
  that restarted controller;
- stopping the cluster leaves no rank actor or placement group behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
from cpu_engine import cpu_engine
from references import Reference

from deploy.control.worker_actors import follower_name, tp_group_name
from pdserve.v1 import serving_pb2 as pb
from pdserve.v1 import serving_pb2_grpc as pb_grpc
from vocabulary.worker_api import ACTOR_NAME_PREFIX, WorkerRole

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 16


@dataclass
class TPCluster:
    cluster: Any
    stub: pb_grpc.GenerationStub
    admin: pb_grpc.AdminStub


@pytest.fixture(scope="module")
def tp_cluster(ray_cluster: None, tiny_model_dir: Path) -> Iterator[TPCluster]:
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.router_server import RouterConfig

    engine = cpu_engine(tiny_model_dir, num_kv_blocks=256, max_model_len=1024, tp_timeout_s=20.0)
    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name="tp-tests"),
        router=RouterConfig(
            grpc_port=0, metrics_port=0, http_port=None, admin_port=0,
            admission=AdmissionConfig(
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=engine, num_prefill=1, num_decode=1, prefill_tp=2, decode_tp=1,
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


def workers(c: TPCluster) -> dict[str, Any]:
    """The controller's workers: id -> (info, handle)."""
    listed = ray.get(c.cluster.controller.list_workers.remote(), timeout=30)
    return {info.worker_id: (info, handle) for info, handle in listed}


def prefill_id(c: TPCluster) -> str:
    (wid,) = [w for w, (info, _) in workers(c).items() if info.role is WorkerRole.PREFILL]
    return wid


def generate(c: TPCluster, prompt: list[int]) -> list[int]:
    req = pb.GenerateRequest(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    return [t for m in c.stub.Generate(req, timeout=120) for t in m.token_ids]


def wait(cond: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.2)


def idle(handle: Any) -> bool:
    return ray.get(handle.load.remote(), timeout=30).held() == ""


def test_a_tp2_prefill_worker_serves_the_cluster_as_one_worker_token_exact(
    tp_cluster: TPCluster, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    status = tp_cluster.admin.Status(pb.StatusRequest(), timeout=30)
    assert sorted(w.role for w in status.workers) == ["decode", "prefill"]
    by_role = {w.role: w for w in status.workers}
    assert (by_role["prefill"].tp_size, by_role["decode"].tp_size) == (2, 1)
    assert {w.kv_layout for w in status.workers} == {"head_major_v1"}
    prompts = corpus_prompts[:6]
    results: list[list[int]] = [[] for _ in prompts]
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(i, generate(tp_cluster, prompts[i]))
        )
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
    for _, handle in workers(tp_cluster).values():
        wait(lambda h=handle: idle(h), "idle baseline", 30)


def test_a_killed_follower_rank_takes_its_worker_out_and_the_controller_replaces_all_of_it(
    tp_cluster: TPCluster, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    old = prefill_id(tp_cluster)
    old_group = ray.util.get_placement_group(tp_group_name(old, "tp-tests"))
    prompts = corpus_prompts[6:14]
    outcomes: list[list[int] | grpc.RpcError | None] = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            outcomes[i] = generate(tp_cluster, prompts[i])
        except grpc.RpcError as e:
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    ray.kill(ray.get_actor(follower_name(old, 1), namespace="tp-tests"), no_restart=True)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    for i, got in enumerate(outcomes):  # served (retried elsewhere) or a clean status
        if isinstance(got, grpc.RpcError):
            assert got.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        else:
            assert got == hf_greedy_to_eos(prompts[i], MAX_TOKENS), f"request {i}"
    wait(lambda: old not in workers(tp_cluster), f"{old} out of placement", 60)
    wait(lambda: any(w != old for w in prefill_ids(tp_cluster)), "a replacement", 180)
    new = prefill_id(tp_cluster)
    events = "\n".join(ray.get(tp_cluster.cluster.controller.recent_events.remote(), timeout=30))
    assert f"worker {old} is unhealthy" in events and "TP ranks died" in events, events
    assert f"replaced a dead prefill worker with {new}" in events, events
    from ray.util import placement_group_table

    assert placement_group_table(old_group)["state"] == "REMOVED"
    assert_only_live_ranks(tp_cluster)
    assert (
        ray.get(
            ray.get_actor(follower_name(new, 1), namespace="tp-tests").ping.remote(), timeout=30
        )
        == "serving"
    )
    for _, handle in workers(tp_cluster).values():
        wait(lambda h=handle: idle(h), "idle baseline", 30)
    for prompt in corpus_prompts[14:17]:
        assert generate(tp_cluster, prompt) == hf_greedy_to_eos(prompt, MAX_TOKENS)


def prefill_ids(c: TPCluster) -> list[str]:
    return [w for w, (info, _) in workers(c).items() if info.role is WorkerRole.PREFILL]


def rank_actors() -> set[str]:
    """Names of live follower-rank actors and live TP placement groups on this Ray."""
    from ray.util import placement_group_table

    actors = {
        a["name"]
        for a in ray.util.list_named_actors(True)
        if "pdserve-tp-rank" in a["name"] and a.get("namespace") == "tp-tests"
    }
    groups = {
        g["name"] for g in placement_group_table().values()
        if g["name"].startswith("tp-tests-tp-") and g["state"] != "REMOVED"
    }  # fmt: skip
    return actors | groups


def assert_only_live_ranks(c: TPCluster) -> None:
    live = [w for w, (info, _) in workers(c).items() if info.tp_size > 1]
    want = {follower_name(w, 1) for w in live} | {tp_group_name(w, "tp-tests") for w in live}
    wait(lambda: rank_actors() == want, f"only {sorted(want)} on Ray ({sorted(rank_actors())})", 30)


@ray.remote(num_cpus=0)
class Bystander:
    def ping(self) -> str:
        return "here"


def test_a_restarted_controller_adopts_the_tp_worker_with_its_rank_and_group(
    tp_cluster: TPCluster, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    controller = tp_cluster.cluster.controller
    before = workers(tp_cluster)
    tp_id = prefill_id(tp_cluster)
    ranks = rank_actors()
    assert {follower_name(tp_id, 1), tp_group_name(tp_id, "tp-tests")} <= ranks
    # a worker-named actor that some other code started in the namespace: not the cluster's
    bystander = Bystander.options(  # type: ignore[attr-defined]
        name=f"{ACTOR_NAME_PREFIX}bystander", namespace="tp-tests"
    ).remote()
    ray.kill(controller, no_restart=False)  # dies; Ray makes it again from the same spec

    def restarted() -> bool:
        try:
            events = ray.get(controller.recent_events.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
        return any("controller restarted" in e for e in events)

    wait(restarted, "the controller back", 120)
    after = workers(tp_cluster)
    assert sorted(after) == sorted(before)  # adopted: none started again, none orphaned
    events = ray.get(controller.recent_events.remote(), timeout=10)
    assert any("left alone: bystander" in e for e in events), events
    assert ray.get(bystander.ping.remote(), timeout=30) == "here"
    ray.kill(bystander)
    assert after[tp_id][0].tp_size == 2
    assert rank_actors() == ranks  # the follower rank and the group stay the worker's
    assert (
        ray.get(
            ray.get_actor(follower_name(tp_id, 1), namespace="tp-tests").ping.remote(), timeout=30
        )
        == "serving"
    )

    def listed() -> bool:  # the router's view fills again from the restarted controller
        status = tp_cluster.admin.Status(pb.StatusRequest(), timeout=30)
        return any(
            (w.role, w.worker_id, w.tp_size) == ("prefill", tp_id, 2) for w in status.workers
        )

    wait(listed, "the adopted TP worker in the cluster status", 60)
    for prompt in corpus_prompts[17:20]:
        assert generate(tp_cluster, prompt) == hf_greedy_to_eos(prompt, MAX_TOKENS)
    # the tests after this one rebalance and stop the cluster through the restarted controller


def test_rebalance_starts_and_drains_a_tp_worker_as_one_worker(tp_cluster: TPCluster) -> None:
    controller = tp_cluster.cluster.controller
    report = ray.get(controller.rebalance.remote(2, 1, 60.0), timeout=240)
    assert len(report.started) == 1 and report.stopped == ()
    assert len(prefill_ids(tp_cluster)) == 2  # two workers, four prefill ranks
    assert_only_live_ranks(tp_cluster)
    report = ray.get(controller.rebalance.remote(1, 1, 60.0), timeout=240)
    assert report.started == () and len(report.stopped) == 1
    assert_only_live_ranks(tp_cluster)  # the stopped worker's rank and group are gone


def test_stopping_the_cluster_leaves_no_rank_or_placement_group(tp_cluster: TPCluster) -> None:
    assert rank_actors()  # the TP worker's follower and group are there
    tp_cluster.cluster.stop()
    wait(lambda: not rank_actors(), f"nothing left ({sorted(rank_actors())})", 30)
