"""A client that cancels its stream leaves nothing behind: at every point of the request
(admission/prefill, hand-off, decode; disaggregated or prefilled locally) both workers'
KV blocks, leases, transfers and in-flight requests return to their idle baseline."""

from __future__ import annotations

import time

import grpc
import pytest
from router_client import generate, greedy_request
from router_harness import MAX_MODEL_LEN, RouterCluster

from kv_transfer.config import KVTransferConfig
from pdserve.v1 import serving_pb2 as pb

LEASE_S = KVTransferConfig().lease_s


@pytest.mark.parametrize(
    ("router", "messages_before_cancel", "local"),
    [
        pytest.param(0, 0, False, id="during prefill"),
        pytest.param(0, 1, False, id="right after the first token (hand-off)"),
        pytest.param(0, 4, False, id="mid-decode"),
        pytest.param(1, 4, True, id="mid-decode, prefilled locally"),
    ],
)
def test_client_cancel_frees_blocks_on_both_workers(
    router_cluster: RouterCluster,
    corpus_ids: list[int],
    router: int,
    messages_before_cancel: int,
    local: bool,
) -> None:
    router_cluster.wait_idle()
    with router_cluster.restored_thresholds(router):
        if local:
            router_cluster.admin(router).SetThresholds(
                pb.AdmissionThresholds(local_prefill_threshold_tokens=MAX_MODEL_LEN), timeout=10
            )
        prompt = corpus_ids[500 + 7 * messages_before_cancel : 1100]
        req = pb.GenerateRequest(**greedy_request(prompt, 400))
        call = router_cluster.generation(router).Generate(req, timeout=120)
        if messages_before_cancel == 0:
            time.sleep(0.02)
        else:
            for _, msg in zip(range(messages_before_cancel), call, strict=False):
                assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        # Well inside the prefill lease (10 s): blocks freed by the cancel, not by expiry.
        router_cluster.wait_idle(timeout_s=LEASE_S - 3)
    # The cluster still serves afterwards.
    assert generate(router_cluster.generation(router), prompt="The baker", max_tokens=2).final


def test_a_storm_of_cancels_and_deadlines_wedges_nothing(
    router_cluster: RouterCluster, corpus_ids: list[int]
) -> None:
    """200 requests on both routers at once, each cancelled or timed out at a random point
    (in admission, prefill, the hand-off or decode): every block, lease and transfer is
    back within the lease, and both routers serve afterwards."""
    import random

    router_cluster.wait_idle()
    rng = random.Random(7)
    calls = []
    for i in range(200):
        router = i % 2
        prompt = corpus_ids[rng.randrange(0, 2000) :][: rng.randrange(20, 200)]
        req = pb.GenerateRequest(**greedy_request(prompt, 300))
        if i % 3 == 0:  # a deadline that runs out somewhere in the request
            call = router_cluster.generation(router).Generate(req, timeout=rng.uniform(0.01, 2))
            calls.append((call, None))
        else:
            call = router_cluster.generation(router).Generate(req, timeout=120)
            calls.append((call, rng.uniform(0, 1.5)))
    t0 = time.monotonic()
    pending = sorted((at, i) for i, (_, at) in enumerate(calls) if at is not None)
    for at, i in pending:
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        calls[i][0].cancel()
    for call, _ in calls:
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), err.value.details()
    router_cluster.wait_idle(timeout_s=LEASE_S - 1)
    for router in (0, 1):
        out = generate(router_cluster.generation(router), prompt="The baker", max_tokens=3)
        assert out.final.usage.completion_tokens == 3
