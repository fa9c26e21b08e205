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
sizes differ); each holds a 256-block pool and a quarter of a CPU per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
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
from workers_harness import PLACEMENT, START_TIMEOUT_S, worker_config

from deploy.control.worker_actors import create_worker, follower_name, stop_worker, tp_group_name
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import WorkerDraining, WorkerRole, WorkerState

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12


@dataclasses.dataclass
class PPWorkers:
    p_pp2: Any
    """Prefill, 2 stages."""
    d1: Any
    """Decode, one rank."""
    d_tp2: Any
    """Decode, TP 2."""
    d_pp2: Any
    """Decode, 2 stages."""


def pp_config(
    model_dir: Path, worker_id: str, role: WorkerRole, pp: int, tp: int, redis_url: str
) -> Any:
    config = worker_config(model_dir, worker_id, role, redis_url)
    engine = dataclasses.replace(
        config.engine, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        kv_layout="head_major", tp_timeout_s=30.0,
    )  # fmt: skip
    return dataclasses.replace(config, engine=engine)


@pytest.fixture(scope="module")
def pp_workers(ray_cluster: None, tiny_model_dir: Path, redis_url: str) -> Iterator[PPWorkers]:
    transfer = KVTransferConfig(lease_s=30.0)
    specs = {
        "p_pp2": ("pp-p2", WorkerRole.PREFILL, 2, 1),
        "d1": ("pp-d1", WorkerRole.DECODE, 1, 1),
        "d_tp2": ("pp-dtp2", WorkerRole.DECODE, 1, 2),
        "d_pp2": ("pp-dpp2", WorkerRole.DECODE, 2, 1),
    }
    handles = {
        key: create_worker(
            pp_config(tiny_model_dir, wid, role, pp, tp, redis_url), transfer, PLACEMENT
        )
        for key, (wid, role, pp, tp) in specs.items()
    }
    try:
        infos = ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
        assert [(i.pp_size, i.tp_size) for i in infos] == [(2, 1), (1, 1), (1, 2), (2, 1)]
        assert {i.kv_layout for i in infos} == {"head_major_v1"}
        yield PPWorkers(**handles)
    finally:
        for key, h in handles.items():
            with contextlib.suppress(Exception):
                ray.get(h.shutdown.remote(), timeout=30)
            stop_worker(specs[key][0], h)


def serve_all(p: Any, d: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    async def run() -> list[Any]:
        return await asyncio.gather(
            *(serve(p, d, f"{tag}-{i}", x, greedy(MAX_TOKENS)) for i, x in enumerate(prompts))
        )

    return [s.token_ids for s in asyncio.run(run())]


@pytest.mark.parametrize("decode", ["d1", "d_tp2", "d_pp2"])
def test_hand_offs_from_a_pp_prefill_worker_give_transformers_tokens_and_leave_it_idle(
    pp_workers: PPWorkers,
    corpus_prompts: list[list[int]],
    hf_greedy_to_eos: Reference,
    decode: str,
) -> None:
    p, d = pp_workers.p_pp2, getattr(pp_workers, decode)
    prompts = corpus_prompts[:8]
    got = serve_all(p, d, prompts, f"pp2{decode}")
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        assert tokens == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
    stats = ray.get(d.transfer_stats.remote(), timeout=30)
    assert stats.transfers_done > 0 and stats.transfers_failed == 0
    wait_idle(p, d)
    assert ray.get(ray.get_actor(follower_name("pp-p2", 1)).ping.remote(), timeout=30) == (
        "serving"
    )


def test_a_pp_decode_worker_prefills_locally_token_exact(
    pp_workers: PPWorkers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    prompts = corpus_prompts[8:12]
    got = serve_all(None, pp_workers.d_pp2, prompts, "local")
    assert got == [hf_greedy_to_eos(x, MAX_TOKENS) for x in prompts]
    wait_idle(pp_workers.d_pp2)


def test_a_pp_worker_is_its_actor_plus_a_follower_per_stage_in_one_placement_group(
    pp_workers: PPWorkers,
) -> None:
    from ray.util import get_placement_group, placement_group_table

    table = placement_group_table(get_placement_group(tp_group_name("pp-p2")))
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
    info = ray.get(pp_workers.p_pp2.info.remote(), timeout=30)
    assert (info.pp_size, info.tp_size, info.num_kv_blocks) == (2, 1, 256)


def test_draining_pp_workers_finishes_what_they_hold_and_refuses_new_work(
    pp_workers: PPWorkers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    p, d = pp_workers.p_pp2, pp_workers.d_pp2
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
    ray_cluster: None, tiny_model_dir: Path, redis_url: str, corpus_prompts: list[list[int]]
) -> None:
    """Kill stage 1 of a PP=2 decode worker: its health check fails within seconds (the
    controller would replace it) and a request it serves ends with an error, not a hang."""
    config = pp_config(tiny_model_dir, "pp-dead", WorkerRole.DECODE, 2, 1, redis_url)
    handle = create_worker(config, KVTransferConfig(), PLACEMENT)
    try:
        ray.get(handle.start.remote(), timeout=START_TIMEOUT_S)
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
    finally:
        with contextlib.suppress(Exception):
            ray.get(handle.shutdown.remote(), timeout=30)
        stop_worker("pp-dead", handle)
