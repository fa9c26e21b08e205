"""Fake worker actor handles for the orchestrator's unit tests (no Ray): `handle.name.remote()`
runs a coroutine as a task, as a Ray actor handle's call does inside an async actor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vocabulary.engine_io import EngineLoad
from vocabulary.worker_api import WorkerInfo, WorkerLoad, WorkerRole, WorkerState


class Method:
    """`handle.name.remote(...)` of a fake actor: runs `fn` as a task, records the call."""

    def __init__(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]] | None = None) -> None:
        self.fn, self.calls = fn, calls if calls is not None else []

    def options(self, **_: Any) -> Method:
        return self

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        result = self.fn(*args)
        if asyncio.iscoroutine(result):
            return asyncio.ensure_future(result)
        return result


def make_load(worker_id: str, role: WorkerRole, used_blocks: int = 0) -> WorkerLoad:
    engine = EngineLoad(
        num_waiting=0, num_running=0, num_waiting_prefill_tokens=0,
        num_free_blocks=100 - used_blocks, num_total_blocks=100, num_handoff_blocks=0,
        num_transfer_blocks=0, num_cache_query_tokens=0, num_cache_hit_tokens=0,
        num_preemptions=0,
    )  # fmt: skip
    return WorkerLoad(worker_id, role, WorkerState.READY, engine, 0, 0)


def make_info(worker_id: str, role: WorkerRole) -> WorkerInfo:
    return WorkerInfo(worker_id, role, worker_id, "node", "cpu", "m", 16, 512, 100, 100)
