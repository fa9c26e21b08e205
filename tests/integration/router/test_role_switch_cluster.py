"""Role switching on a real cluster of its own (2 prefill + 1 decode workers on the tiny model,
Ray, embedded redis-server, NIXL over UCX, one router): a worker switches role under load with
streams in flight and none is lost or changes a token, no block is left held, the router
places the new role's work on it, its prefix-index entries stay true, it switches on to split
and back; refusals change nothing; a rebalance says whether it switched or restarted; a
restarted controller keeps the switched role."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc
import pytest
import ray
from cpu_engine import cpu_engine
from references import Reference
from router_client import generate, greedy_request, rpc_error
from router_harness import RouterCluster, kill_and_await_controller

from pdserve.v1 import serving_pb2 as pb

pytestmark = pytest.mark.timeout(600)
NAME = "switch-tests"


@pytest.fixture(scope="module")
def cluster(ray_cluster: None, tiny_model_dir: Path) -> Iterator[RouterCluster]:
    from admission.config import AdmissionConfig, AdmissionThresholds
    from deploy.control.cluster_spec import ClusterSpec
    from deploy.control.config_tree import LaunchConfig, PdserveConfig
    from deploy.control.launch import Cluster
    from router.router_server import RouterConfig

    config = PdserveConfig(
        model=str(tiny_model_dir),
        cluster=LaunchConfig(name=NAME),
        router=RouterConfig(
            grpc_port=0,
            metrics_port=None,
            http_port=None,
            admin_port=0,
            admission=AdmissionConfig(  # every prompt disaggregated: prefill workers work
                thresholds=AdmissionThresholds(local_prefill_threshold_tokens=0)
            ),
        ),
        workers=ClusterSpec(
            engine=cpu_engine(tiny_model_dir, num_kv_blocks=256, max_model_len=512),
            num_prefill=2,
            num_decode=1,
        ),
    )
    with Cluster(config) as c:
        ep = c.endpoint
        assert ep is not None
        listed = ray.get(c.controller.list_workers.remote(), timeout=30)
        channels = [grpc.insecure_channel(ep.grpc[0])]
        admin_channels = [grpc.insecure_channel(ep.admin[0])]
        try:
            yield RouterCluster(
                cluster=c, targets=ep.grpc, metrics_urls=ep.metrics, redis_url=ep.redis_url,
                model_dir=Path(ep.model_dir), model_id=listed[0][0].model_id,
                workers={info.worker_id: (info, h) for info, h in listed},
                channels=channels, admin_targets=ep.admin, admin_channels=admin_channels,
                name=NAME,
            )  # fmt: skip
        finally:
            for ch in channels + admin_channels:
                ch.close()


def roles(rc: RouterCluster) -> dict[str, str]:
    """Each worker's role as the router's status shows it (and `rc.workers` made current)."""
    listed = ray.get(rc.cluster.controller.list_workers.remote(), timeout=30)
    rc.workers = {info.worker_id: (info, h) for info, h in listed}
    status = rc.admin().Status(pb.StatusRequest(), timeout=10)
    return {w.worker_id: w.role for w in status.workers}


def switch(rc: RouterCluster, worker_id: str, role: str, **fields: object) -> pb.SwitchResponse:
    request = pb.SwitchRequest(worker_id=worker_id, role=role, **fields)  # type: ignore[arg-type]
    return rc.admin().Switch(request, timeout=120)


def wait(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting until {what}"
        time.sleep(0.1)


def streams(rc: RouterCluster, prompts: list[list[int]], max_tokens: int) -> list[pb.Timings]:
    """Run `prompts` at once; their final timings (every stream must finish)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(
            lambda p: generate(rc.generation(), timeout=240, **greedy_request(p, max_tokens)),
            prompts,
        ))  # fmt: skip
    assert all(len(s.token_ids) == max_tokens for s in done)
    return [s.final.timings for s in done]


def switch_under_load(
    rc: RouterCluster,
    prompts: list[list[int]],
    max_tokens: int,
    busy: str,
    worker_id: str,
    role: str,
    hf_greedy: Reference,
) -> pb.SwitchResponse:
    """Start half the streams; once `busy` holds two of them, switch `worker_id` to `role`
    while the other half arrive; every stream must finish with transformers' tokens and every
    worker come back to its idle baseline (no block held, none leased)."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            out = generate(rc.generation(), timeout=240, **greedy_request(prompts[i], max_tokens))
            results[i] = out.token_ids
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    half = len(threads) // 2
    for t in threads[:half]:
        t.start()
    wait(lambda: rc.loads()[busy].inflight_requests >= 2, f"streams in flight on {busy}")
    done: list[pb.SwitchResponse] = []
    switcher = threading.Thread(target=lambda: done.append(switch(rc, worker_id, role)))
    switcher.start()
    for t in threads[half:]:
        t.start()
    switcher.join(180)
    for t in threads:
        t.join(240)
    assert errors == []
    for i, prompt in enumerate(prompts):
        assert results[i] == hf_greedy(prompt, max_tokens), i
    (reply,) = done
    assert reply.switched and reply.role == role, reply.message
    rc.wait_idle()
    return reply


def test_workers_switch_role_under_load_losing_no_stream_and_leaking_no_block(
    cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    rc = cluster
    prompts = [corpus_ids[60 * i : 60 * i + 40 + 9 * i] for i in range(8)]
    # a prefill worker becomes a decode worker while decode-2 streams
    reply = switch_under_load(rc, prompts, 64, "decode-2", "prefill-1", "decode", hf_greedy)
    assert reply.message.startswith("prefill-1 switched from prefill to decode (drained ")
    assert roles(rc) == {"prefill-0": "prefill", "prefill-1": "decode", "decode-2": "decode"}
    # the router places decode work on it as on the other decode worker
    timings = streams(rc, [corpus_ids[900 + 37 * i :][:50] for i in range(6)], 24)
    assert {t.decode_worker for t in timings} == {"prefill-1", "decode-2"}
    assert {t.prefill_worker for t in timings} == {"prefill-0"}
    rc.wait_idle()
    # a decode worker with streams of its own becomes a prefill worker: they finish first
    prompts = [corpus_ids[700 + 50 * i : 700 + 50 * i + 30 + 7 * i] for i in range(8)]
    reply = switch_under_load(rc, prompts, 128, "decode-2", "decode-2", "prefill", hf_greedy)
    assert reply.requests_at_start >= 2 and reply.drain_s > 0, reply.message
    assert roles(rc) == {"prefill-0": "prefill", "prefill-1": "decode", "decode-2": "prefill"}
    timings = streams(rc, [corpus_ids[1100 + 37 * i :][:50] for i in range(6)], 24)
    assert {t.prefill_worker for t in timings} == {"prefill-0", "decode-2"}
    assert {t.decode_worker for t in timings} == {"prefill-1"}
    rc.wait_idle()


def test_a_call_of_a_role_a_worker_no_longer_serves_is_refused_as_draining(
    cluster: RouterCluster,
) -> None:
    """What a router that has not seen a switch yet would send: refused as by a draining
    worker, so the router places it elsewhere."""
    from vocabulary.worker_api import WorkerDraining

    with pytest.raises(WorkerDraining, match="prefill-1 serves the decode role now"):
        ray.get(cluster.handle("prefill-1").handshake_info.remote(), timeout=30)
    assert ray.get(cluster.handle("decode-2").channels.remote(), timeout=30) == []
    assert ray.get(cluster.handle("decode-2").renew.remote("any"), timeout=30) is False


def test_their_cached_prefixes_stay_in_the_index(cluster: RouterCluster) -> None:
    """Both switched workers still hold, and the index still lists, the blocks they cached
    in their old roles and since: the index entries of a switched worker are kept, true for
    its new role (the same pool, the same blocks)."""
    rc = cluster

    def cached(worker: object) -> set[object]:
        hashes, _ = worker.runtime.driver.call(lambda e: e.cached_block_hashes()).result(30)  # type: ignore[attr-defined]
        return set(hashes)

    index = rc.prefix_index()

    def listed(worker_id: str) -> bool:  # (the publisher sends pool changes a moment later)
        held = ray.get(rc.handle(worker_id).__ray_call__.remote(cached), timeout=30)
        assert held, f"{worker_id} kept no cached block"
        return all(index.lookup([h]).blocks_cached(worker_id) == 1 for h in held)

    try:
        for worker_id in ("prefill-1", "decode-2"):
            wait(partial(listed, worker_id), f"the index lists every block {worker_id} caches")
    finally:
        index.close()


def test_a_worker_switches_on_to_split_and_back_serving_each_role(
    cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    rc = cluster
    prompt = corpus_ids[1300:1360]
    for wid, role in (("prefill-1", "split"), ("decode-2", "decode"), ("prefill-1", "prefill")):
        reply = switch(rc, wid, role, timeout_s=60)
        assert reply.switched and reply.role == role, reply.message
        assert roles(rc)[wid] == role
        out = generate(rc.generation(), timeout=120, **greedy_request(prompt, 16))
        assert out.token_ids == hf_greedy(prompt, 16)
    status = rc.admin().Status(pb.StatusRequest(), timeout=10)
    assert {w.worker_id: w.role for w in status.workers} == {
        "prefill-0": "prefill", "prefill-1": "prefill", "decode-2": "decode"
    }  # fmt: skip
    assert not any(w.HasField("split") for w in status.workers)
    rc.wait_idle()


@pytest.mark.parametrize(
    ("worker_id", "role", "code", "details"),
    [
        ("decode-9", "prefill", grpc.StatusCode.NOT_FOUND, "worker_id: unknown worker 'decode-9'"),
        ("prefill-1", "router", grpc.StatusCode.INVALID_ARGUMENT,
         "role: one of prefill, decode, colocated, split, got 'router'"),
        ("prefill-1", "prefill", grpc.StatusCode.FAILED_PRECONDITION,
         "prefill-1 is a prefill worker already"),
        ("decode-2", "prefill", grpc.StatusCode.FAILED_PRECONDITION,
         "decode-2 is the last ready decode worker: switching it would leave none (add one "
         "first, or pass force)"),
    ],
)  # fmt: skip
def test_a_refused_switch_names_what_is_wrong_and_changes_nothing(
    cluster: RouterCluster, worker_id: str, role: str, code: grpc.StatusCode, details: str
) -> None:
    before = roles(cluster)
    err = rpc_error(switch, cluster, worker_id, role)
    assert (err.code(), err.details()) == (code, details)
    assert roles(cluster) == before
    states = {w.worker_id: w.state for w in cluster.admin().Status(pb.StatusRequest()).workers}
    assert set(states.values()) == {pb.WORKER_STATE_READY}


def test_a_draining_worker_is_refused_until_undrained(cluster: RouterCluster) -> None:
    admin = cluster.admin()
    drained = admin.Drain(pb.DrainRequest(worker_id="prefill-1", stop=False, timeout_s=30))
    assert drained.drained, drained.message
    err = rpc_error(switch, cluster, "prefill-1", "decode")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        "prefill-1 is drained: only a ready worker switches (`pdserve undrain prefill-1` first)"
    )
    admin.Undrain(pb.UndrainRequest(worker_id="prefill-1"), timeout=30)
    assert roles(cluster)["prefill-1"] == "prefill"


def test_rebalance_switches_where_it_can_and_restarts_when_asked(cluster: RouterCluster) -> None:
    admin = cluster.admin()
    by_switch = admin.Rebalance(pb.RebalanceRequest(prefill=1, decode=2, timeout_s=60), timeout=300)
    assert list(by_switch.switched) == ["prefill-1"] and not by_switch.started
    assert by_switch.message == "now 1 prefill + 2 decode (switched ['prefill-1'] in place)"
    by_restart = admin.Rebalance(
        pb.RebalanceRequest(prefill=2, decode=1, timeout_s=60, restart=True), timeout=300
    )
    # the youngest decode-side worker goes (a switched worker keeps its age)
    assert not by_restart.switched and list(by_restart.stopped) == ["decode-2"]
    (new,) = by_restart.started
    assert by_restart.message == (
        f"now 2 prefill + 1 decode (by restart: stopped ['decode-2']; started ['{new}'])"
    )
    assert roles(cluster) == {"prefill-0": "prefill", "prefill-1": "decode", new: "prefill"}


def test_a_restarted_controller_adopts_a_switched_worker_in_its_new_role(
    cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    controller = cluster.cluster.controller
    (new,) = [w for w in roles(cluster) if w not in ("prefill-0", "prefill-1")]
    assert switch(cluster, new, "decode").switched
    kill_and_await_controller(controller)
    described = {d["worker_id"]: d["role"] for d in ray.get(controller.describe.remote())}
    assert described == {"prefill-0": "prefill", "prefill-1": "decode", new: "decode"}
    wait(lambda: roles(cluster)[new] == "decode", "the router lists the adopted worker")
    prompt = corpus_ids[1500:1540]
    out = generate(cluster.generation(), timeout=120, **greedy_request(prompt, 8))
    assert out.token_ids == hf_greedy(prompt, 8)
    cluster.wait_idle()
