"""What the router relies on from the workers, checked directly on the actors."""

from __future__ import annotations

import time

import ray
from router_harness import RouterCluster

from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole


def test_abort_of_a_waiting_prefill_ends_the_prefill_call(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    """The router aborts a prefill whose client went away; the pending `prefill` call must end
    too (else the worker counts it in flight forever and a drain never finishes)."""
    router_cluster.wait_idle()
    (worker, *_) = router_cluster.worker_ids(WorkerRole.PREFILL)
    handle = router_cluster.handle(worker)
    # Three 1000-token prompts fill more than one step's 2048-token budget: the last waits.
    reqs = [
        PrefillRequest(f"abort-probe-{i}", tuple(corpus_ids[i * 300 : i * 300 + 1000]),
                       SamplingParams(max_tokens=2))
        for i in range(3)
    ]  # fmt: skip
    refs = [handle.prefill.remote(r) for r in reqs]
    ray.get(handle.abort.remote(reqs[-1].request_id), timeout=30)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
    for r in reqs[:-1]:
        ray.get(handle.abort.remote(r.request_id), timeout=30)  # end their leases
    assert len(ready) == len(refs), "an aborted prefill call never returned"
    end = time.monotonic() + 10
    while ray.get(handle.load.remote(), timeout=30).inflight_requests:
        assert time.monotonic() < end, "prefill calls still in flight 10 s after their abort"
        time.sleep(0.1)
