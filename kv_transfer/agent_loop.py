"""The one thread that owns a transfer agent.

NIXL agents are not meant to be driven from several threads, and the worker's engine thread
must never block on the network. So each endpoint owns an `AgentLoop`: a daemon thread that
creates the backend, runs every command posted to it, calls `tick()` (which returns how long
it may sleep) and sleeps on a condition until that time or the next posted command. Timers
(lease reaper, deadlines, heartbeats) therefore run without any new work arriving.

Other threads use `post` (fire and forget) or `call` (wait for the result, with a deadline).
A command that raises is logged (post) or re-raised in the caller (call); it never kills the
thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from kv_transfer.errors import TransferError

log = logging.getLogger(__name__)
T = TypeVar("T")


class LoopStopped(TransferError):
    """The endpoint's transfer thread is not running."""


class AgentLoop:
    """A thread running posted commands and a periodic `tick`."""

    def __init__(self, name: str, tick: Callable[[], float], max_sleep_s: float) -> None:
        self.name = name
        self._tick = tick
        self._max_sleep_s = max_sleep_s
        self._cond = threading.Condition()
        self._inbox: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._teardown: Callable[[], None] | None = None

    @property
    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

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
            if self._stopping:
                raise LoopStopped(f"{self.name} is stopped")
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
        while True:
            with self._cond:
                commands = list(self._inbox)
                self._inbox.clear()
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:
                    log.exception("%s: command failed", self.name)
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
        if self._teardown is not None:
            try:
                self._teardown()
            except Exception:
                log.exception("%s: teardown failed", self.name)
