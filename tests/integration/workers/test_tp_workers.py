"""Tensor-parallel workers on a real local Ray: a worker of TP size 2 is its actor (rank 0)
plus a follower actor in one placement group, torch.distributed (gloo) between them, and one
NIXL agent per rank. Hand-offs between TP layouts (P TP=2 → D TP=1, P TP=1 → D TP=2, and
2 → 2) over NIXL give exactly the tokens transformers gives; afterwards every worker is back at
its idle baseline (rank 0 keeps the block books for all ranks: the ids are the same on each)
and no follower holds a read.

Every worker uses the head-major KV pool (what `pdserve up` picks when prefill and decode TP
sizes differ); each holds a 256-block pool and a quarter of a CPU per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from pd_client import greedy, serve, wait_idle
from references import Reference
from workers_harness import PLACEMENT, START_TIMEOUT_S, worker_config

from deploy.control.worker_actors import create_worker, follower_name, stop_worker, tp_group_name
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import WorkerRole

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 12


@dataclasses.dataclass
class TPWorkers:
    p2: Any
    """Prefill, TP 2."""
    d2: Any
    """Decode, TP 2."""
    p1: Any
    """Prefill, one rank."""
    d1: Any
    """Decode, one rank."""


def tp_config(model_dir: Path, worker_id: str, role: WorkerRole, tp: int, redis_url: str) -> Any:
    config = worker_config(model_dir, worker_id, role, redis_url)
    engine = dataclasses.replace(
        config.engine, tensor_parallel_size=tp, kv_layout="head_major", tp_timeout_s=30.0
    )
    return dataclasses.replace(config, engine=engine)


@pytest.fixture(scope="module")
def tp_workers(ray_cluster: None, tiny_model_dir: Path, redis_url: str) -> Iterator[TPWorkers]:
    transfer = KVTransferConfig(lease_s=30.0)
    specs = {
        "p2": ("tp-p2", WorkerRole.PREFILL, 2),
        "d2": ("tp-d2", WorkerRole.DECODE, 2),
        "p1": ("tp-p1", WorkerRole.PREFILL, 1),
        "d1": ("tp-d1", WorkerRole.DECODE, 1),
    }
    handles = {
        key: create_worker(tp_config(tiny_model_dir, wid, role, tp, redis_url), transfer, PLACEMENT)
        for key, (wid, role, tp) in specs.items()
    }
    try:
        infos = ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
        assert [i.tp_size for i in infos] == [2, 2, 1, 1]
        assert {i.kv_layout for i in infos} == {"head_major_v1"}
        yield TPWorkers(**handles)
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


@pytest.mark.parametrize(("prefill", "decode"), [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_hand_offs_across_tp_layouts_give_transformers_tokens_and_leave_every_rank_idle(
    tp_workers: TPWorkers,
    corpus_prompts: list[list[int]],
    hf_greedy_to_eos: Reference,
    prefill: str,
    decode: str,
) -> None:
    p, d = getattr(tp_workers, prefill), getattr(tp_workers, decode)
    prompts = corpus_prompts[:8]
    got = serve_all(p, d, prompts, f"{prefill}{decode}")
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        assert tokens == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
    stats = ray.get(d.transfer_stats.remote(), timeout=30)
    assert stats.transfers_done > 0 and stats.transfers_failed == 0
    wait_idle(p, d)
    if decode == "d2":  # the follower holds no read
        follower = ray.get_actor(follower_name("tp-d2", 1))
        assert ray.get(follower.ping.remote(), timeout=30) == "serving"


def test_a_tp_decode_worker_prefills_locally_token_exact(
    tp_workers: TPWorkers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    prompts = corpus_prompts[8:12]
    got = serve_all(None, tp_workers.d2, prompts, "local")
    assert got == [hf_greedy_to_eos(x, MAX_TOKENS) for x in prompts]
    wait_idle(tp_workers.d2)


def test_a_tp_worker_is_its_actor_plus_followers_in_one_placement_group(
    tp_workers: TPWorkers,
) -> None:
    from ray.util import get_placement_group, placement_group_table

    group = get_placement_group(tp_group_name("tp-p2"))
    table = placement_group_table(group)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
    assert ray.get(ray.get_actor(follower_name("tp-p2", 1)).ping.remote(), timeout=30) == "serving"
    info = ray.get(tp_workers.p2.info.remote(), timeout=30)
    assert (info.tp_size, info.num_kv_blocks) == (2, 256)
