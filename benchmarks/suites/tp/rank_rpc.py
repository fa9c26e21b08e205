"""Rank processes of the TP suites: one object per spawned process, called over pipes, every
wait bounded; and a free loopback port for a group of rank processes to meet on.

A GPU benchmark that runs each rank of a worker in its own process (as a worker does: one
device, one CUDA context, one NIXL agent per process) builds each rank's object in a child
(`start_child`: `factory(*args)`, in the child) and calls its methods from the parent through
a `Caller`. A child can also serve a second pipe, so that one child calls another directly
(a decode worker's rank 0 driving its followers' reads, as Ray calls do in a worker).

A method that returns a `concurrent.futures.Future` is answered when the future completes
(the caller's `submit` gets a future of its own), so a read that runs for a while does not
hold the pipe. Errors come back as `RemoteError` with the child's traceback text (exception
objects need not pickle). A child that dies fails every pending call at once.
"""

from __future__ import annotations

import functools
import itertools
import socket
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any


class RemoteError(RuntimeError):
    """A call into a child failed there (its traceback is the message), the child is gone,
    or it did not answer in time."""


class Caller:
    """The calling end of one pipe into a child's object (any thread may call)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._gone = ""
        self._reader = threading.Thread(target=self._read, name=f"rpc-{name}", daemon=True)
        self._reader.start()

    @property
    def gone(self) -> bool:
        """The child's pipe has closed (it exited or died)."""
        return bool(self._gone)

    def submit(self, method: str, *args: Any) -> Future[Any]:
        """Call `method(*args)` there; the future holds its result or a `RemoteError`."""
        future: Future[Any] = Future()
        with self._lock:
            if self._gone:
                future.set_exception(RemoteError(f"{self.name}: {self._gone}"))
                return future
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self.conn.send(("call", call_id, method, args))
            except (OSError, EOFError) as e:
                del self._pending[call_id]
                future.set_exception(RemoteError(f"{self.name}: sending {method}: {e}"))
        return future

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        """`submit` and wait at most `timeout_s` for the result."""
        try:
            return self.submit(method, *args).result(timeout=timeout_s)
        except FutureTimeout:
            raise RemoteError(f"{self.name}.{method}: no answer within {timeout_s:g} s") from None

    def stop(self) -> None:
        """Ask the child to close its object and exit (no answer is awaited)."""
        with self._lock, _quiet():
            self.conn.send(("stop",))

    def _read(self) -> None:
        while True:
            try:
                _, call_id, ok, value = self.conn.recv()
            except (EOFError, OSError) as e:
                self._fail_all(f"the process is gone ({type(e).__name__})")
                return
            with self._lock:
                future = self._pending.pop(call_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RemoteError(f"{self.name}: {value}"))

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._gone = why
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(RemoteError(f"{self.name}: {why}"))


class _quiet:
    """Ignore a broken pipe (the child may be gone already)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> bool:
        return exc_type is not None and issubclass(exc_type, (OSError, EOFError))


def serve(conn: Connection, target: object, stop: threading.Event) -> None:
    """Answer calls on `conn` with `target`'s methods until a stop message, `stop`, or EOF."""
    lock = threading.Lock()

    def reply(call_id: int, ok: bool, value: Any) -> None:
        with lock, _quiet():
            conn.send(("reply", call_id, ok, value))

    def reply_later(call_id: int, future: Future[Any]) -> None:
        error = future.exception()
        if error is None:
            reply(call_id, True, future.result())
        else:
            reply(call_id, False, f"{type(error).__name__}: {error}")

    while not stop.is_set():
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            stop.set()
            break
        _, call_id, method, args = message
        try:
            result = getattr(target, method)(*args)
        except BaseException as e:
            reply(call_id, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            continue
        if isinstance(result, Future):
            result.add_done_callback(functools.partial(reply_later, call_id))
        else:
            reply(call_id, True, result)


def _child_main(
    factory: Callable[..., object],
    args: tuple[Any, ...],
    serves: list[Connection],
    calls: list[Connection],
    name: str,
) -> None:
    """Build the target (`factory(*args)`, plus a list of `Caller`s when `calls`), report
    ready or the failure on `serves[0]`, then serve every pipe in `serves` until stopped."""
    main = serves[0]
    try:
        callers = [Caller(c, f"{name}->peer{i}") for i, c in enumerate(calls)]
        target = factory(*args, callers) if calls else factory(*args)
    except BaseException as e:
        main.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    main.send(("ready", None))
    stop = threading.Event()
    for conn in serves[1:]:
        threading.Thread(target=serve, args=(conn, target, stop), daemon=True).start()
    serve(main, target, stop)
    close = getattr(target, "close", None)
    if close is not None:
        close()


@dataclass
class Child:
    """A started child process and the pipe the parent calls it through."""

    name: str
    process: BaseProcess
    conn: Connection
    caller: Caller | None = None

    def ready(self, timeout_s: float) -> Caller:
        """Wait until the child built its object; its `Caller`. Raises `RemoteError` with
        the child's traceback when building failed, or after `timeout_s`."""
        if self.caller is not None:
            return self.caller
        if not self.conn.poll(timeout_s):
            why = "exited" if not self.process.is_alive() else f"no word in {timeout_s:.1f} s"
            raise RemoteError(f"{self.name} did not start: {why}")
        try:
            kind, text = self.conn.recv()
        except EOFError:
            raise RemoteError(f"{self.name} exited while starting") from None
        if kind != "ready":
            raise RemoteError(f"{self.name} did not start: {text}")
        self.caller = Caller(self.conn, self.name)
        return self.caller

    def stop(self, timeout_s: float) -> None:
        """Ask it to close and exit; kill it if it has not within `timeout_s`."""
        if self.caller is not None:
            self.caller.stop()
        else:
            with _quiet():
                self.conn.send(("stop",))
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


def start_child(
    ctx: SpawnContext,
    name: str,
    factory: Callable[..., object],
    args: tuple[Any, ...],
    serves: Sequence[Connection] = (),
    calls: Sequence[Connection] = (),
) -> Child:
    """Start a child that builds `factory(*args)` (and, with `calls`, gets `Caller`s over
    those pipes as its last argument) and serves the parent plus `serves`. `factory` must be
    importable by the child (module level)."""
    ours, theirs = ctx.Pipe()
    process = ctx.Process(
        target=_child_main,
        args=(factory, args, [theirs, *serves], list(calls), name),
        name=name,
        daemon=True,
    )
    process.start()
    theirs.close()
    return Child(name, process, ours)


def free_port() -> int:
    """A loopback TCP port free now: where the ranks of a spawned group rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
