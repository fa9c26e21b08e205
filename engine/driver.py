"""Run an `LLMEngine` on a thread of its own and talk to it from an asyncio event loop.

`LLMEngine` is not thread-safe, so everything that touches it (adding and aborting requests,
hand-off hooks, releases that arrive from transfer threads) is posted to this thread as a
command and runs between two steps. The thread loops:

    run queued commands → step() if there is work → hand outputs to `on_outputs`
    → publish a load snapshot → `on_tick` (e.g. forward KV events) → when idle, sleep
    until a command arrives (or `idle_wait_s` passes)

`on_outputs` runs on the engine thread and must be quick (workers forward the outputs to
asyncio queues with `loop.call_soon_threadsafe`). A step that raises fails every request the
engine holds (each gets an aborted output through `on_step_error`), the engine is reset to
idle and the loop keeps serving: one bad batch never wedges the worker.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from engine.engine import LLMEngine
from engine.outputs import EngineLoad, RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
Command = Callable[[LLMEngine], object]


class EngineDriver:
    """Owns the engine thread; `call` runs a function on it, `post` fires and forgets."""

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_step_error: Callable[[BaseException, list[str]], None] | None = None,
        on_tick: Callable[[LLMEngine], None] | None = None,
        idle_wait_s: float = 0.05,
        name: str = "engine",
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_step_error = on_step_error
        self._on_tick = on_tick
        self._idle_wait_s = idle_wait_s
        self._commands: collections.deque[
            tuple[Command, concurrent.futures.Future[object] | None]
        ] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._load = engine.load()
        self.num_steps = 0
        self.num_step_errors = 0
        self.consecutive_step_errors = 0
        """Failed steps since the last one that worked (a sticky device error keeps growing
        it: the worker's health check reports the worker unhealthy)."""
        self.last_step_error = ""
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the engine thread; the future holds its result or error."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping:
            fut.set_exception(RuntimeError("engine driver is stopped"))
            return fut
        self._commands.append((fn, fut))  # type: ignore[arg-type]
        self._wake.set()
        return fut

    def post(self, fn: Command) -> None:
        """Run `fn(engine)` on the engine thread, ignoring its result (errors are logged)."""
        self._commands.append((fn, None))
        self._wake.set()

    @property
    def load(self) -> EngineLoad:
        """The load snapshot taken after the latest step (never touches the engine)."""
        return self._load

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._run_commands()
            if engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug or a device error: fail the batch, keep serving
                    self._recover(e)
                    continue
                finally:
                    self.busy_s += time.perf_counter() - t0
                self.num_steps += 1
                self.consecutive_step_errors = 0
                self._load = engine.load()
                if outputs:
                    self._on_outputs(outputs)
                self._tick()
                continue
            self._load = engine.load()
            self._tick()
            self._wake.wait(self._idle_wait_s)
            self._wake.clear()
        self._run_commands()

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self.engine)
            except BaseException as e:
                if fut is not None:
                    fut.set_exception(e)
                else:
                    log.exception("engine command failed")
            else:
                if fut is not None:
                    fut.set_result(result)

    def _tick(self) -> None:
        if self._on_tick is None:
            return
        try:
            self._on_tick(self.engine)
        except Exception:
            log.exception("engine tick hook failed")

    def _recover(self, error: BaseException) -> None:
        self.num_step_errors += 1
        self.consecutive_step_errors += 1
        self.last_step_error = f"{type(error).__name__}: {error}"
        log.exception("engine step failed; aborting its requests")
        try:
            self.engine.runner.clear_device_error()
        except Exception:
            log.exception("clearing the device error after a failed step failed")
        request_ids = list(self.engine.scheduler.requests)
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s after a failed step also failed", rid)
        self._load = self.engine.load()
        if self._on_step_error is not None:
            self._on_step_error(error, request_ids)
