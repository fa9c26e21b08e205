"""The host KV tier through the whole cluster: a prompt whose prefix one prefill worker holds
only in its host tier (its device pool has cycled since) goes to that worker, not to the cold
one, and decodes token-exact against transformers (the prefix is onboarded, the hand-off
lends its host-tier copies, the decode worker reads them from the prefill worker's host
memory over NIXL). A cancel or a drain racing that request loses nothing and leaves every
pool, device and host, at its idle baseline (read from the workers)."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import ray
from references import Reference
from router_client import generate, greedy_request
from router_harness import KV_BLOCKS, RouterCluster

from pdserve.v1 import serving_pb2 as pb
from vocabulary.block_hash import BlockHash, hash_chain, hash_extra
from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole

BLOCK = 16
PREFIX_BLOCKS = 15


def _chain(cluster: RouterCluster, prompt: list[int], salt: str) -> list[BlockHash]:
    return hash_chain(prompt, BLOCK, hash_extra(cluster.model_id, salt))


def _prefill(cluster: RouterCluster, worker: str, rid: str, prompt: list[int], salt: str) -> None:
    """Prefill `prompt` on `worker` through its actor and end the lease: the blocks stay
    cached there (device pool, then host tier once evicted)."""
    handle = cluster.handle(worker)
    req = PrefillRequest(rid, tuple(prompt), SamplingParams(max_tokens=2), salt)
    assert ray.get(handle.prefill.remote(req), timeout=60).handle is not None
    ray.get(handle.abort.remote(rid), timeout=30)


def host_only_prefix(
    cluster: RouterCluster, corpus_ids: list[int], holder: str
) -> tuple[list[int], str]:
    """A 240-token prefix (a salt of its own) that `holder` holds in its host tier only, as
    the Redis index says: computed there, then its device pool cycled with other prompts."""
    salt = f"host-tier-{uuid.uuid4().hex}"
    prefix = corpus_ids[0 : PREFIX_BLOCKS * BLOCK]
    _prefill(cluster, holder, f"seed-{salt}", prefix, salt)
    cycled = 0
    for i in range(20):  # distinct salts: none of these hits the prefix or each other
        filler = corpus_ids[100 : 100 + 900]
        _prefill(cluster, holder, f"cycle-{salt}-{i}", filler, f"{salt}-cycle-{i}")
        cycled += len(filler) // BLOCK
        if cycled > 2 * KV_BLOCKS:
            break
    index = cluster.prefix_index()
    chain = _chain(cluster, prefix, salt)
    try:
        end = time.monotonic() + 15
        while True:  # KV events reach the index asynchronously
            match = index.lookup(chain)
            if match.host_blocks(holder) == PREFIX_BLOCKS:
                break
            assert time.monotonic() < end, match
            time.sleep(0.05)
        assert match.blocks_cached(holder) == PREFIX_BLOCKS
        assert all(w.worker_id == holder for w in match.workers)  # the other one is cold
    finally:
        index.close()
    return prefix, salt


def _host_counts(cluster: RouterCluster, worker: str) -> tuple[int, int]:
    """(prompt tokens onboarded from the host tier, hand-off blocks lent from it)."""
    engine = cluster.loads()[worker].engine
    assert engine.host_tier is not None
    return engine.num_host_hit_tokens, engine.host_tier.num_lent


def test_the_router_places_a_prompt_on_the_worker_holding_its_prefix_in_host_memory(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    router_cluster.wait_idle()
    prefill_ids = router_cluster.worker_ids(WorkerRole.PREFILL)
    holder = prefill_ids[-1]  # not the one tie-breaking would pick
    prefix, salt = host_only_prefix(router_cluster, corpus_ids, holder)
    prompt = prefix + corpus_ids[300:360]
    hits, lent = _host_counts(router_cluster, holder)
    out = generate(router_cluster.generation(0), **greedy_request(prompt, 8, cache_salt=salt))
    assert out.final.timings.prefill_worker == holder
    assert out.final.usage.cached_prompt_tokens == PREFIX_BLOCKS * BLOCK
    # onboarded, then handed off from the host tier: the decode read them from host memory
    assert _host_counts(router_cluster, holder) == (hits + PREFIX_BLOCKS * BLOCK, lent + 15)
    assert out.token_ids == hf_greedy(prompt, 8)
    loads = router_cluster.wait_idle()
    tier = loads[holder].engine.host_tier
    assert tier is not None and tier.num_pinned == 0 and tier.onboard.inflight_blocks == 0


@pytest.mark.parametrize("cancel_after_s", [0.0, 0.05, 0.2])
def test_a_cancel_racing_the_onboard_leaves_both_tiers_at_baseline(
    router_cluster: RouterCluster, corpus_ids: list[int], cancel_after_s: float
) -> None:
    router_cluster.wait_idle()
    holder = router_cluster.worker_ids(WorkerRole.PREFILL)[-1]
    prefix, salt = host_only_prefix(router_cluster, corpus_ids, holder)
    req = pb.GenerateRequest(**greedy_request(prefix + corpus_ids[300:700], 200, cache_salt=salt))
    call = router_cluster.generation(0).Generate(req, timeout=60)
    time.sleep(cancel_after_s)
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    loads = router_cluster.wait_idle(timeout_s=7)  # freed by the cancel, not a lease expiry
    tier = loads[holder].engine.host_tier
    assert tier is not None and tier.num_pinned == 0
    # nothing was lost: the holder still holds the whole prefix, in one tier or the other
    index = router_cluster.prefix_index()
    try:
        chain = _chain(router_cluster, prefix, salt)
        end = time.monotonic() + 15
        while index.lookup(chain).blocks_cached(holder) != PREFIX_BLOCKS:
            assert time.monotonic() < end, index.lookup(chain)
            time.sleep(0.05)
    finally:
        index.close()


def test_a_drain_racing_a_host_tier_request_finishes_it_and_leaves_baseline(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    router_cluster.wait_idle()
    holder = router_cluster.worker_ids(WorkerRole.PREFILL)[-1]
    prefix, salt = host_only_prefix(router_cluster, corpus_ids, holder)
    prompt = prefix + corpus_ids[300:340]
    results: list[object] = []

    def run() -> None:
        try:
            results.append(
                generate(
                    router_cluster.generation(0), **greedy_request(prompt, 30, cache_salt=salt)
                )
            )
        except Exception as e:  # reported below
            results.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    handle = router_cluster.handle(holder)
    try:
        end = time.monotonic() + 10
        while not router_cluster.loads()[holder].held() and thread.is_alive():
            assert time.monotonic() < end
            time.sleep(0.002)
        assert ray.get(handle.drain.remote(30.0), timeout=40)  # waits for its lease to end
        thread.join(timeout=60)
    finally:
        ray.get(handle.undrain.remote(), timeout=10)
    [out] = results
    assert not isinstance(out, Exception), out
    assert out.final.timings.prefill_worker == holder  # type: ignore[attr-defined]
    assert out.token_ids == hf_greedy(prompt, 30)  # type: ignore[attr-defined]
    loads = router_cluster.wait_idle()
    tier = loads[holder].engine.host_tier
    assert tier is not None and tier.num_pinned == 0
