"""The machinery both worker roles share: an engine on its own thread, per-request output
queues on the actor's event loop, KV-event publishing to the Redis index, and load snapshots.

Threads in a worker process: the actor's asyncio loop (Ray calls), the engine thread
(`EngineDriver`), the KV-transfer thread (kv_transfer endpoints) and the publisher thread.
Only the engine thread touches the engine; everything else reaches it through `call`/`post`.
Outputs come back once per step (`loop.call_soon_threadsafe`) and are handed to each
request's sink on the event loop: an `open_stream(request_id)` queue, or any `OutputSink`
given to `open_sink` (the decode worker's token channels batch many requests' outputs).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from engine.block_hash import BlockHash
from engine.config import EngineConfig
from engine.driver import EngineDriver
from engine.engine import LLMEngine
from engine.outputs import RequestOutput
from kv_transfer.config import PrefixIndexConfig
from kv_transfer.kv_publisher import KVEventPublisher
from prefill_worker.api import (
    RequestDeadlineExceeded,
    WorkerInfo,
    WorkerRole,
    WorkerState,
    WorkerUnhealthy,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker actor (both roles)."""

    worker_id: str
    role: WorkerRole
    engine: EngineConfig
    redis_url: str | None = None
    """Prefix-index Redis; None disables KV-event publishing (routing then ignores this
    worker's cache)."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    torch_threads: int = 1
    """CPU: intra-op threads for this worker's torch (several workers share the cores)."""
    max_inflight_requests: int = 1024
    """Requests the worker holds at once (queued, running or streaming); more are refused."""
    max_consecutive_step_errors: int = 3
    """Engine steps failing in a row after which the worker reports itself unhealthy (its
    health check raises `WorkerUnhealthy`) and the controller replaces it: a sticky device
    error fails every later step."""


class OutputSink(Protocol):
    """Where one request's outputs and its error go, on the actor's event loop (called from
    the loop only, once per item, in order; an `asyncio.Queue` is one)."""

    def put_nowait(self, item: RequestOutput | BaseException) -> None: ...


class StepFailed(Exception):
    """The engine step that carried this request raised; the request was aborted."""


class WorkerRuntime:
    """Engine thread + asyncio bridge + KV-event publisher of one worker."""

    def __init__(self, config: WorkerConfig, actor_name: str) -> None:
        self.config = config
        self.actor_name = actor_name
        self.state = WorkerState.STARTING
        self.engine: LLMEngine | None = None
        self.info: WorkerInfo | None = None
        self.requests_done = 0
        self._streams: dict[str, OutputSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: EngineDriver | None = None
        self._publisher: KVEventPublisher | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        """Load the model (off the event loop), start the engine thread and the publisher."""
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(self._build_engine)
        driver = EngineDriver(
            self.engine,
            on_outputs=self._on_outputs,
            on_step_error=self._on_step_error,
            on_tick=self._on_tick,
            name=f"engine-{self.config.worker_id}",
        )
        self._driver = driver
        if self.config.redis_url:
            publisher = KVEventPublisher(
                self.config.redis_url,
                self.engine.model_id,
                self.config.worker_id,
                snapshot=self._cache_snapshot,
                config=self.config.index,
            )
            publisher.start()
            self._publisher = publisher
        driver.start()
        engine = self.engine
        self.info = WorkerInfo(
            worker_id=self.config.worker_id,
            role=self.config.role,
            actor_name=self.actor_name,
            node=_node_id(),
            device=str(engine.kv_cache.device),
            model_id=engine.model_id,
            block_size=engine.config.block_size,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            num_kv_blocks=engine.block_pool.num_blocks,
        )
        self.state = WorkerState.READY
        return self.info

    def _build_engine(self) -> LLMEngine:
        import torch

        if self.config.engine.device in ("cpu", "auto") and not torch.cuda.is_available():
            torch.set_num_threads(max(1, self.config.torch_threads))
        return LLMEngine(self.config.engine)

    def stop(self) -> None:
        self.state = WorkerState.STOPPED
        for q in self._streams.values():
            q.put_nowait(RuntimeError("worker stopped"))
        if self._publisher is not None:
            self._publisher.close()
        if self._driver is not None:
            self._driver.stop()

    def check_health(self) -> WorkerState:
        """The worker's state; raises `WorkerUnhealthy` once the engine has failed
        `max_consecutive_step_errors` steps in a row."""
        driver = self._driver
        limit = self.config.max_consecutive_step_errors
        if driver is not None and limit > 0 and driver.consecutive_step_errors >= limit:
            raise WorkerUnhealthy(
                f"worker {self.config.worker_id}: {driver.consecutive_step_errors} engine steps "
                f"failed in a row (last: {driver.last_step_error})"
            )
        return self.state

    # ---- engine access ----------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.driver.call(fn))

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run `fn(engine)` on the engine thread, fire and forget (any thread may call)."""
        self.driver.post(fn)

    @property
    def driver(self) -> EngineDriver:
        if self._driver is None:
            raise RuntimeError("worker not started")
        return self._driver

    # ---- output streams ---------------------------------------------------------------------

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | BaseException]:
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.open_sink(request_id, q)
        return q

    def open_sink(self, request_id: str, sink: OutputSink) -> None:
        """Send the request's outputs to `sink` until `close_stream` (counts as in flight)."""
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight on this worker")
        self._streams[request_id] = sink

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        """Wake the request's reader with `error` (e.g. it was aborted; the engine sends no
        output for an aborted request)."""
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(error)

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:  # engine thread
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput] | list[tuple[str, BaseException]]) -> None:
        for item in outputs:
            payload: RequestOutput | BaseException
            if isinstance(item, tuple):
                rid, payload = item
            else:
                rid, payload = item.request_id, item
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(payload)

    def _on_step_error(self, error: BaseException, request_ids: list[str]) -> None:
        assert self._loop is not None
        failure = StepFailed(f"engine step failed: {type(error).__name__}: {error}")
        failed: list[tuple[str, BaseException]] = [(rid, failure) for rid in request_ids]
        self._loop.call_soon_threadsafe(self._deliver, failed)

    # ---- prefix-index publishing ------------------------------------------------------------

    def _on_tick(self, engine: LLMEngine) -> None:  # engine thread
        if self._publisher is None:
            return
        events = engine.take_kv_events()
        if events:
            self._publisher.publish(events)

    def _cache_snapshot(self) -> tuple[int, list[BlockHash]]:  # publisher thread
        hashes, seq = self.driver.call(lambda e: e.cached_block_hashes()).result(timeout=30)
        return seq, list(hashes)


def _node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        return os.uname().nodename


async def next_output(
    queue: asyncio.Queue[RequestOutput | BaseException], deadline: float | None, rid: str
) -> RequestOutput:
    """The next output of a request, or raise its error / RequestDeadlineExceeded."""
    timeout = None if deadline is None else deadline - time.time()
    if timeout is not None and timeout <= 0:
        raise RequestDeadlineExceeded(f"request {rid}: deadline passed before it was served")
    try:
        item = await asyncio.wait_for(queue.get(), timeout)
    except TimeoutError:
        raise RequestDeadlineExceeded(f"request {rid}: deadline passed on the worker") from None
    if isinstance(item, BaseException):
        raise item
    return item
