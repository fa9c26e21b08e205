"""The controller actor dies mid-load (killed so that Ray restarts it, as after an OOM or a
node fault) on the shared real cluster: it comes back, adopts every worker and router that
outlived it (none orphaned, none started twice), goes on checking their health, and the
streams running meanwhile finish token-exact."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
from references import Reference
from router_client import generate, greedy_request
from router_harness import RouterCluster, kill_and_await_controller

from pdserve.v1 import serving_pb2 as pb
from vocabulary.worker_api import ACTOR_NAME_PREFIX

pytestmark = pytest.mark.timeout(300)


def _registry(controller: object) -> list[str]:
    return sorted(
        info.worker_id for info, _ in ray.get(controller.list_workers.remote(), timeout=10)
    )  # type: ignore[attr-defined]


def _named_workers() -> list[str]:
    return sorted(
        a["name"][len(ACTOR_NAME_PREFIX) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(ACTOR_NAME_PREFIX)
        and a.get("namespace") == "router-tests"  # the cluster's (its name), as theirs
    )


def test_a_restarted_controller_adopts_its_workers_and_streams_finish(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    router_cluster.wait_idle()
    controller = router_cluster.cluster.controller
    before = _registry(controller)
    assert before == _named_workers()
    prompts = [corpus_ids[700 + 41 * i : 700 + 41 * i + 120] for i in range(4)]
    tokens: list[list[int]] = [[] for _ in prompts]
    errors: list[grpc.RpcError | None] = [None] * len(prompts)

    def stream(i: int) -> None:
        req = pb.GenerateRequest(**greedy_request(prompts[i], 200))  # type: ignore[arg-type]
        try:
            for msg in router_cluster.generation(0).Generate(req, timeout=240):
                tokens[i].extend(msg.token_ids)
        except grpc.RpcError as e:
            errors[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while not all(len(t) >= 5 for t in tokens):
        assert time.monotonic() < end, "the streams did not start"
        time.sleep(0.05)
    events = kill_and_await_controller(controller)
    assert _registry(controller) == before == _named_workers()  # adopted, none orphaned
    restarted = [e for e in events if "controller restarted" in e][-1]
    assert f"adopted {len(before)} workers" in restarted and "2 routers" in restarted, restarted

    def health_loop_runs(self: object) -> bool:
        task = self._health_task  # type: ignore[attr-defined]
        return task is not None and not task.done()

    assert ray.get(controller.__ray_call__.remote(health_loop_runs), timeout=10)
    for t in threads:
        t.join(240)
    for i, prompt in enumerate(prompts):
        assert errors[i] is None, errors[i].details()  # type: ignore[union-attr]
        assert tokens[i] == hf_greedy(prompt, 200), i
    out = generate(router_cluster.generation(1), prompt="The baker opens", max_tokens=4)
    assert out.final.usage.completion_tokens == 4
    router_cluster.wait_idle()
