"""Fixtures for the worker-actor tests: real local Ray, real redis-server, NIXL over UCX on
loopback, the tiny checkpoint, and the transformers float32 reference.

The session's workers (two prefill, two decode, a fault-injecting decode and two decode
workers kept for one test each) are created at once, so their model loads overlap; each
holds a 256-block pool and a quarter of a CPU.
Tests that count blocks use their own `cache_salt`, so earlier tests' prefix-cache entries
never change their numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from pd_client import NUM_KV_BLOCKS

from deploy.control.worker_actors import create_worker
from engine.config import EngineConfig, EngineMode
from kv_transfer.config import BudgetConfig, KVTransferConfig
from vocabulary.tokenizer import Tokenizer
from vocabulary.worker_api import ActorPlacement, WorkerRole
from worker_runtime.runtime import WorkerConfig

PLACEMENT = ActorPlacement(num_cpus=0.25)
START_TIMEOUT_S = 240.0

Reference = Callable[[list[int], int], list[int]]


def worker_config(
    model_dir: Path, worker_id: str, role: WorkerRole, redis_url: str | None
) -> WorkerConfig:
    mode = EngineMode.PREFILL_ONLY if role is WorkerRole.PREFILL else EngineMode.COLOCATED
    engine = EngineConfig(
        model_dir=str(model_dir),
        mode=mode,
        device="cpu",
        dtype="float32",
        num_kv_blocks=NUM_KV_BLOCKS,
        attention_backend="torch",
        cuda_graphs=False,
    )
    return WorkerConfig(worker_id, role, engine, redis_url=redis_url)


# The fault-injecting decode worker pulls at most 4 blocks at once, so a second transfer
# queues behind a held one.
GATED_TRANSFER = KVTransferConfig(
    budget=BudgetConfig(max_inflight_blocks=4, max_inflight_blocks_per_peer=4)
)


@dataclass
class Workers:
    """Handles of the session's worker actors."""

    p0: Any
    p1: Any
    d0: Any
    d1: Any
    gated: Any
    """A decode worker whose reads complete only while its gate is open (gated_decode.py)."""
    victim: Any
    """A decode worker for the test that kills it."""
    fresh: Any
    """A decode worker no other test uses (its first contact with a prefill worker)."""


@pytest.fixture(scope="session")
def workers(ray_cluster: None, tiny_model_dir: Path, redis_url: str) -> Iterator[Workers]:
    import ray
    import ray.cloudpickle
    from gated_decode import GatedDecodeWorker, gated_module

    # The test-only actor class travels by value (Ray workers cannot import test modules).
    ray.cloudpickle.register_pickle_by_value(gated_module())
    transfer = KVTransferConfig(lease_s=30.0)  # generous: the CI machine is shared
    handles: dict[str, Any] = {}
    for wid, role in (
        ("p0", WorkerRole.PREFILL),
        ("p1", WorkerRole.PREFILL),
        ("d0", WorkerRole.DECODE),
        ("d1", WorkerRole.DECODE),
        ("victim", WorkerRole.DECODE),
        ("fresh", WorkerRole.DECODE),
    ):
        handles[wid] = create_worker(
            worker_config(tiny_model_dir, wid, role, redis_url), transfer, PLACEMENT
        )
    gated_config = worker_config(tiny_model_dir, "dgate", WorkerRole.DECODE, redis_url)
    handles["gated"] = (
        ray.remote(GatedDecodeWorker)
        .options(name="pdserve-worker-dgate", num_cpus=PLACEMENT.num_cpus, max_concurrency=4096)
        .remote(gated_config, GATED_TRANSFER, "pdserve-worker-dgate")
    )
    ray.get([h.start.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    yield Workers(**handles)
    for h in handles.values():
        with contextlib.suppress(Exception):  # killed by a test, or already gone
            ray.get(h.shutdown.remote(), timeout=30)
        ray.kill(h)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path) -> Reference:
    """transformers float32 `generate` (greedy, stops after eos), memoized per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
            )
            memo[key] = out[0, len(prompt) :].tolist()
        return memo[key]

    return greedy


@pytest.fixture(scope="session")
def corpus_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """32 text-like prompts of 3 to ~90 tokens from the bundled corpus; several share whole
    leading blocks (same paragraph opening, different lengths)."""
    from deploy.checkpoints.checkpoint_files import CORPUS

    paragraphs = [p.strip() for p in CORPUS.read_text().split("\n\n") if p.strip()]
    prompts: list[list[int]] = []
    lengths = (3, 9, 17, 33, 48, 61, 75, 90)
    i = 0
    while len(prompts) < 32:
        ids = tokenizer.encode(paragraphs[i % len(paragraphs)])
        prompts.append(ids[: lengths[i % len(lengths)]])
        i += 1
    return prompts
