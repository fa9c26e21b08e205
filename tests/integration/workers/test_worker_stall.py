"""A stuck worker does not look healthy: a real DecodeWorker actor whose KV-transfer thread,
then engine thread, is blocked with work pending still answers `ping` (its asyncio loop is
fine) but raises `WorkerUnhealthy` naming the stalled thread within `stall_timeout_s`, so the
controller replaces it."""

from __future__ import annotations

import time
from typing import Any

import ray
from workers_harness import STUCK_STALL_S, Workers

from vocabulary.worker_api import WorkerUnhealthy

STALL_S = STUCK_STALL_S
SLACK_S = 8.0
"""How late after `STALL_S` the ping may first raise (ping interval, a loaded CI machine)."""


def unhealthy_naming(handle: Any, loop: str, within_s: float) -> tuple[float, str]:
    """Ping until it raises `WorkerUnhealthy` naming `loop`; (seconds it took, the message)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            ray.get(handle.ping.remote(), timeout=10)
        except WorkerUnhealthy as e:  # Ray's error is also the worker's: `cause` is that
            message = str(getattr(e, "cause", e))
            if loop in message:
                return time.monotonic() - t0, message
        time.sleep(0.1)
    raise AssertionError(f"ping did not report {loop} within {within_s}s")


def test_a_decode_worker_whose_threads_block_fails_its_health_check(workers: Workers) -> None:
    handle = workers.stuck  # stall_timeout_s=STALL_S; its threads stay blocked after this test
    try:
        # idle (since the session's workers started) for longer than the timeout: still healthy
        time.sleep(max(0.0, workers.started_at + STALL_S + 0.5 - time.monotonic()))
        assert ray.get(handle.ping.remote(), timeout=10) == "ready"

        def block_transfer_thread(actor: Any) -> None:
            import threading

            actor.endpoint._loop.post(lambda: threading.Event().wait(300))  # a hung NIXL call

        ray.get(handle.__ray_call__.remote(block_transfer_thread), timeout=10)
        took, message = unhealthy_naming(handle, "kv-transfer thread", STALL_S + SLACK_S)
        assert took >= STALL_S - 0.5
        assert message.startswith("worker stuck: kv-transfer thread made no progress for ")
        assert "engine thread" not in message

        def block_engine_thread(actor: Any) -> None:
            import threading

            actor.runtime.post(lambda e: threading.Event().wait(300))  # a step that hangs

        ray.get(handle.__ray_call__.remote(block_engine_thread), timeout=10)
        took, message = unhealthy_naming(handle, "engine thread", STALL_S + SLACK_S)
        assert took >= STALL_S - 0.5
        assert message.startswith("worker stuck: engine thread made no progress for ")
        assert "; kv-transfer thread made no progress for " in message
    finally:
        ray.kill(handle)
