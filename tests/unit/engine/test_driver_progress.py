"""EngineDriver progress: each completed iteration (a step, an idle wait) is stamped, and work
pending is reported, so a blocked command or a step that never returns shows as a stall while
an idle or steadily stepping engine never does. Also the driver's LoopState transitions and
`EngineStopped`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.core.driver import EngineDriver, EngineStopped
from engine.core.engine import LLMEngine
from vocabulary.loop_progress import LoopProgress, LoopState
from vocabulary.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)

IDLE_WAIT_S = 0.05
FRESH_S = 1.0
"""A healthy loop's `stalled_s` stays below this (an idle wait is 0.05 s; slack for a loaded
CI machine)."""


def long_request(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture()
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=64, cuda_graphs=False)
    )


@pytest.fixture()
def driver(engine: LLMEngine) -> Iterator[EngineDriver]:
    d = EngineDriver(engine, on_outputs=lambda outs: None, idle_wait_s=IDLE_WAIT_S)
    d.start()
    yield d
    d.stop(timeout_s=5.0)


def wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_new_driver_reports_new_and_a_stopped_one_stopped(engine: LLMEngine) -> None:
    d = EngineDriver(engine, on_outputs=lambda outs: None)
    assert d.progress().state is LoopState.NEW
    d.start()
    assert d.progress().state is LoopState.RUNNING
    d.stop()
    assert d.progress().state is LoopState.STOPPED


def test_an_idle_driver_has_no_work_and_keeps_completing_iterations(
    driver: EngineDriver,
) -> None:
    time.sleep(0.3)
    for _ in range(5):
        p = driver.progress()
        assert p.state is LoopState.RUNNING and not p.has_work
        assert p.stalled_s < FRESH_S
        time.sleep(0.05)


def test_a_blocked_command_is_pending_work_that_makes_no_progress(
    driver: EngineDriver,
) -> None:
    gate = threading.Event()
    driver.post(lambda e: gate.wait())
    time.sleep(0.5)
    stuck = driver.progress()
    assert stuck == LoopProgress(LoopState.RUNNING, True, stuck.stalled_s)
    assert stuck.stalled_s >= 0.5 - IDLE_WAIT_S
    time.sleep(0.2)
    assert driver.progress().stalled_s >= stuck.stalled_s + 0.2
    gate.set()
    wait_for(lambda: not driver.progress().has_work)
    assert driver.progress().stalled_s < FRESH_S


def test_a_step_that_never_returns_is_pending_work_that_makes_no_progress(
    driver: EngineDriver, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    entered = threading.Event()
    real_execute = engine.runner.execute

    def hanging_execute(batch):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait()  # a device call that does not come back
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", hanging_execute)
    prompt = engine.tokenizer.encode("The river runs past the old mill")
    driver.call(lambda e: e.add_request("r", prompt, long_request(2))).result(timeout=10)
    assert entered.wait(10)
    time.sleep(0.5)
    p = driver.progress()
    assert p.state is LoopState.RUNNING and p.has_work and p.stalled_s >= 0.5
    gate.set()
    wait_for(lambda: not driver.progress().has_work)  # the request finished
    assert driver.progress().stalled_s < FRESH_S


def test_a_driver_that_keeps_stepping_has_work_and_stays_fresh(
    driver: EngineDriver, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_execute = engine.runner.execute

    def slow_execute(batch):  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # every step takes a while, none stalls
        return real_execute(batch)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    prompt = engine.tokenizer.encode("The river runs past the old mill")
    driver.call(lambda e: e.add_request("r", prompt, long_request(60))).result(timeout=10)
    samples = []
    for _ in range(20):
        samples.append(driver.progress())
        time.sleep(0.05)
    assert all(p.has_work for p in samples[:10])  # 60 steps of >= 20 ms outlast a second
    assert max(p.stalled_s for p in samples) < FRESH_S


def test_a_thread_that_died_is_reported_and_calls_are_refused(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = EngineDriver(engine, on_outputs=lambda outs: None, idle_wait_s=IDLE_WAIT_S)

    def broken() -> bool:
        raise RuntimeError("scheduler invariant broken")

    monkeypatch.setattr(engine, "has_unfinished", broken)  # outside the step's recovery
    d.start()
    wait_for(lambda: d.progress().state is LoopState.DIED)
    assert d.progress().error == "RuntimeError: scheduler invariant broken"
    with pytest.raises(EngineStopped, match="engine thread died"):
        d.call(lambda e: None).result(timeout=1)


def test_call_after_stop_raises_engine_stopped(driver: EngineDriver) -> None:
    driver.stop()
    with pytest.raises(EngineStopped, match="engine driver is stopped"):
        driver.call(lambda e: None).result(timeout=1)
    assert issubclass(EngineStopped, RuntimeError)  # callers catching RuntimeError still do
