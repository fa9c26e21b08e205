"""The one thread that owns a transfer agent.

NIXL agents are not meant to be driven from several threads, and the worker's engine thread
must never block on the network. So each endpoint owns an `AgentLoop`: a daemon thread that
creates the backend, runs every command posted to it, calls `tick()` (which returns how long
it may sleep) and sleeps on a condition until that time or the next posted command. Timers
(lease reaper, deadlines, heartbeats) therefore run without any new work arriving.

Other threads use `post` (fire and forget) or `call` (wait for the result, with a deadline).
A command that raises is logged (post) or re-raised in the caller (call); it never kills the
thread.

Progress: the thread stamps the (monotonic) time each iteration completes (commands, tick,
sleep), and `progress()` reports it as a `LoopProgress` (vocabulary/loop_progress.py) with
whether work is pending: commands queued or running, or the owner's `has_work` (its
transfers or leases). The worker's health check reads it, so a NIXL call that never returns
is noticed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from vocabulary.loop_progress import LoopProgress, LoopState
from vocabulary.transfer_errors import TransferError

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoopStopped(TransferError):
    """The endpoint's transfer thread is not running."""


class AgentLoop:
    """A thread running posted commands and a periodic `tick`.

    `has_work`, if given, says whether the owner has work under way that needs the thread
    (transfers in flight, leases to reap); `progress()` calls it on the caller's thread, so it
    must be quick and thread-safe (read a published snapshot, not loop-owned state).
    """

    def __init__(
        self,
        name: str,
        tick: Callable[[], float],
        max_sleep_s: float,
        has_work: Callable[[], bool] | None = None,
    ) -> None:
        self.name = name
        self._tick = tick
        self._max_sleep_s = max_sleep_s
        self._has_work = has_work
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._teardown: Callable[[], None] | None = None
        # Progress, written by the loop thread only (read by `progress()` from any thread).
        self._progress_at = time.monotonic()
        self._in_commands = False
        self._died_of = ""

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def progress(self) -> LoopProgress:
        """The loop's progress (see `LoopProgress`); any thread, never waits on the loop."""
        thread = self._thread
        if thread is None:
            state = LoopState.NEW
        elif self._stopping:
            state = LoopState.STOPPED
        elif thread.is_alive():
            state = LoopState.RUNNING
        else:
            state = LoopState.DIED
        has_work = bool(self._inbox) or self._in_commands  # this order: no gap between
        if not has_work and self._has_work is not None:
            has_work = self._has_work()
        return LoopProgress(
            state=state,
            has_work=has_work,
            stalled_s=max(time.monotonic() - self._progress_at, 0.0),
            error=self._died_of if state is LoopState.DIED else "",
        )

    def start(self, setup: Callable[[], T], timeout_s: float) -> T:
        """Start the thread, run `setup` on it before the first tick, and return its result.

        If `setup` fails or times out, the thread is stopped and the error re-raised.
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        future = self._enqueue(setup)
        self._thread.start()
        try:
            return self._wait(future, timeout_s)
        except BaseException:
            self.stop(lambda: None, timeout_s=1.0)
            raise

    def post(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping or self._died_of:
                why = f"died ({self._died_of})" if self._died_of else "is stopped"
                raise LoopStopped(f"{self.name} {why}")
            self._inbox.append(fn)
            self._cond.notify()

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """Run `fn` on the loop thread and return its result (inline if already there)."""
        if self.on_loop_thread:
            return fn()
        return self._wait(self._enqueue(fn), timeout_s)

    def _enqueue(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

        self.post(run)
        return future

    def _wait(self, future: Future[T], timeout_s: float) -> T:
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TransferError(f"{self.name}: no answer within {timeout_s:.1f}s") from None

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self, teardown: Callable[[], None], timeout_s: float) -> None:
        """Run the remaining commands, then `teardown` on the thread, then end it."""
        with self._cond:
            if self._thread is None or self._stopping:
                return
            self._teardown = teardown
            self._stopping = True
            self._cond.notify()
        if not self.on_loop_thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("%s did not stop within %.1fs", self.name, timeout_s)

    def _run(self) -> None:
        self._progress_at = time.monotonic()
        try:
            self._loop()
        except BaseException as e:  # only a bug gets here: log it, `progress()` says DIED
            log.exception("%s: thread died", self.name)
            with self._cond:
                self._died_of = f"{type(e).__name__}: {e}"

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._in_commands = bool(self._inbox)  # before the inbox looks empty
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("%s: command failed", self.name)
            self._in_commands = False
            if stopping:
                break
            try:
                sleep_s = min(self._tick(), self._max_sleep_s)
            except Exception:
                log.exception("%s: tick failed", self.name)
                sleep_s = self._max_sleep_s
            with self._cond:
                if not self._inbox and not self._stopping and sleep_s > 0:
                    self._cond.wait(sleep_s)
            self._progress_at = time.monotonic()
        if self._teardown is not None:
            try:
                self._teardown()
            except Exception:
                log.exception("%s: teardown failed", self.name)
