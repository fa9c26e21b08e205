"""The router's live view of the workers: who exists (from a directory), who is alive, and
how loaded each is (polled), in the shapes admission and placement take.

Loads are polled on a timer with a timeout: every `poll_interval_s` while requests arrive,
every `idle_poll_interval_s` once none has arrived for `idle_after_s` (each poll is one Ray
call per worker, which costs the router CPU: docs/benchmarks.md, "Router overhead (CPU)", has
what polling an idle cluster at the busy rate cost). The first request after a quiet spell wakes
the poller at once (it is admitted on the last poll, at most `idle_poll_interval_s` old; the
admission ledger covers what this router itself admitted meanwhile). A worker that fails
`failure_threshold` polls in a row, or whose call died with an actor error, leaves placement
at once. Between polls the router adds what it dispatched itself, until a report asked for
after the dispatch answers (prompt tokens sent to a prefill worker, also until the prefill
returns; KV blocks of requests placed on a decode worker), so a burst does not pile onto one
worker, nor do the requests sent while a poll is out. Draining workers stay in the
view (their streams go on; placement skips them) until the controller stops them. A worker
that switched role (deploy/control/role_switch.py) is taken as its new role from its first
load report that says so (or the registry's listing, unless the worker's last report says
otherwise: the registry learns of a switch after the worker): it reports READY in its new
role only once it admits as that role, so placement never sends it the old role's work after
the drain began, nor the new role's before the flip.

Each decode worker's entry also holds this router's token channel to it
(router/decode_channel.py), opened on first use, closed when the worker leaves the registry
(or is replaced under the same id) and when the view stops; a channel that breaks because
the actor died marks the worker dead at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from admission.snapshot import ClusterSnapshot, DecodeWorkerLoad, PrefillWorkerLoad
from prefix_index.types import PrefixMatch
from router.decode_channel import DecodeChannel
from router.metrics import RouterMetrics
from router.placement import DecodeCandidate, PrefillCandidate
from vocabulary.waits import wait_within
from vocabulary.worker_api import WorkerInfo, WorkerLoad, WorkerRole, WorkerState

log = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    """Where the router learns which workers exist (the controller, or a fixed list)."""

    async def list_workers(self) -> list[tuple[WorkerInfo, Any]]: ...


class StaticDirectory:
    """A fixed set of (info, actor handle) pairs (tests, single-process setups)."""

    def __init__(self, workers: list[tuple[WorkerInfo, Any]]) -> None:
        self.workers = list(workers)

    async def list_workers(self) -> list[tuple[WorkerInfo, Any]]:
        return list(self.workers)


RegistrySignature = tuple[tuple[str, float, str], ...]
"""Which worker incarnations a registry lists: (worker id, start time, role) of each, in
order."""


@dataclass(frozen=True)
class WorkerListing:
    """The workers a registry lists, with their actor handles and the signature to send
    next time (`ControllerDirectory`)."""

    signature: RegistrySignature
    workers: tuple[tuple[WorkerInfo, Any], ...]


class ControllerDirectory:
    """Asks the controller actor for its registry, sending the signature of the listing it
    holds: the controller answers None while that is still current, a new `WorkerListing`
    otherwise (one call either way, so a registry change is seen on the next refresh).

    Why not the whole list every time: an actor method that returns actor handles leaves Ray
    a record per call in the returning process (~0.4 KB a handle; +19 MB over 12,000 calls
    returning 4 handles, flat when the same calls return none), which grew the controller
    ~5 MB/h at one call a second per router (docs/benchmarks.md, "Chaos and soak")."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self._listing: WorkerListing | None = None

    async def list_workers(self) -> list[tuple[WorkerInfo, Any]]:
        known = self._listing.signature if self._listing is not None else None
        listing = await self.controller.list_workers_if_changed.remote(known)
        if listing is not None:
            self._listing = listing
        return list(self._listing.workers) if self._listing is not None else []


_DISPATCH_KEYS = itertools.count()


@dataclass
class WorkerEntry:
    info: WorkerInfo
    handle: Any
    load: WorkerLoad | None = None
    alive: bool = True
    failures: int = 0
    dispatches: dict[int, tuple[float, int]] = field(default_factory=dict)
    """Prompts this router sent to the worker (prefill roles) that its last report may not
    show: key → (monotonic time sent, uncached tokens); dropped when the prefill call ends or
    a report asked for after the send answers (`dispatch`, `undispatch`, `reported_at`)."""
    channel: DecodeChannel | None = None
    """This router's token channel to the worker (decode roles; opened on first use)."""
    reserved_decode_blocks: int = 0
    """KV blocks of requests this router placed on the worker (decode roles) that its load
    reports do not show yet (reserved at placement, released at the request's first chunk)."""
    reserved_decode_requests: int = 0
    """Those requests (streams the worker will run that it does not report yet)."""
    started_decode: deque[tuple[float, int]] = field(default_factory=deque)
    """(monotonic time, blocks) of requests whose reservation ended at their first chunk:
    still counted until a load report asked for after that time answers (the last report
    may predate the request's start: without this, every request started within a poll
    interval would vanish from the worker's load until the next report)."""
    avoid_until: float = 0.0
    """Monotonic time before which placement skips the worker (it missed a stage deadline)."""
    dead_at: float = -float("inf")
    """Monotonic time its actor was last seen dead (`mark_dead`): a load poll sent before
    then answers for the actor that died and must not bring the entry back."""

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def serving(self) -> bool:
        """Alive, started, admitting new requests, and not being avoided."""
        return (
            self.alive
            and self.load is not None
            and self.load.state is WorkerState.READY
            and time.monotonic() >= self.avoid_until
        )

    @property
    def unreported_decode_blocks(self) -> int:
        """Blocks of the requests placed here that its last report may not show: reserved,
        or started after that report was asked for."""
        return self.reserved_decode_blocks + sum(blocks for _, blocks in self.started_decode)

    @property
    def unreported_decode_requests(self) -> int:
        return self.reserved_decode_requests + len(self.started_decode)

    def reported_at(self, sent: float) -> None:
        """A load report asked for at `sent` answered: it shows the requests started and the
        prompts sent before."""
        started = self.started_decode
        while started and started[0][0] <= sent:
            started.popleft()
        for key in [k for k, (when, _) in self.dispatches.items() if when <= sent]:
            del self.dispatches[key]

    @property
    def dispatched_prefill_tokens(self) -> int:
        """Prompt tokens this router sent to the worker that its last report may not show."""
        return sum(tokens for _, tokens in self.dispatches.values())

    def dispatch(self, tokens: int) -> int:
        """A prompt of `tokens` uncached tokens is sent to the worker: counted until its
        prefill call ends (`undispatch` with the key returned) or a later report shows it."""
        key = next(_DISPATCH_KEYS)
        self.dispatches[key] = (time.monotonic(), tokens)
        return key

    def undispatch(self, key: int) -> None:
        self.dispatches.pop(key, None)

    @property
    def queued_prefill_tokens(self) -> int:
        reported = self.load.engine.num_waiting_prefill_tokens if self.load else 0
        return reported + self.dispatched_prefill_tokens

    def mark_dead(self) -> None:
        """Its actor died (a call to it, or its token channel, failed with an actor death):
        out of placement now, until a load poll sent after this answers."""
        self.alive = False
        self.dead_at = time.monotonic()

    def close_channel(self, reason: str) -> None:
        if self.channel is not None:
            self.channel.close(reason)


class DecodeReservation:
    """Blocks counted on a decode worker between placement and the request's first chunk
    (`release` is idempotent)."""

    def __init__(self, entry: WorkerEntry | None, blocks: int) -> None:
        self._entry = entry
        self._blocks = blocks
        if entry is not None:
            entry.reserved_decode_blocks += blocks
            entry.reserved_decode_requests += 1

    def release(self) -> None:
        """The request will not run there (it failed or moved before its first chunk), or
        `started` came first."""
        if self._entry is not None:
            entry = self._entry
            entry.reserved_decode_blocks = max(entry.reserved_decode_blocks - self._blocks, 0)
            entry.reserved_decode_requests = max(entry.reserved_decode_requests - 1, 0)
            self._entry = None

    def started(self) -> None:
        """Its first chunk came: the worker runs it, and the next report asked for from now
        on shows it (`WorkerEntry.started_decode` counts it until then)."""
        entry = self._entry
        if entry is not None:
            self.release()
            entry.started_decode.append((time.monotonic(), self._blocks))


@dataclass(frozen=True)
class ClusterViewConfig:
    """How a router polls the workers (see the module docstring)."""

    poll_interval_s: float = 0.05
    """Seconds between load polls while requests arrive."""
    idle_poll_interval_s: float = 0.5
    """Seconds between load polls once no request arrived for `idle_after_s` (at least
    `poll_interval_s`)."""
    idle_after_s: float = 1.0
    """Seconds without a request after which polling slows to `idle_poll_interval_s`."""
    registry_interval_s: float = 1.0
    """Seconds between asks of the directory (the controller) for the worker list."""
    call_timeout_s: float = 2.0
    """Longest wait for one load poll or directory call."""
    failure_threshold: int = 3
    """Failed polls in a row after which a worker leaves placement."""


class ClusterView:
    def __init__(
        self,
        directory: WorkerDirectory,
        metrics: RouterMetrics | None = None,
        config: ClusterViewConfig | None = None,
    ) -> None:
        config = config or ClusterViewConfig()
        self.directory = directory
        self.metrics = metrics
        self.poll_interval_s = config.poll_interval_s
        self.idle_poll_interval_s = max(config.idle_poll_interval_s, config.poll_interval_s)
        self.idle_after_s = config.idle_after_s
        self._last_request = -float("inf")
        self._wake = asyncio.Event()
        self.registry_interval_s = config.registry_interval_s
        self.call_timeout_s = config.call_timeout_s
        self.failure_threshold = config.failure_threshold
        self.entries: dict[str, WorkerEntry] = {}
        self.router_id = uuid.uuid4().hex[:12]
        """Unique per view (per router): names this router's token channels on the workers."""
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh_registry()
        await self.poll_loads()
        self._tasks = [
            asyncio.create_task(self._every(self.registry_interval_s, self.refresh_registry)),
            asyncio.create_task(self._poll_loop()),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        for entry in self.entries.values():
            entry.close_channel("router stopping")
        for entry in self.entries.values():
            if entry.channel is not None:
                await entry.channel.wait_closed()

    async def _every(self, interval_s: float, fn: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await fn()
            except Exception:
                log.exception("cluster view refresh failed")

    def request_arrived(self) -> None:
        """A request arrived: poll at the busy rate (now, if the poller was idle)."""
        now = time.monotonic()
        if self._idle(now):
            self._wake.set()
        self._last_request = now

    def _idle(self, now: float) -> bool:
        return now - self._last_request > self.idle_after_s

    async def _poll_loop(self) -> None:
        while True:
            idle = self._idle(time.monotonic())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                interval = self.idle_poll_interval_s if idle else self.poll_interval_s
                await wait_within(self._wake.wait(), interval)
            try:
                await self.poll_loads()
            except Exception:
                log.exception("load poll failed")

    async def refresh_registry(self) -> None:
        try:
            listed = await wait_within(self.directory.list_workers(), self.call_timeout_s)
        except Exception as e:
            log.warning("worker directory unavailable: %s", e)
            return
        seen = set()
        for info, handle in listed:
            seen.add(info.worker_id)
            entry = self.entries.get(info.worker_id)
            if entry is None or entry.handle != handle:
                if entry is not None:
                    entry.close_channel(f"decode worker {info.worker_id} was replaced")
                self.entries[info.worker_id] = WorkerEntry(info, handle)
            elif entry.info.role is not info.role and (
                entry.load is None or entry.load.role is info.role
            ):  # (a listing older than the worker's own report of a switch is not news)
                self._switched(entry, info.role)
        for wid in set(self.entries) - seen:
            gone = self.entries.pop(wid)
            gone.close_channel(f"decode worker {wid} left the cluster")
            if self.metrics is not None:
                self.metrics.forget_worker(wid, gone.info.role.value)

    async def poll_loads(self) -> None:
        entries = list(self.entries.values())
        if not entries:
            return
        sent = time.monotonic()
        results = await asyncio.gather(
            *(wait_within(e.handle.load.remote(), self.call_timeout_s) for e in entries),
            return_exceptions=True,
        )
        for entry, result in zip(entries, results, strict=True):
            if entry.dead_at >= sent:
                continue  # seen dead while this poll was out: its answer predates the death
            if isinstance(result, BaseException):
                entry.failures += 1
                if entry.failures >= self.failure_threshold and entry.alive:
                    log.warning("worker %s stopped answering: %s", entry.worker_id, result)
                    entry.alive = False
                continue
            entry.failures = 0
            entry.alive = True
            if result.role is not entry.info.role:  # it switched role, before the registry said
                self._switched(entry, result.role)
            entry.load = result
            entry.reported_at(sent)
            if self.metrics is not None:
                self.metrics.observe_load(result)
        self._changed.set()

    def _switched(self, entry: WorkerEntry, role: WorkerRole) -> None:
        """The worker serves `role` now (a role switch: the same actor, engine and pool):
        placement takes it as that role, its latency figures start afresh, and a worker that
        no longer decodes loses this router's token channel (its streams ended before the
        switch: it drained them)."""
        log.info("worker %s switched from %s to %s", entry.worker_id, entry.info.role.value,
                 role.value)  # fmt: skip
        if not role.decodes:
            entry.close_channel(f"worker {entry.worker_id} switched to {role.value}")
            entry.channel = None
        if self.metrics is not None:  # its TTFT/TPOT of the old role are not the new one's
            self.metrics.forget_worker(entry.worker_id, entry.info.role.value)
        entry.info = replace(entry.info, role=role)

    def mark_dead(self, worker_id: str) -> None:
        entry = self.entries.get(worker_id)
        if entry is not None:
            entry.mark_dead()

    def avoid(self, worker_id: str, for_s: float) -> None:
        """Keep new requests off a worker for `for_s` (it missed a stage deadline)."""
        entry = self.entries.get(worker_id)
        if entry is not None:
            entry.avoid_until = max(entry.avoid_until, time.monotonic() + for_s)

    def reserve_decode(self, worker_id: str, blocks: int) -> DecodeReservation:
        """Count a request placed on a decode worker until its load reports show it."""
        return DecodeReservation(self.entries.get(worker_id), blocks)

    def decode_channel(self, entry: WorkerEntry) -> DecodeChannel:
        """This router's token channel to a decode worker (opened on first use)."""
        if entry.channel is None:
            # An actor death the channel sees kills this entry, not a later replacement.
            entry.channel = DecodeChannel(
                entry.worker_id, entry.handle, self.router_id, entry.mark_dead
            )
        return entry.channel

    async def wait_changed(self, timeout_s: float) -> None:
        """Wait until the next load poll (or `timeout_s`)."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await wait_within(self._changed.wait(), timeout_s)

    # ---- views ------------------------------------------------------------------------------

    def serving(self, *roles: WorkerRole) -> list[WorkerEntry]:
        return [e for e in self.entries.values() if e.info.role in roles and e.serving]

    def prefill_workers(self) -> list[WorkerEntry]:
        return self.serving(WorkerRole.PREFILL)

    def decode_workers(self) -> list[WorkerEntry]:
        return self.serving(WorkerRole.DECODE, WorkerRole.COLOCATED, WorkerRole.SPLIT)

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self.entries.get(worker_id)

    def block_size(self) -> int:
        for e in self.entries.values():
            return e.info.block_size
        return 16

    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters some live worker has registered."""
        return frozenset(
            name
            for e in self.entries.values()
            if e.alive and e.load is not None
            for name in e.load.loras
        )

    def serves_lora(self, lora: str) -> bool:
        """Some live worker has the adapter registered (placement then picks among those
        that serve it)."""
        return any(
            e.alive and e.load is not None and lora in e.load.loras for e in self.entries.values()
        )

    def prefill_candidates(
        self, match: PrefixMatch, lora: str = "", exclude: frozenset[str] = frozenset()
    ) -> list[PrefillCandidate]:
        """Serving prefill workers not in `exclude` (and, for a LoRA request, with `lora`
        registered)."""
        return [
            PrefillCandidate(
                e.worker_id,
                match.blocks_cached(e.worker_id),
                e.queued_prefill_tokens,
                match.host_blocks(e.worker_id),
                cold_lora=_cold(e, lora),
            )
            for e in self.prefill_workers()
            if e.worker_id not in exclude and _registers(e, lora)
        ]

    def decode_candidates(
        self, match: PrefixMatch, lora: str = "", exclude: frozenset[str] = frozenset()
    ) -> list[DecodeCandidate]:
        """As `prefill_candidates`, for the decode role."""
        out = []
        for e in self.decode_workers():
            if e.worker_id in exclude or e.load is None or not _registers(e, lora):
                continue
            eng = e.load.engine
            out.append(
                DecodeCandidate(
                    e.worker_id,
                    cached_blocks=match.blocks_cached(e.worker_id),
                    active_kv_blocks=eng.num_total_blocks
                    - eng.num_free_blocks
                    + e.unreported_decode_blocks,
                    inflight_transfer_blocks=e.load.transfer.pending_blocks,
                    free_kv_blocks=eng.num_free_blocks,
                    cold_lora=_cold(e, lora),
                    prefills_locally=e.info.role is WorkerRole.SPLIT,
                    running_requests=eng.num_running + e.unreported_decode_requests,
                    queued_prefill_tokens=e.queued_prefill_tokens,
                )
            )
        return out

    def admission_snapshot(
        self, throughput: Callable[[str], float], router_inflight: int
    ) -> ClusterSnapshot:
        prefill = tuple(
            PrefillWorkerLoad(e.worker_id, e.queued_prefill_tokens, throughput(e.worker_id))
            for e in self.prefill_workers()
        )
        decode = []
        budget = 1
        for e in self.decode_workers():
            assert e.load is not None
            eng = e.load.engine
            decode.append(
                DecodeWorkerLoad(
                    e.worker_id,
                    total_blocks=eng.num_total_blocks,
                    free_blocks=eng.num_free_blocks,
                    inflight_transfer_blocks=e.load.transfer.pending_blocks,
                )
            )
            budget = max(budget, e.load.transfer.max_inflight_blocks)
        return ClusterSnapshot(
            prefill_workers=prefill,
            decode_workers=tuple(decode),
            transfer_budget_blocks=budget,
            router_inflight_requests=router_inflight,
            block_size=self.block_size(),
        )


def _registers(entry: WorkerEntry, lora: str) -> bool:
    return not lora or (entry.load is not None and lora in entry.load.loras)


def _cold(entry: WorkerEntry, lora: str) -> bool:
    """A LoRA request's adapter is not in the worker's adapter cache (a disk read first)."""
    return bool(lora) and entry.load is not None and lora not in entry.load.engine.loras
