"""What the worker-actor tests share: how their workers are configured and placed, the
session's set of workers (the `workers` fixture of this directory's conftest) and the set of
tensor- and pipeline-parallel ones (its `parallel_workers`)."""

from __future__ import annotations

import dataclasses
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


def parallel_config(
    model_dir: Path, worker_id: str, role: WorkerRole, redis_url: str, tp: int = 1, pp: int = 1
) -> WorkerConfig:
    """A worker of `tp` ranks per stage and `pp` stages on the head-major KV pool (what
    `pdserve up` picks when prefill and decode TP sizes differ)."""
    config = worker_config(model_dir, worker_id, role, redis_url)
    engine = dataclasses.replace(
        config.engine, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        kv_layout="head_major", tp_timeout_s=30.0,
    )  # fmt: skip
    return dataclasses.replace(config, engine=engine)


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


@dataclass
class ParallelWorkers:
    """Handles of the tensor- and pipeline-parallel workers that test_tp_workers and
    test_pp_workers share (each rank a quarter of a CPU, a 256-block head-major pool)."""

    p_tp2: Any
    """Prefill, TP 2 (worker id "tp-p2")."""
    p1: Any
    """Prefill, one rank ("tp-p1")."""
    d1: Any
    """Decode, one rank ("tp-d1")."""
    d_tp2: Any
    """Decode, TP 2 ("tp-d2")."""
    p_pp2: Any
    """Prefill, 2 stages ("pp-p2")."""
    d_pp2: Any
    """Decode, 2 stages ("pp-dpp2")."""
    pp_victim: Any
    """Decode, 2 stages ("pp-dead"), the lease default: test_pp_workers kills its stage 1."""
