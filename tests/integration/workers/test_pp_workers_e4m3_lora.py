"""A pipeline-parallel prefill worker (2 stages) with an e4m3 KV pool and a LoRA adapter hands
off to a one-rank decode worker of the same settings, on a real local Ray over NIXL: the
handshake accepts it (the compatibility hash covers the model's KV scales, which the prefill
worker puts together from both stages), and base and adapter requests give exactly what the
decode worker gives when it prefills them itself (same weights, adapter and quantized KV:
each stage calibrated its layers on the pass a whole model makes, and holds its layers of
the adapter in the slot rank 0 chose). Afterwards both workers are back at their idle
baseline and the stage-1 rank still serves.
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
from lora_reference import make_adapter
from pd_client import greedy, serve, wait_idle
from workers_harness import PLACEMENT, START_TIMEOUT_S, worker_config

from deploy.control.worker_actors import create_worker, follower_name, stop_worker
from kv_transfer.config import KVTransferConfig
from vocabulary.worker_api import WorkerRole

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 10
ADAPTER = "qv8"


@pytest.fixture(scope="module")
def e4m3_lora_pair(
    ray_cluster: None,
    tiny_model_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, Any]]:
    path = make_adapter(tiny_model_dir, tmp_path_factory.mktemp("pp-lora") / ADAPTER, 10, r=8,
                        lora_alpha=16, target_modules=["q_proj", "v_proj"])  # fmt: skip
    specs = {"pp-e4m3-p": (WorkerRole.PREFILL, 2), "pp-e4m3-d": (WorkerRole.DECODE, 1)}
    handles = {}
    for wid, (role, pp) in specs.items():
        config = worker_config(tiny_model_dir, wid, role, redis_url)
        engine = dataclasses.replace(
            config.engine, pipeline_parallel_size=pp, kv_cache_dtype="fp8",
            loras=((ADAPTER, str(path)),), max_loras=1, tp_timeout_s=30.0,
        )  # fmt: skip
        config = dataclasses.replace(config, engine=engine)
        handles[wid] = create_worker(config, KVTransferConfig(lease_s=30.0), PLACEMENT)
    try:
        infos = ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
        assert [i.pp_size for i in infos] == [2, 1]
        yield handles["pp-e4m3-p"], handles["pp-e4m3-d"]
    finally:
        for wid, h in handles.items():
            with contextlib.suppress(Exception):
                ray.get(h.shutdown.remote(), timeout=30)
            stop_worker(wid, h)


def serve_all(
    p: Any, d: Any, prompts: list[list[int]], tag: str, lora: str, salt: str = ""
) -> list[list[int]]:
    async def run() -> list[Any]:
        return await asyncio.gather(
            *(serve(p, d, f"{tag}-{i}", x, greedy(MAX_TOKENS), salt, lora)
              for i, x in enumerate(prompts))
        )  # fmt: skip

    return [s.token_ids for s in asyncio.run(run())]


def test_e4m3_and_lora_requests_hand_off_from_a_pp_worker_as_the_decode_worker_computes(
    e4m3_lora_pair: tuple[Any, Any], corpus_prompts: list[list[int]]
) -> None:
    p, d = e4m3_lora_pair
    prompts = corpus_prompts[:4]
    before = ray.get(d.transfer_stats.remote(), timeout=30)
    got = {lora: serve_all(p, d, prompts, f"pd-{lora or 'base'}", lora) for lora in ("", ADAPTER)}
    after = ray.get(d.transfer_stats.remote(), timeout=30)
    assert after.transfers_done - before.transfers_done == 2 * len(prompts)
    assert after.transfers_failed == before.transfers_failed
    # (salted: the local prefill computes every prompt block, none reused from the hand-off)
    local = {
        lora: serve_all(None, d, prompts, f"local-{lora or 'base'}", lora, salt="local")
        for lora in got
    }
    assert got == local
    assert got[ADAPTER] != got[""]  # the adapter's slot was read on both stages
    wait_idle(p, d)
    stage1 = ray.get_actor(follower_name("pp-e4m3-p", 1))
    assert ray.get(stage1.ping.remote(), timeout=30) == "serving"
