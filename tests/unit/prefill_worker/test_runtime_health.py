"""WorkerRuntime health means progress: `check_health` raises `WorkerUnhealthy` when a watched
thread (the engine's, always; a KV-transfer loop, once watched) has work pending and no
completed iteration for `stall_timeout_s`, or died; never for an idle worker or one that keeps
stepping. `stop` fails streams and calls with `WorkerStopped`. Real tiny engine on CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from engine.config import EngineConfig
from kv_transfer.agent_loop import AgentLoop
from vocabulary.loop_progress import LoopProgress, LoopState
from vocabulary.sampling import SamplingParams
from vocabulary.worker_api import (
    StepFailed,
    WorkerRole,
    WorkerState,
    WorkerStopped,
    WorkerUnhealthy,
)
from worker_runtime.runtime import ENGINE_LOOP, WorkerConfig, WorkerRuntime, stall_reason

pytestmark = pytest.mark.timeout(60)

STALL_S = 0.5
SLACK_S = 1.5
"""How late after `STALL_S` the check may first raise (polling, a loaded CI machine)."""
PROMPT = (5, 6, 7, 8, 9)


def make_config(model_dir: Path, **overrides: object) -> WorkerConfig:
    engine = EngineConfig(
        model_dir=str(model_dir), device="cpu", num_kv_blocks=64, cuda_graphs=False
    )
    config = WorkerConfig("w0", WorkerRole.DECODE, engine, stall_timeout_s=STALL_S)
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


@asynccontextmanager
async def running(model_dir: Path, **overrides: object) -> AsyncIterator[WorkerRuntime]:
    rt = WorkerRuntime(make_config(model_dir, **overrides), "w0")
    await rt.start()
    try:
        yield rt
    finally:
        rt.stop()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def first_unhealthy(rt: WorkerRuntime, within_s: float) -> tuple[float, str]:
    """Poll `check_health` until it raises; (seconds it took, the message)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            rt.check_health()
        except WorkerUnhealthy as e:
            return time.monotonic() - t0, str(e)
        await asyncio.sleep(0.01)
    raise AssertionError(f"check_health did not raise within {within_s}s")


async def healthy_again(rt: WorkerRuntime, within_s: float = 10.0) -> None:
    """Wait until `check_health` passes (a released thread completes its iteration)."""
    t0 = time.monotonic()
    while True:
        try:
            assert rt.check_health() is WorkerState.READY
            return
        except WorkerUnhealthy:
            assert time.monotonic() - t0 < within_s, "still unhealthy"
            await asyncio.sleep(0.01)


async def healthy_throughout(rt: WorkerRuntime, seconds: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        assert rt.check_health() is WorkerState.READY
        await asyncio.sleep(0.02)


# ---- the policy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("progress", "reason"),
    [
        (LoopProgress(LoopState.RUNNING, True, 1.9), None),
        (
            LoopProgress(LoopState.RUNNING, True, 2.0),
            "loop made no progress for 2.0s with work pending (stall_timeout_s=2)",
        ),
        (LoopProgress(LoopState.RUNNING, False, 99.0), None),  # idle: nothing waits on it
        (LoopProgress(LoopState.NEW, True, 99.0), None),
        (LoopProgress(LoopState.STOPPED, True, 99.0), None),  # stopping: the state says so
        (LoopProgress(LoopState.DIED, False, 0.0, "KeyError: 3"), "loop died (KeyError: 3)"),
        (LoopProgress(LoopState.DIED, False, 0.0), "loop died (no error recorded)"),
    ],
)
def test_stall_reason(progress: LoopProgress, reason: str | None) -> None:
    assert stall_reason("loop", progress, 2.0) == reason


def test_a_zero_stall_timeout_disables_the_stall_check_but_not_death() -> None:
    assert stall_reason("loop", LoopProgress(LoopState.RUNNING, True, 1e9), 0.0) is None
    died = LoopProgress(LoopState.DIED, True, 0.0, "E: x")
    assert stall_reason("loop", died, 0.0) == "loop died (E: x)"


def test_a_negative_stall_timeout_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="stall_timeout_s"):
        make_config(tiny_model_dir, stall_timeout_s=-1.0)


# ---- the engine thread ---------------------------------------------------------------------


def test_an_idle_worker_stays_healthy_past_the_stall_timeout(tiny_model_dir: Path) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            await healthy_throughout(rt, 3 * STALL_S)

    asyncio.run(body())


def test_a_worker_that_keeps_stepping_stays_healthy(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            assert rt.engine is not None
            real_execute = rt.engine.runner.execute

            def slow_execute(batch):  # type: ignore[no-untyped-def]
                time.sleep(0.05)  # every step takes a while; none is close to the timeout
                return real_execute(batch)

            monkeypatch.setattr(rt.engine.runner, "execute", slow_execute)
            await rt.call(lambda e: e.add_request("r", PROMPT, greedy(60)))
            await healthy_throughout(rt, 3 * STALL_S)
            assert rt.driver.progress().has_work  # still stepping: the busy case was tested

    asyncio.run(body())


def test_a_blocked_engine_thread_with_work_is_unhealthy_after_the_stall_timeout(
    tiny_model_dir: Path,
) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            gate = threading.Event()
            try:
                rt.post(lambda e: gate.wait())  # a command that never returns
                took, message = await first_unhealthy(rt, STALL_S + SLACK_S)
            finally:
                gate.set()
            assert took >= STALL_S - 0.1
            assert message.startswith(f"worker w0: {ENGINE_LOOP} made no progress for ")
            assert message.endswith(f"s with work pending (stall_timeout_s={STALL_S:g})")
            await healthy_again(rt)  # released: it recovers on its own

    asyncio.run(body())


def test_a_step_that_never_returns_makes_the_worker_unhealthy(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            assert rt.engine is not None
            gate = threading.Event()
            real_execute = rt.engine.runner.execute

            def hanging_execute(batch):  # type: ignore[no-untyped-def]
                gate.wait()  # a device call that does not come back
                return real_execute(batch)

            monkeypatch.setattr(rt.engine.runner, "execute", hanging_execute)
            try:
                await rt.call(lambda e: e.add_request("r", PROMPT, greedy(2)))
                took, message = await first_unhealthy(rt, STALL_S + SLACK_S)
            finally:
                gate.set()
            assert took >= STALL_S - 0.1 and ENGINE_LOOP in message

    asyncio.run(body())


def test_a_zero_stall_timeout_keeps_a_blocked_worker_healthy(tiny_model_dir: Path) -> None:
    async def body() -> None:
        async with running(tiny_model_dir, stall_timeout_s=0.0) as rt:
            gate = threading.Event()
            try:
                rt.post(lambda e: gate.wait())
                await healthy_throughout(rt, 2 * STALL_S)
            finally:
                gate.set()

    asyncio.run(body())


def test_consecutive_step_errors_still_make_the_worker_unhealthy(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        async with running(tiny_model_dir, max_consecutive_step_errors=2) as rt:
            assert rt.engine is not None

            def execute(batch):  # type: ignore[no-untyped-def]
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            monkeypatch.setattr(rt.engine.runner, "execute", execute)
            for i in range(2):
                q = rt.open_stream(f"r{i}")
                await rt.call(lambda e, i=i: e.add_request(f"r{i}", PROMPT, greedy(2)))
                assert isinstance(await asyncio.wait_for(q.get(), 10), StepFailed)
                rt.close_stream(f"r{i}")
            with pytest.raises(WorkerUnhealthy, match="2 engine steps failed in a row"):
                rt.check_health()

    asyncio.run(body())


def test_failed_steps_and_a_dead_watched_loop_are_both_named(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP rank that dies breaks every step: the message names the failed steps and the
    cause, whichever the health check meets first."""

    async def body() -> None:
        async with running(tiny_model_dir, max_consecutive_step_errors=1) as rt:
            assert rt.engine is not None
            rt.watch("TP ranks", lambda: LoopProgress(LoopState.DIED, False, 0.0, "rank 1 gone"))

            def execute(batch):  # type: ignore[no-untyped-def]
                raise RuntimeError("TP group rank 0 is broken")

            monkeypatch.setattr(rt.engine.runner, "execute", execute)
            q = rt.open_stream("r0")
            await rt.call(lambda e: e.add_request("r0", PROMPT, greedy(2)))
            assert isinstance(await asyncio.wait_for(q.get(), 10), StepFailed)
            rt.close_stream("r0")
            with pytest.raises(WorkerUnhealthy) as raised:
                rt.check_health()
            message = str(raised.value)
            assert "1 engine steps failed in a row" in message
            assert "TP ranks died (rank 1 gone)" in message

    asyncio.run(body())


# ---- a watched transfer loop ---------------------------------------------------------------


def test_a_watched_loop_that_stalls_with_work_makes_the_worker_unhealthy(
    tiny_model_dir: Path,
) -> None:
    hang, release = threading.Event(), threading.Event()

    def tick() -> float:
        if hang.is_set():
            release.wait()  # e.g. a NIXL call that never returns
        return 0.01

    async def body() -> None:
        loop = AgentLoop("kv-test", tick, 0.01)
        loop.start(lambda: None, timeout_s=5.0)
        try:
            async with running(tiny_model_dir) as rt:
                rt.watch("kv-transfer thread", loop.progress)
                hang.set()
                await healthy_throughout(rt, 2 * STALL_S)  # stuck, but no work waits on it
                loop.post(lambda: None)  # work arrives
                _, message = await first_unhealthy(rt, SLACK_S)
                assert message.startswith("worker w0: kv-transfer thread made no progress for ")
                release.set()
                await healthy_again(rt)
        finally:
            release.set()
            loop.stop(lambda: None, timeout_s=5.0)

    asyncio.run(body())


def test_a_watched_loop_that_died_makes_the_worker_unhealthy(tiny_model_dir: Path) -> None:
    class Fatal(BaseException):
        pass

    def tick() -> float:
        raise Fatal("agent gone")

    async def body() -> None:
        loop = AgentLoop("kv-test", tick, 0.01)
        loop.start(lambda: None, timeout_s=5.0)
        async with running(tiny_model_dir) as rt:
            rt.watch("kv-transfer thread", loop.progress)
            _, message = await first_unhealthy(rt, SLACK_S)
            assert message == "worker w0: kv-transfer thread died (Fatal: agent gone)"

    asyncio.run(body())


def test_watch_refuses_a_name_already_watched(tiny_model_dir: Path) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            rt.watch("kv", lambda: LoopProgress(LoopState.RUNNING, False, 0.0))
            for name in ("kv", ENGINE_LOOP):
                with pytest.raises(ValueError, match="already watched"):
                    rt.watch(name, lambda: LoopProgress(LoopState.RUNNING, False, 0.0))

    asyncio.run(body())


# ---- stop ----------------------------------------------------------------------------------


def test_stop_fails_open_streams_and_later_calls_with_worker_stopped(
    tiny_model_dir: Path,
) -> None:
    async def body() -> None:
        async with running(tiny_model_dir) as rt:
            q = rt.open_stream("r")
            rt.stop()
            item = q.get_nowait()
            assert isinstance(item, WorkerStopped) and str(item) == "worker w0 stopped"
            with pytest.raises(WorkerStopped, match="worker w0 is stopped"):
                await rt.call(lambda e: e.has_unfinished())
            assert rt.check_health() is WorkerState.STOPPED  # stopped threads are no fault

    asyncio.run(body())
