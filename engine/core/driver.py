"""Run an `LLMEngine` on a thread of its own and talk to it from an asyncio event loop.

`LLMEngine` is not thread-safe, so everything that touches it (adding and aborting requests,
hand-off hooks, releases that arrive from transfer threads) is posted to this thread as a
command and runs between two steps. The thread loops:

    run queued commands → step() if there is work → hand outputs to `on_outputs`
    → publish a load snapshot → `on_tick` (e.g. forward KV events) → when idle, sleep
    until a command arrives (or `idle_wait_s` passes)

A step that found nothing to run (`LLMEngine.last_step_idle`: the work left waits on a LoRA
adapter's disk read, or on blocks a hand-off holds) is followed by a short wait
(`IDLE_STEP_WAIT_S`, cut short by a command) instead of the next step at once: a loop that
spins on empty steps holds the GIL the adapter cache's loader thread needs (a 6 ms read
took 1.4 s so, on the tiny model).

With overlap scheduling (engine/core/overlap.py) the device may still run the latest step while
commands run; that is safe for every command (an abort discards the token computed for the
request, a transfer reservation first waits for a step that may write a block given back),
and a step's outputs reach `on_outputs` one iteration later, when the next step has been
launched. `on_outputs` runs on the engine thread and must be quick (workers forward the
outputs to asyncio queues with `loop.call_soon_threadsafe`). A step that raises fails every
request the engine holds (each gets an aborted output through `on_step_error`), the engine is
reset to idle and the loop keeps serving: one bad batch never wedges the worker.

Progress: the thread stamps the (monotonic) time each iteration completes (a step and its
hand-off, or an idle wait), and `progress()` reports it with whether work is pending, so a
health check on another thread can tell a slow worker from a wedged one (a device call that
never returns, a command that blocks) without touching the engine. `LoopProgress` and
`LoopState` are shared with the KV-transfer loops (kv_transfer/agent_loop.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from vocabulary.engine_io import EngineLoad, RequestOutput
from vocabulary.loop_progress import LoopProgress, LoopState

if TYPE_CHECKING:  # the transfer loops import `LoopProgress` from here without the model code
    from engine.core.engine import LLMEngine

log = logging.getLogger(__name__)

T = TypeVar("T")
Command = Callable[["LLMEngine"], object]
IDLE_STEP_WAIT_S = 0.002
"""How long the loop waits after a step that found nothing to run (see the module docstring)."""


class EngineStopped(RuntimeError):
    """The engine driver is stopping or stopped and runs no new command."""


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
        self._lock = threading.Lock()  # `call` vs `stop`: no command slips in after the last run
        self._stopping = False
        # Progress, written by the engine thread only (read by `progress()` from any thread).
        self._progress_at = time.monotonic()
        self._in_commands = False
        self._engine_has_work = False
        self._died_of = ""
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
        """Run `fn(engine)` on the engine thread; the future holds its result or error
        (`EngineStopped` once `stop` was called or the thread died)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopping or self._died_of:
                fut.set_exception(EngineStopped(self._refusal()))
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

    def progress(self) -> LoopProgress:
        """The engine thread's progress (see `LoopProgress`; never touches the engine).

        Work is pending while commands are queued or running, or the engine held unfinished
        requests at the latest check: a command blocked on the thread counts as work."""
        if self._thread.ident is None:
            state = LoopState.NEW
        elif self._stopping:
            state = LoopState.STOPPED
        elif self._thread.is_alive():
            state = LoopState.RUNNING
        else:
            state = LoopState.DIED
        return LoopProgress(
            state=state,
            has_work=bool(self._commands) or self._in_commands or self._engine_has_work,
            stalled_s=max(time.monotonic() - self._progress_at, 0.0),
            error=self._died_of if state is LoopState.DIED else "",
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        self._progress_at = time.monotonic()
        try:
            self._loop()
        except BaseException as e:  # only a bug gets here: log it, `progress()` says DIED
            log.exception("engine thread died")
            with self._lock:
                self._died_of = f"{type(e).__name__}: {e}"
            # Nothing will run these: their callers get an answer instead of waiting forever.
            while self._commands:
                _, fut = self._commands.popleft()
                if fut is not None and fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineStopped(self._refusal()))

    def _refusal(self) -> str:
        if self._died_of:
            return f"engine thread died ({self._died_of})"
        return "engine driver is stopped"

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._run_commands()
            self._engine_has_work = engine.has_unfinished()
            if self._engine_has_work:
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as e:  # a bug or a device error: fail the batch, keep serving
                    self._recover(e)
                    self._progress_at = time.monotonic()
                    continue
                finally:
                    self.busy_s += time.perf_counter() - t0
                self.num_steps += 1
                self.consecutive_step_errors = 0
                self._load = engine.load()
                if outputs:
                    self._on_outputs(outputs)
                self._tick()
                if engine.last_step_idle:
                    self._wake.wait(IDLE_STEP_WAIT_S)
                    self._wake.clear()
                self._progress_at = time.monotonic()
                continue
            self._load = engine.load()
            self._tick()
            self._wake.wait(self._idle_wait_s)
            self._wake.clear()
            self._progress_at = time.monotonic()
        self._run_commands()

    def _run_commands(self) -> None:
        self._in_commands = True  # before the first pop: a running command is work too
        try:
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
        finally:
            self._in_commands = False

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
        from engine.core.prefill_lane import schedulers  # (not at import: see TYPE_CHECKING)

        both = schedulers(self.engine.scheduler, self.engine.prefill_lane)
        request_ids = [rid for scheduler in both for rid in scheduler.requests]
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s after a failed step also failed", rid)
        self._load = self.engine.load()
        if self._on_step_error is not None:
            self._on_step_error(error, request_ids)
