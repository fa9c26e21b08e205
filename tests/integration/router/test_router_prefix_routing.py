"""Cache-aware placement end to end: a prompt that shares a long prefix with an earlier one
goes to the prefill worker that holds it, as the Redis index says and the worker's cache-hit
counter confirms."""

from __future__ import annotations

import time
import uuid

import ray
from references import Reference
from router_client import generate, greedy_request
from router_harness import RouterCluster

from prefix_index.index import PrefixIndex
from vocabulary.block_hash import BlockHash, hash_chain, hash_extra
from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import WorkerRole

BLOCK = 16


def _chain(cluster: RouterCluster, prompt: list[int], salt: str) -> list[BlockHash]:
    return hash_chain(prompt, BLOCK, hash_extra(cluster.model_id, salt))


def _salt() -> str:
    """A cache salt of its own keeps this test's prefixes apart from every other test's."""
    return f"prefix-test-{uuid.uuid4().hex}"


def _wait_indexed(index: PrefixIndex, chain: list[BlockHash], worker_id: str) -> None:
    """Wait until the index says `worker_id` holds the whole chain (KV events are async)."""
    end = time.monotonic() + 15
    while index.lookup(chain).blocks_cached(worker_id) < len(chain):
        assert time.monotonic() < end, index.lookup(chain)
        time.sleep(0.05)


def _hit_tokens(cluster: RouterCluster) -> dict[str, int]:
    return {w: load.engine.num_cache_hit_tokens for w, load in cluster.loads().items()}


def test_shared_prefix_goes_to_the_prefill_worker_that_holds_it(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    """Seed a 240-token prefix on the prefill worker that tie-breaking would NOT pick (the
    second by id), through its actor; the router must still send the prompt there."""
    prefill_ids = router_cluster.worker_ids(WorkerRole.PREFILL)
    holder = prefill_ids[-1]
    prefix = corpus_ids[0:240]  # 15 full blocks
    prompt = prefix + corpus_ids[240:300]
    salt = _salt()
    handle = router_cluster.handle(holder)
    seed = PrefillRequest("seed-prefix", tuple(prefix), SamplingParams(max_tokens=2), salt)
    seeded = ray.get(handle.prefill.remote(seed), timeout=60)
    assert seeded.handle is not None
    ray.get(handle.abort.remote("seed-prefix"), timeout=30)  # end the lease: blocks stay cached
    index = router_cluster.prefix_index()
    try:
        _wait_indexed(index, _chain(router_cluster, prefix, salt), holder)
        match = index.lookup(_chain(router_cluster, prompt, salt))
        assert match.blocks_cached(holder) == 15
        assert all(match.blocks_cached(w) == 0 for w in prefill_ids if w != holder)
    finally:
        index.close()

    before = _hit_tokens(router_cluster)
    out = generate(router_cluster.generation(0), **greedy_request(prompt, 8, cache_salt=salt))
    after = _hit_tokens(router_cluster)
    assert out.final.timings.prefill_worker == holder
    assert out.final.usage.cached_prompt_tokens == 240
    assert after[holder] - before[holder] == 240
    assert all(after[w] == before[w] for w in prefill_ids if w != holder)
    assert out.token_ids == hf_greedy(prompt, 8)


def test_second_request_sharing_a_long_prefix_lands_on_the_first_ones_worker(
    router_cluster: RouterCluster, corpus_ids: list[int], hf_greedy: Reference
) -> None:
    first_prompt = corpus_ids[1000:1230]  # 14 full blocks + 6 tokens
    second_prompt = first_prompt + corpus_ids[1500:1540]
    stub = router_cluster.generation(0)
    salt = _salt()
    first = generate(stub, **greedy_request(first_prompt, 4, cache_salt=salt))
    worker = first.final.timings.prefill_worker
    assert worker in router_cluster.worker_ids(WorkerRole.PREFILL)
    index = router_cluster.prefix_index()
    try:
        _wait_indexed(index, _chain(router_cluster, first_prompt, salt), worker)
    finally:
        index.close()
    before = _hit_tokens(router_cluster)
    second = generate(stub, **greedy_request(second_prompt, 8, cache_salt=salt))
    after = _hit_tokens(router_cluster)
    assert second.final.timings.prefill_worker == worker
    assert second.final.usage.cached_prompt_tokens == 14 * BLOCK
    assert after[worker] - before[worker] == 14 * BLOCK
    assert second.token_ids == hf_greedy(second_prompt, 8)
