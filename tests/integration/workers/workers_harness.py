"""What the worker-actor tests share: how their workers are configured and placed, and the
session's set of workers (the `workers` fixture of this directory's conftest)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_client import NUM_KV_BLOCKS

from engine.config import EngineConfig, EngineMode
from kv_transfer.config import BudgetConfig, KVTransferConfig
from vocabulary.worker_api import ActorPlacement, WorkerRole
from worker_runtime.runtime import WorkerConfig

PLACEMENT = ActorPlacement(num_cpus=0.25)
START_TIMEOUT_S = 240.0
SICK_STEP_ERRORS = 2
"""The `sick` worker's `max_consecutive_step_errors`."""
STUCK_STALL_S = 2.0
"""The `stuck` worker's `stall_timeout_s`."""


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
    sick: Any
    """A prefill worker (no Redis) unhealthy after `SICK_STEP_ERRORS` failed steps in a row,
    for test_worker_health, which breaks its engine."""
    stuck: Any
    """A decode worker (no Redis) with `stall_timeout_s=STUCK_STALL_S`, for
    test_worker_stall, which blocks its threads; idle until then."""
    started_at: float
    """`time.monotonic()` once every worker had started."""
