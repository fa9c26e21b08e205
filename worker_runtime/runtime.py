"""The machinery both worker roles share: an engine on its own thread, per-request output
queues on the actor's event loop, KV-event publishing to the Redis index, and load snapshots.

Threads in a worker process: the actor's asyncio loop (Ray calls), the engine thread
(`EngineDriver`), the KV-transfer thread (kv_transfer endpoints) and the publisher thread.
Only the engine thread touches the engine; everything else reaches it through `call`/`post`.
Outputs come back once per step (`loop.call_soon_threadsafe`) and are handed to each
request's sink on the event loop: an `open_stream(request_id)` queue, or any `OutputSink`
given to `open_sink` (the decode worker's token channels batch many requests' outputs).

Health means progress: `check_health` (the actor's `ping`) reads each watched thread's
`LoopProgress` (the engine thread always; the worker adds its KV-transfer thread with
`watch`) and raises `WorkerUnhealthy` when one has died, or has had work pending without
completing an iteration for `stall_timeout_s`; the asyncio loop answering is not enough.

Tensor and pipeline parallelism: with follower actors (`followers`, one per rank 1..N-1:
TP ranks, or pipeline stages x TP ranks), this worker is rank 0: `start` starts them and
builds its engine in their group (worker_runtime/tp_ranks.py), and the ranks are watched too
(a follower that died, or a broken group, makes the worker unhealthy); `stop` ends them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from engine.config import EngineConfig, EngineMode
from engine.core.driver import EngineDriver, EngineStopped
from engine.core.engine import LLMEngine
from engine.pp.pipeline_group import PPGroup
from kv_transfer.config import KVTransferConfig
from prefix_index.config import PrefixIndexConfig
from prefix_index.publisher import KVEventPublisher
from vocabulary.engine_io import LoraInfo, RequestOutput
from vocabulary.kv_events import CacheSnapshot, PublisherStats
from vocabulary.loop_progress import LoopProgress, LoopState
from vocabulary.sampling import SamplingParams
from vocabulary.waits import wait_within
from vocabulary.worker_api import (
    ProcessCounts,
    RequestDeadlineExceeded,
    StepFailed,
    WorkerInfo,
    WorkerRole,
    WorkerState,
    WorkerStopped,
    WorkerUnhealthy,
)
from worker_runtime.tp_ranks import TPRanks, WorkerGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

ENGINE_LOOP = "engine thread"
"""The name `check_health` gives the engine driver's loop (always watched)."""
TP_RANKS = "TP ranks"
"""The name `check_health` gives a TP worker's follower ranks."""
START_TIMEOUT_S = 600.0
"""Longest a TP worker waits for its followers to start once its own engine is built."""


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker actor (both roles)."""

    worker_id: str
    role: WorkerRole
    engine: EngineConfig
    redis_url: str | None = None
    """Prefix-index Redis; None disables KV-event publishing (routing then ignores this
    worker's cache)."""
    namespace: str | None = None
    """The Ray namespace the worker and its peers are named in (its cluster's name); None:
    its creator's (workers started on their own, as tests and benchmarks do)."""
    index: PrefixIndexConfig = field(default_factory=PrefixIndexConfig)
    torch_threads: int = 1
    """CPU: intra-op threads for this worker's torch (several workers share the cores)."""
    max_inflight_requests: int = 1024
    """Requests the worker holds at once (queued, running or streaming); more are refused."""
    max_consecutive_step_errors: int = 3
    """Engine steps failing in a row after which the worker reports itself unhealthy (its
    health check raises `WorkerUnhealthy`) and the controller replaces it: a sticky device
    error fails every later step."""
    stall_timeout_s: float = 60.0
    """Seconds a watched thread (the engine's, the KV transfer's) may have work pending without
    completing a loop iteration before the health check reports the worker unhealthy (a device
    call that never returns, a deadlock, a blocked command). One engine iteration is one step,
    so this must exceed the longest legitimate step: a cold flashinfer JIT of the prefill and
    decode kernels in the same step (about 45 s on a fresh machine), a long CPU prefill chunk.
    0 disables the stall check (a thread that died is reported all the same)."""

    def __post_init__(self) -> None:
        if self.stall_timeout_s < 0:
            raise ValueError("WorkerConfig.stall_timeout_s must be >= 0 (0 disables)")


def engine_mode(role: WorkerRole) -> EngineMode:
    """The engine mode a worker of `role` runs: prefill-only, split, else colocated (a decode
    worker prefills short prompts itself)."""
    modes = {WorkerRole.PREFILL: EngineMode.PREFILL_ONLY, WorkerRole.SPLIT: EngineMode.SPLIT}
    return modes.get(role, EngineMode.COLOCATED)


class OutputSink(Protocol):
    """Where one request's outputs and its error go, on the actor's event loop (called from
    the loop only, once per item, in order; an `asyncio.Queue` is one)."""

    def put_nowait(self, item: RequestOutput | BaseException) -> None: ...


ProgressProbe = Callable[[], LoopProgress]
"""Reads one thread's progress; called on the actor's event loop: quick and thread-safe."""


def stall_reason(name: str, progress: LoopProgress, stall_timeout_s: float) -> str | None:
    """Why the loop `name` makes its worker unhealthy, or None while it is fine: it died, or
    it has work pending and completed no iteration for `stall_timeout_s` (0: never stalls).
    A loop not started yet, or asked to stop, is fine (the worker's state says the rest)."""
    if progress.state is LoopState.DIED:
        return f"{name} died ({progress.error or 'no error recorded'})"
    if progress.state is not LoopState.RUNNING or stall_timeout_s <= 0:
        return None
    if progress.has_work and progress.stalled_s >= stall_timeout_s:
        return (
            f"{name} made no progress for {progress.stalled_s:.1f}s with work pending "
            f"(stall_timeout_s={stall_timeout_s:g})"
        )
    return None


class WorkerRuntime:
    """Engine thread + asyncio bridge + KV-event publisher of one worker."""

    def __init__(
        self,
        config: WorkerConfig,
        actor_name: str,
        followers: Sequence[Any] = (),
        transfer: KVTransferConfig | None = None,
    ) -> None:
        """`followers`: the actors of ranks 1.. (worker_runtime/tp_follower.py), as many as
        `config.engine.num_ranks` - 1 (TP ranks, or pipeline stages x TP ranks)."""
        size = config.engine.num_ranks
        if len(followers) != size - 1:
            raise ValueError(
                f"{config.engine.pipeline_parallel_size} pipeline stage(s) x "
                f"{config.engine.tensor_parallel_size} TP rank(s) need {size - 1} follower "
                "actors"
            )
        self.config = config
        self.actor_name = actor_name
        self.tp = (
            TPRanks(followers, config.worker_id, transfer or KVTransferConfig())
            if followers
            else None
        )
        """The TP worker's followers (None with one rank)."""
        self.state = WorkerState.STARTING
        self.engine: LLMEngine | None = None
        self.info: WorkerInfo | None = None
        self.requests_done = 0
        self._streams: dict[str, OutputSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: EngineDriver | None = None
        self._publisher: KVEventPublisher | None = None
        self._probes: dict[str, ProgressProbe] = {}
        self.lora_names: tuple[str, ...] = tuple(name for name, _ in config.engine.loras)
        """Adapters registered on the engine (reported in the worker's load)."""

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        """Load the model (off the event loop), start the engine thread and the publisher."""
        self._loop = asyncio.get_running_loop()
        if self.tp is not None:
            engine_config = self.config.engine
            self.engine = await self.tp.start(self._build_engine, engine_config, START_TIMEOUT_S)
            self.watch(TP_RANKS, self.tp.probe)
        else:
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
            weights_dtype=str(engine.model.dtype).removeprefix("torch."),
            quantization=engine.model.quantization,
            weight_bytes=engine.model.weight_bytes,
            kv_cache_dtype=engine.kv_cache.spec.dtype,
            kv_cache_bytes=engine.kv_cache.spec.nbytes,
            tp_size=engine.config.tensor_parallel_size,
            pp_size=engine.config.pipeline_parallel_size,
            kv_layout=engine.kv_cache.spec.layout,
        )
        self.state = WorkerState.READY
        return self.info

    def _build_engine(self, group: WorkerGroup | None = None) -> LLMEngine:
        import torch

        if self.config.engine.device in ("cpu", "auto") and not torch.cuda.is_available():
            torch.set_num_threads(max(1, self.config.torch_threads))
        if isinstance(group, PPGroup):
            return LLMEngine(self.config.engine, pp=group)
        return LLMEngine(self.config.engine, tp=group)

    def stop(self) -> None:
        """Fail every open stream with `WorkerStopped`, stop the publisher and the engine
        (a TP engine's followers are told to return: `stop_ranks` ends their actors)."""
        self.state = WorkerState.STOPPED
        for q in self._streams.values():
            q.put_nowait(WorkerStopped(f"worker {self.config.worker_id} stopped"))
        if self._publisher is not None:
            self._publisher.close()
        if self._driver is not None:
            self._driver.stop()
        if self.tp is not None and self.engine is not None:
            try:  # the engine thread has stopped: this thread may touch the engine
                self.engine.close()
            except Exception as e:  # a broken group has nobody to tell
                log.warning("closing the TP engine: %s: %s", type(e).__name__, e)
            if self.tp.group is not None:
                self.tp.group.close()

    async def stop_ranks(self) -> None:
        """After `stop`: end the follower actors' work (best effort)."""
        if self.tp is not None:
            await self.tp.stop()

    @property
    def index_publish_errors(self) -> int:
        """Failed rounds of the KV-event publisher (0 without one)."""
        return self._publisher.num_errors if self._publisher is not None else 0

    def process_counts(self) -> ProcessCounts:
        """This process's open fds, Python threads and tasks on the actor's loop (for the load
        report: cheap, any thread)."""
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:  # not Linux
            fds = 0
        loop = self._loop
        tasks = len(asyncio.all_tasks(loop)) if loop is not None else 0
        return ProcessCounts(fds=fds, threads=threading.active_count(), tasks=tasks)

    def index_stats(self) -> PublisherStats | None:
        """The KV-event publisher's state, for the worker's load report (None without one)."""
        return self._publisher.stats() if self._publisher is not None else None

    def watch(self, name: str, probe: ProgressProbe) -> None:
        """Include another thread's loop in `check_health` (e.g. the KV-transfer endpoint's
        `progress`); the engine thread is always included, as `ENGINE_LOOP`."""
        if name == ENGINE_LOOP or name in self._probes:
            raise ValueError(f"a loop named {name!r} is already watched")
        self._probes[name] = probe

    def unwatch(self, name: str) -> None:
        """Stop including the loop `name` in `check_health` (its thread is being closed)."""
        self._probes.pop(name, None)

    def check_health(self) -> WorkerState:
        """The worker's state; raises `WorkerUnhealthy` once the engine has failed
        `max_consecutive_step_errors` steps in a row, or a watched thread has died or stalled
        with work pending for `stall_timeout_s` (see `stall_reason`)."""
        driver = self._driver
        wid = self.config.worker_id
        limit = self.config.max_consecutive_step_errors
        reasons = []
        if driver is not None and limit > 0 and driver.consecutive_step_errors >= limit:
            reasons.append(
                f"{driver.consecutive_step_errors} engine steps failed in a row (last: "
                f"{driver.last_step_error})"
            )
        probes = dict(self._probes)
        if driver is not None:
            probes = {ENGINE_LOOP: driver.progress, **probes}
        timeout_s = self.config.stall_timeout_s
        # every reason, not the first: failed steps are often the symptom of another (a TP
        # rank that died breaks every step), and the message should name the cause too
        reasons += [
            reason
            for name, probe in probes.items()
            if (reason := stall_reason(name, probe(), timeout_s)) is not None
        ]
        if reasons:
            raise WorkerUnhealthy(f"worker {wid}: " + "; ".join(reasons))
        return self.state

    # ---- engine access ----------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread and await its result; raises `WorkerStopped`
        once the worker stops."""
        try:
            return await asyncio.wrap_future(self.driver.call(fn))
        except EngineStopped as e:
            raise WorkerStopped(f"worker {self.config.worker_id} is stopped") from e

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint on the engine's grammar threads
        before the engine sees the request, so the engine thread never waits on a compile
        (the request waits for its own); SamplingParamsError naming structured_output when
        it does not compile. Nothing to do for a free request, nor for one whose constraint
        is cached (no thread waits on a hit: a worker's thread count stays what its first
        compiles made it)."""
        engine, constraint = self.engine, params.structured
        if (
            constraint is not None
            and engine is not None
            and not engine.constrained.compiled(constraint)
        ):
            await asyncio.to_thread(engine.constrained.compile, constraint)

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run `fn(engine)` on the engine thread, fire and forget (any thread may call)."""
        self.driver.post(fn)

    @property
    def driver(self) -> EngineDriver:
        if self._driver is None:
            raise RuntimeError("worker not started")
        return self._driver

    # ---- LoRA adapters ------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> LoraInfo:
        def load(engine: LLMEngine) -> tuple[LoraInfo, tuple[LoraInfo, ...]]:
            engine.load_lora(name, path)
            infos = engine.list_loras()
            return next(i for i in infos if i.name == name), infos

        info, infos = await self.call(load)
        self.lora_names = tuple(i.name for i in infos)
        return info

    async def unload_lora(self, name: str) -> bool:
        def unload(engine: LLMEngine) -> tuple[bool, tuple[LoraInfo, ...]]:
            return engine.unload_lora(name), engine.list_loras()

        found, infos = await self.call(unload)
        self.lora_names = tuple(i.name for i in infos)
        return found

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
            elif item.abort_error is not None:  # the engine ended it (its adapter is gone)
                rid, payload = item.request_id, item.abort_error
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

    def _cache_snapshot(self) -> CacheSnapshot:  # publisher thread
        return self.driver.call(lambda e: e.cache_snapshot()).result(timeout=30)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():  # asking an uninitialized Ray would start a local one
            return str(ray.get_runtime_context().get_node_id())
    except Exception:
        pass
    return os.uname().nodename


async def within_deadline(aw: Awaitable[T], deadline: float | None, request_id: str) -> T:
    """Await `aw` until the request's wall-clock `deadline` (None: no limit); raises
    RequestDeadlineExceeded past it (and cancels `aw`)."""
    timeout = None if deadline is None else deadline - time.time()
    if timeout is not None and timeout <= 0:
        raise RequestDeadlineExceeded(f"request {request_id}: deadline passed before it was served")
    try:
        return await wait_within(aw, timeout)
    except TimeoutError:
        raise RequestDeadlineExceeded(
            f"request {request_id}: deadline passed on the worker"
        ) from None


async def next_output(
    queue: asyncio.Queue[RequestOutput | BaseException], deadline: float | None, rid: str
) -> RequestOutput:
    """The next output of a request, or raise its error / RequestDeadlineExceeded."""
    item = await within_deadline(queue.get(), deadline, rid)
    if isinstance(item, BaseException):
        raise item
    return item
