"""Tensor-parallel workers on a real local Ray: a worker of TP size 2 is its actor (rank 0)
plus a follower actor in one placement group, torch.distributed (gloo) between them, and one
NIXL agent per rank. Hand-offs between TP layouts (P TP=2 → D TP=1, P TP=1 → D TP=2, and
2 → 2) over NIXL give exactly the tokens transformers gives; afterwards every worker is back at
its idle baseline (rank 0 keeps the block books for all ranks: the ids are the same on each)
and no follower holds a read.

Every worker uses the head-major KV pool (what `pdserve up` picks when prefill and decode TP
sizes differ); each holds a 256-block pool and a quarter of a CPU per rank. The workers are
the directory's `parallel_workers`, shared with test_pp_workers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from pd_client import greedy, serve, wait_idle
from references import Reference
from workers_harness import ParallelWorkers

from deploy.control.worker_actors import follower_name, tp_group_name

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 12
SALT = "tp"
"""This module's prefix-cache entries: test_pp_workers serves the same prompts on the same
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


@pytest.mark.parametrize(
    ("prefill", "decode"), [("p_tp2", "d1"), ("p1", "d_tp2"), ("p_tp2", "d_tp2")]
)
def test_hand_offs_across_tp_layouts_give_transformers_tokens_and_leave_every_rank_idle(
    parallel_workers: ParallelWorkers,
    corpus_prompts: list[list[int]],
    hf_greedy_to_eos: Reference,
    prefill: str,
    decode: str,
) -> None:
    p, d = getattr(parallel_workers, prefill), getattr(parallel_workers, decode)
    prompts = corpus_prompts[:8]
    before = ray.get(d.transfer_stats.remote(), timeout=30)
    got = serve_all(p, d, prompts, f"{prefill}{decode}")
    for i, (tokens, prompt) in enumerate(zip(got, prompts, strict=True)):
        assert tokens == hf_greedy_to_eos(prompt, MAX_TOKENS), f"request {i}"
    stats = ray.get(d.transfer_stats.remote(), timeout=30)
    assert stats.transfers_done > before.transfers_done
    assert stats.transfers_failed == before.transfers_failed
    wait_idle(p, d)
    if decode == "d_tp2":  # the follower holds no read
        follower = ray.get_actor(follower_name("tp-d2", 1))
        assert ray.get(follower.ping.remote(), timeout=30) == "serving"


def test_a_tp_decode_worker_prefills_locally_token_exact(
    parallel_workers: ParallelWorkers, corpus_prompts: list[list[int]], hf_greedy_to_eos: Reference
) -> None:
    prompts = corpus_prompts[8:12]
    got = serve_all(None, parallel_workers.d_tp2, prompts, "local")
    assert got == [hf_greedy_to_eos(x, MAX_TOKENS) for x in prompts]
    wait_idle(parallel_workers.d_tp2)


def test_a_tp_worker_is_its_actor_plus_followers_in_one_placement_group(
    parallel_workers: ParallelWorkers,
) -> None:
    from ray.util import get_placement_group, placement_group_table

    group = get_placement_group(tp_group_name("tp-p2"))
    table = placement_group_table(group)
    assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
    assert ray.get(ray.get_actor(follower_name("tp-p2", 1)).ping.remote(), timeout=30) == "serving"
    info = ray.get(parallel_workers.p_tp2.info.remote(), timeout=30)
    assert (info.tp_size, info.num_kv_blocks) == (2, 256)
