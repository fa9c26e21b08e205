"""EngineDriver: a step that raises fails the requests it held and the loop keeps serving;
failures in a row are counted (the worker's health check reads them)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from step_faults import fail_first_execute

from engine.config import EngineConfig
from engine.core.driver import EngineDriver
from engine.core.engine import LLMEngine
from vocabulary.engine_io import RequestOutput
from vocabulary.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture()
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir), num_kv_blocks=64, cuda_graphs=False)
    )


def test_a_failed_step_aborts_its_requests_clears_the_device_and_serving_goes_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    finished: dict[str, RequestOutput] = {}
    failed: list[tuple[str, list[str]]] = []
    cleared: list[int] = []
    done = threading.Event()

    def on_outputs(outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.finish_reason is not None:
                finished[out.request_id] = out
        if "after" in finished:
            done.set()

    fail_first_execute(monkeypatch, engine.runner, "CUDA error: invalid argument")
    monkeypatch.setattr(engine.runner, "clear_device_error", lambda: cleared.append(1))
    driver = EngineDriver(
        engine, on_outputs, on_step_error=lambda e, ids: failed.append((str(e), ids))
    )
    driver.start()
    try:
        prompt = engine.tokenizer.encode("The river runs past the old mill")
        driver.call(lambda e: e.add_request("doomed", prompt, GREEDY)).result(timeout=10)
        deadline = time.monotonic() + 10
        while not failed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failed == [("CUDA error: invalid argument", ["doomed"])]
        assert cleared == [1] and driver.num_step_errors == 1
        assert driver.consecutive_step_errors == 1
        assert driver.last_step_error == "RuntimeError: CUDA error: invalid argument"
        assert engine.block_pool.num_free == engine.block_pool.num_blocks
        driver.call(lambda e: e.add_request("after", prompt, GREEDY)).result(timeout=10)
        assert done.wait(10)
        assert finished["after"].num_output_tokens == 4
        assert driver.consecutive_step_errors == 0  # a step that works resets the count
        assert "doomed" not in finished  # its end went through on_step_error
    finally:
        driver.stop()
