"""An FP8 (e4m3) KV pool through the real hand-off: prefill and decode actors on a real local
Ray pull e4m3 blocks over NIXL/UCX, and the tokens equal what the same decode worker gives
when it prefills the prompt itself (same weights, same quantized KV, so exact); each block
moves a quarter of the float32 bytes; and a float32 decode worker refuses the e4m3 prefill
worker at the handshake, naming the dtype, with nothing left held on either side."""

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
from workers_harness import PLACEMENT, START_TIMEOUT_S, Workers, worker_config

from deploy.control.worker_actors import create_worker
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import WorkerRole

pytestmark = pytest.mark.timeout(180)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def fp8_pair(ray_cluster: None, tiny_model_dir: Path, redis_url: str) -> Iterator[tuple[Any, Any]]:
    handles = []
    for wid, role in (("p-fp8", WorkerRole.PREFILL), ("d-fp8", WorkerRole.DECODE)):
        config = worker_config(tiny_model_dir, wid, role, redis_url)
        config = dataclasses.replace(
            config, engine=dataclasses.replace(config.engine, kv_cache_dtype="fp8")
        )
        handles.append(create_worker(config, KVTransferConfig(lease_s=30.0), PLACEMENT))
    ray.get([h.start.remote() for h in handles], timeout=START_TIMEOUT_S)
    yield handles[0], handles[1]
    for h in handles:
        with contextlib.suppress(Exception):
            ray.get(h.shutdown.remote(), timeout=30)
        ray.kill(h)


def test_fp8_blocks_hand_off_token_exact_at_a_quarter_of_the_float32_bytes(
    fp8_pair: tuple[Any, Any], workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    p, d = fp8_pair
    prompts = corpus_prompts[:8]
    before = ray.get(d.transfer_stats.remote(), timeout=30)

    async def run(prefill_on: Any, tag: str) -> list[list[int]]:
        served = await asyncio.gather(
            *(
                serve(prefill_on, d, f"{tag}-{i}", q, greedy(MAX_TOKENS))
                for i, q in enumerate(prompts)
            )
        )
        return [s.token_ids for s in served]

    handed_off = asyncio.run(run(p, "fp8-pd"))
    local = asyncio.run(run(None, "fp8-local"))
    assert handed_off == local
    after = ray.get(d.transfer_stats.remote(), timeout=30)
    fp8_bytes = after.bytes_transferred - before.bytes_transferred
    fp8_blocks = after.blocks_transferred - before.blocks_transferred
    assert fp8_blocks > 0
    # the same prompts through the float32 pair: 4 bytes an element instead of 1
    f32_before = ray.get(workers.d0.transfer_stats.remote(), timeout=30)

    async def run_f32() -> None:
        await asyncio.gather(
            *(
                serve(workers.p0, workers.d0, f"f32-{i}", q, greedy(MAX_TOKENS))
                for i, q in enumerate(prompts)
            )
        )

    asyncio.run(run_f32())
    f32_after = ray.get(workers.d0.transfer_stats.remote(), timeout=30)
    f32_bytes = f32_after.bytes_transferred - f32_before.bytes_transferred
    f32_blocks = f32_after.blocks_transferred - f32_before.blocks_transferred
    assert fp8_bytes * f32_blocks * 4 == f32_bytes * fp8_blocks
    wait_idle(p, d)


def test_a_float32_decode_worker_refuses_an_fp8_prefill_worker_naming_the_dtype(
    fp8_pair: tuple[Any, Any], workers: Workers, corpus_prompts: list[list[int]]
) -> None:
    p, _ = fp8_pair
    d = workers.fresh
    prompt = corpus_prompts[0]

    async def attempt() -> None:
        await serve(p, d, "fp8-mismatch", prompt, greedy(MAX_TOKENS))

    with pytest.raises(Exception, match="dtype: peer float8_e4m3fn vs local float32"):
        asyncio.run(attempt())
    # the refused request holds nothing once the caller gives up (the router aborts the
    # prefill side's lease after a failed hand-off); the decode side reserved nothing
    ray.get(p.abort.remote("fp8-mismatch"), timeout=30)
    wait_idle(p, d)
