"""The lifecycle both worker roles share: the base class of their Ray actor classes.

States (`WorkerState`, as the worker reports it in `load()`):

    STARTING ──start()──► READY ──drain()──► DRAINING ──undrain()──► READY
    any ──shutdown()──► STOPPED

`start` loads the model and starts the engine thread (`WorkerRuntime`; a tensor-parallel
worker's follower ranks with it), then opens the role (`open_role`: its KV endpoint,
`_make_endpoint`, whose thread the health check watches too). A role object made to take
over from another (`takes_over`: a role switch, worker_runtime/role_host.py) shares that
one's runtime and budget, so the engine, its weights and its KV pool outlive the old role:
`close_role` ends the old role's endpoint, `open_role` the new one's. One in-flight budget
(`budget`, kv_transfer/budget.py) covers the worker's KV pulls and its engine's host-tier
copies. `admit` is the check
every new request passes (READY, and room for one more). `drain` stops admitting and waits
until the role holds nothing (`_holds_work`: a decode worker's streams, a prefill worker's
requests and leases); `ping` is the controller's health check (health means progress:
`WorkerRuntime.check_health`); `shutdown` closes the endpoint and stops the runtime, failing
what is left with `WorkerStopped`, and flushes the process's spans (vocabulary/tracing.py,
set up from `OTEL_*` when the actor is created).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from engine.core.engine import LLMEngine
from kv_transfer.budget import InFlightBudget
from kv_transfer.config import KVTransferConfig
from vocabulary.engine_io import LoraInfo
from vocabulary.loop_progress import LoopProgress
from vocabulary.malloc_trim import start_malloc_trim
from vocabulary.tracing import FinishedSpan, configure_tracing, finished_spans, shutdown_tracing
from vocabulary.worker_api import WorkerDraining, WorkerInfo, WorkerOverloaded, WorkerState
from worker_runtime.runtime import WorkerConfig, WorkerRuntime

DRAIN_POLL_S = 0.05
TRANSFER_LOOP = "kv-transfer thread"
"""The name the health check gives the KV endpoint's thread."""


class Endpoint(Protocol):
    """What the lifecycle needs of a role's KV endpoint (PrefillEndpoint, DecodeEndpoint)."""

    def start(self) -> object: ...

    def close(self) -> None: ...

    def progress(self) -> LoopProgress: ...


E = TypeVar("E", bound=Endpoint)


class WorkerLifecycle(Generic[E]):
    """Start, admit, drain, undrain, ping and shut down a worker (see the module docstring);
    a role subclasses it with its endpoint type and its requests."""

    runtime: WorkerRuntime
    budget: InFlightBudget
    """What this worker moves at once: its KV pulls and its host tier's copies."""

    def __init__(
        self,
        config: WorkerConfig,
        transfer: KVTransferConfig,
        actor_name: str = "",
        followers: Sequence[Any] = (),
        takes_over: WorkerLifecycle[Any] | None = None,
    ) -> None:
        """`followers`: a tensor-parallel worker's rank 1.. actors
        (deploy/control/worker_actors.py). `takes_over`: the role this one replaces in the
        same process (a role switch): its started runtime and budget are this one's, with
        `config` (the new role's) in place of its config."""
        self.transfer_config = transfer
        self.endpoint: E | None = None
        if takes_over is not None:
            self.runtime = takes_over.runtime
            self.runtime.config = config
            self.budget = takes_over.budget
            return
        self.runtime = WorkerRuntime(config, actor_name or config.worker_id, followers, transfer)
        self.budget = InFlightBudget(transfer.budget)
        configure_tracing(config.role.value)  # from OTEL_*: off unless an exporter is named
        start_malloc_trim(config.role.value)  # from PDSERVE_MALLOC_TRIM_S

    # ---- the role's part --------------------------------------------------------------------

    def _make_endpoint(self, engine: LLMEngine) -> E:
        """The role's KV endpoint over the engine's pool (not started yet)."""
        raise NotImplementedError

    def _holds_work(self) -> bool:
        """True while the worker holds anything a drain must wait for."""
        return self.runtime.num_inflight > 0

    def _closing(self) -> None:
        """After the endpoint closed and the runtime stopped (e.g. end token channels)."""

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        """Load the model, start the engine and the KV endpoint; returns the worker's info."""
        info = await self.runtime.start()
        await self.runtime.call(lambda e: e.use_copy_budget(self.budget))
        await self.open_role()
        return info

    async def open_role(self) -> None:
        """Start the role's KV endpoint over the started engine (`start`; a role switch)."""
        engine = self.runtime.engine
        assert engine is not None
        endpoint = self._make_endpoint(engine)
        await asyncio.to_thread(endpoint.start)
        self.endpoint = endpoint
        self.runtime.watch(TRANSFER_LOOP, endpoint.progress)

    async def close_role(self) -> None:
        """End the role's KV endpoint and what the role keeps beside it (token channels);
        the engine runs on (a role switch, once the role holds nothing)."""
        if self.endpoint is not None:
            self.runtime.unwatch(TRANSFER_LOOP)
            await asyncio.to_thread(self.endpoint.close)
        self._closing()

    @property
    def _endpoint(self) -> E:
        if self.endpoint is None:
            raise RuntimeError(f"worker {self.runtime.config.worker_id} not started")
        return self.endpoint

    def admit(self) -> None:
        """Raise `WorkerDraining` unless READY, `WorkerOverloaded` when it holds its most."""
        rt = self.runtime
        if rt.state is not WorkerState.READY:
            raise WorkerDraining(f"worker {rt.config.worker_id} is {rt.state.value}")
        if rt.num_inflight >= rt.config.max_inflight_requests:
            raise WorkerOverloaded(f"worker {rt.config.worker_id} holds too many requests")

    def info(self) -> WorkerInfo:
        assert self.runtime.info is not None
        return self.runtime.info

    def ping(self) -> str:
        """The worker's state (the controller's health check); raises `WorkerUnhealthy` when
        its engine keeps failing, or a thread with work stopped making progress."""
        return self.runtime.check_health().value

    async def drain(self, timeout_s: float = 60.0) -> bool:
        """Stop admitting; wait (up to `timeout_s`) until the worker holds nothing. True when
        it is idle (at once for an idle worker, whatever the timeout)."""
        rt = self.runtime
        if rt.state is WorkerState.READY:
            rt.state = WorkerState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._holds_work():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def undrain(self) -> None:
        """Admit again (a draining worker only)."""
        if self.runtime.state is WorkerState.DRAINING:
            self.runtime.state = WorkerState.READY

    async def shutdown(self) -> None:
        if self.endpoint is not None:
            await asyncio.to_thread(self.endpoint.close)
        self.runtime.stop()
        await self.runtime.stop_ranks()
        self._closing()
        await asyncio.to_thread(shutdown_tracing)  # what is left goes to the exporter

    # ---- LoRA adapters ------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> LoraInfo:
        """Register a PEFT adapter folder under `name` (idempotent for the same path; its
        weights are read on first use). Raises ValueError naming what is wrong with it, or
        that LoRA is off on this worker."""
        return await self.runtime.load_lora(name, path)

    async def unload_lora(self, name: str) -> bool:
        """Unregister an adapter (False: not registered); requests running on it finish."""
        return await self.runtime.unload_lora(name)

    async def list_loras(self) -> tuple[LoraInfo, ...]:
        return await self.runtime.call(lambda e: e.list_loras())

    def finished_spans(self, clear: bool = False) -> list[FinishedSpan]:
        """The spans this worker exported to the `pdserve_memory` exporter (tests and
        debugging; empty with another exporter or tracing off)."""
        return finished_spans(clear)
