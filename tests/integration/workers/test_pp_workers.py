"""Pipeline-parallel workers on a real local Ray: a worker of 2 stages is its actor (stage 0)
plus a follower actor (stage 1) in one placement group, torch.distributed (gloo) between them,
and one NIXL agent per rank, each rank's pool holding its stage's layers. Hand-offs from a
PP=2 prefill worker to a PP=1, a TP=2 and a PP=2 decode worker over NIXL (the decode side
reading each layer range from the stage that holds it) give exactly the tokens transformers
gives; afterwards every worker is back at its idle baseline (rank 0 keeps the block books for
every stage: the ids are the same on each). A stage that dies takes its worker out: its health
check fails and a request in flight ends with an error, not a hang. Draining a PP prefill
worker waits for the leases it holds and refuses new prompts; draining a PP decode worker
finishes its streams token-exact and refuses new ones; both serve again once undrained.

Every worker uses the head-major KV pool (what `pdserve up` picks when prefill and decode TP
sizes differ); each holds a 256-block pool and a quarter of a CPU per rank. The workers are
the directory's `parallel_workers`, shared with test_tp_workers (the decode workers of one
rank and of TP 2 are the same ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import ray
from pd_client import (
    consume,
    decode_request,
    greedy,
    next_chunk,
    open_stream,
    prefill,
    serve,
    wait_idle,
    wait_until,
)
from references import Reference
from workers_harness import ParallelWorkers

from deploy.control.worker_actors import follower_name, stop_worker, tp_group_name
from vocabulary.worker_api import WorkerDraining, WorkerState

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12
SALT = "pp"
"""This module's prefix-cache entries: test_tp_workers serves the same prompts on the same
decode workers (`parallel_workers`), and a decode worker holding a prompt's blocks does not
pull them again."""


def serve_all(p: Any, d: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    async def run() -> list[Any]:
        return await asyncio.gather(
            *(
                serve(p, d, f"{tag}-{i}", x, greedy(MAX_TOKENS), cache_salt=SALT)
                for i, x in enumerate(prompts)
            )
        )

    return [s.token_ids for s in asyncio.run(run())]


@pytest.mark.parametrize("decode", ["d1", "d_tp2", "d_pp2"])
def test_hand_offs_from_a_pp_prefill_worker_give_transformers_tokens_and_leave_it_idle(
    parallel_workers: ParallelWorkers,
    corpus_prompts: list[list[int]],
    hf_greedy_to_eos: Reference,
    decode: str,
) -> None:
    p, d = parallel_workers.p_pp2, getattr(parallel_workers, decode)
    prompts = corpus_prompts[:8]
    before = ray.get(d.transfer_stats.remote(), timeout=30)
    got = serve_all(p, d, prompts, f"pp2{decode}")
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        assert tokens == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
    stats = ray.get(d.transfer_stats.remote(), timeout=30)
    assert stats.transfers_done > before.transfers_done
    assert stats.transfers_failed == before.transfers_failed
    wait_idle(p, d)
    assert ray.get(ray.get_actor(follower_name("pp-p2", 1)).ping.remote(), timeout=30) == (
        "serving"
    )


def test_a_pp_decode_worker_prefills_locally_token_exact(
    parallel_workers: ParallelWorkers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    prompts = corpus_prompts[8:12]
    got = serve_all(None, parallel_workers.d_pp2, prompts, "local")
    assert got == [hf_greedy_to_eos(x, MAX_TOKENS) for x in prompts]
    wait_idle(parallel_workers.d_pp2)


def test_a_pp_worker_is_its_actor_plus_a_follower_per_stage_in_one_placement_group(
    parallel_workers: ParallelWorkers,
) -> None:
    from ray.util import get_placement_group, placement_group_table

    table = placement_group_table(get_placement_group(tp_group_name("pp-p2")))
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    info = ray.get(parallel_workers.p_pp2.info.remote(), timeout=30)
    assert (info.pp_size, info.tp_size, info.num_kv_blocks) == (2, 1, 256)


def test_draining_pp_workers_finishes_what_they_hold_and_refuses_new_work(
    parallel_workers: ParallelWorkers,
    corpus_prompts: list[list[int]],
    hf_greedy_to_eos: Reference,
) -> None:
    p, d = parallel_workers.p_pp2, parallel_workers.d_pp2
    prompts = corpus_prompts[12:15]

    async def run() -> None:
        results = await asyncio.gather(
            *(prefill(p, f"drain-{i}", x, greedy(MAX_TOKENS)) for i, x in enumerate(prompts))
        )
        assert all(r.handle is not None for r in results)
        p_drained = p.drain.remote(60.0)
        ready, _ = await asyncio.to_thread(ray.wait, [p_drained], timeout=1.0)
        assert not ready, "drain returned while leases were held"
        with pytest.raises(WorkerDraining):
            await prefill(p, "drain-late", prompts[0], greedy(MAX_TOKENS))
        gens = [
            open_stream(d, decode_request(r.request_id, x, greedy(MAX_TOKENS), r))
            for r, x in zip(results, prompts, strict=True)
        ]
        firsts = [await next_chunk(g) for g in gens]
        d_drained = d.drain.remote(60.0)
        await asyncio.to_thread(
            wait_until, d, lambda w: w.state is WorkerState.DRAINING, 20.0, "draining"
        )
        with pytest.raises(WorkerDraining):  # a local prefill is new work too
            await consume(open_stream(d, decode_request("late", prompts[0], greedy(4))))
        for r, x, g, first in zip(results, prompts, gens, firsts, strict=True):
            chunks = [first, *await consume(g)]
            tokens = [r.first_token_id] + [t for c in chunks if c is not None for t in c.token_ids]
            assert tokens == hf_greedy_to_eos(x, MAX_TOKENS)
        assert await asyncio.wait_for(p_drained, 30) is True
        assert await asyncio.wait_for(d_drained, 30) is True
        await p.undrain.remote()
        await d.undrain.remote()
        again = await serve(p, d, "drain-after", prompts[1], greedy(MAX_TOKENS))
        assert again.token_ids == hf_greedy_to_eos(prompts[1], MAX_TOKENS)

    asyncio.run(run())
    wait_idle(p, d)


def test_a_dead_stage_takes_its_worker_out_and_fails_the_request_in_flight(
    parallel_workers: ParallelWorkers, corpus_prompts: list[list[int]]
) -> None:
    """Kill stage 1 of a PP=2 decode worker: its health check fails within seconds (the
    controller would replace it) and a request it serves ends with an error, not a hang."""
    handle = parallel_workers.pp_victim
    try:
        ray.kill(ray.get_actor(follower_name("pp-dead", 1)))
        deadline = time.monotonic() + 30
        unhealthy = None
        while time.monotonic() < deadline and unhealthy is None:
            try:
                ray.get(handle.ping.remote(), timeout=10)
            except Exception as e:  # WorkerUnhealthy, through Ray
                unhealthy = e
            time.sleep(0.5)
        assert unhealthy is not None and "rank 1" in str(unhealthy), unhealthy
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 (the worker's error, through Ray)
            serve_all(None, handle, corpus_prompts[:1], "dead")
        assert time.monotonic() - started < 45
    finally:  # gone for good: nothing else uses it
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=30)
        stop_worker("pp-dead", handle)
