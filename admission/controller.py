"""The admission controller: applies the pure policy on the router's event loop.

Lifecycle of one request in the controller:

    admit() ──ADMIT──────────────────────────────► ADMITTED ──release()──► (gone: None)
       │                                              ▲
       ├──QUEUE──► QUEUED ──re-evaluated: ADMIT───────┘
       │             ├── re-evaluated: REJECT ──────► REJECTED (AdmissionRejected)
       │             ├── bounded wait ran out ──────► REJECTED (Reason.QUEUE_TIMEOUT)
       │             └── caller cancelled ──────────► (gone; nothing reserved)
       └──REJECT─────────────────────────────────────► REJECTED (AdmissionRejected)

Queued requests are re-evaluated in priority, then FCFS order (strictly: the head blocks the
rest) whenever a release or a threshold change may have freed capacity, and every
`recheck_interval_ms` while they wait, because prefill queues also drain without telling us.
Admitting reserves the request's worst-case decode KV blocks and charges its tenant; `release`
gives both back. Nothing here ever waits longer than the bounded wait.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from admission.config import AdmissionConfig, AdmissionThresholds
from admission.decision import (
    Admission,
    AdmissionRejected,
    Decision,
    DecisionKind,
    DuplicateRequestId,
    Reason,
)
from admission.policy import evaluate
from admission.rate_limit import Clock, TenantRateLimiter
from admission.snapshot import AdmissionLedger, AdmissionRequest, ClusterSnapshot
from admission.throughput import PrefillThroughputEstimator


class RequestState(enum.Enum):
    """Where a request the controller still tracks is (finished ones are forgotten: None)."""

    QUEUED = "queued"  # waiting for capacity, bounded by its max wait
    ADMITTED = "admitted"  # holds a reservation until release()


SnapshotProvider = Callable[[], ClusterSnapshot]
"""Returns the router's current view of cluster load. Called on the event loop, often: it must
be cheap and must not block (build it from in-memory load reports)."""


@dataclass(frozen=True)
class AdmissionStats:
    """Counters for metrics and `pdserve status`."""

    admitted_now: int
    waiting_now: int
    reserved_blocks: int
    admitted_total: int
    queued_total: int
    rejected_total: dict[Reason, int]


@dataclass(frozen=True)
class _Reservation:
    tenant: str
    blocks: int
    charged_tokens: int
    max_tokens: int


@dataclass(eq=False)
class _Waiter:
    request: AdmissionRequest
    provider: SnapshotProvider
    order: tuple[int, int]  # (-priority, arrival sequence): queue order
    enqueued_at: float
    expires_at: float
    future: asyncio.Future[Admission]
    last_decision: Decision = field(repr=False)


class AdmissionController:
    """Admits, queues or rejects requests; one per router, used from its event loop only."""

    def __init__(
        self,
        config: AdmissionConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        throughput: PrefillThroughputEstimator | None = None,
    ) -> None:
        self._config = config or AdmissionConfig()
        self._thresholds = self._config.thresholds
        self._clock = clock
        self.limiter = TenantRateLimiter(
            self._config.tenant_limits,
            self._config.default_tenant_limit,
            clock,
            max_tracked=self._config.max_tracked_tenants,
        )
        self.throughput = throughput or PrefillThroughputEstimator(
            self._config.prior_prefill_tokens_per_s, self._config.throughput_ewma_alpha
        )
        """The router feeds finished prefills here and reads it when building snapshots."""
        self._admitted: dict[str, _Reservation] = {}
        self._tenant_inflight: Counter[str] = Counter()
        """Admitted, unreleased requests per tenant (what `max_inflight_requests` limits)."""
        self._reserved_blocks = 0
        self._waiting: list[_Waiter] = []
        self._waiting_ids: set[str] = set()
        self._seq = 0
        self._admitted_total = 0
        self._queued_total = 0
        self._rejected: Counter[Reason] = Counter()

    # -- thresholds ---------------------------------------------------------------------------

    @property
    def thresholds(self) -> AdmissionThresholds:
        return self._thresholds

    def set_thresholds(self, thresholds: AdmissionThresholds) -> AdmissionThresholds:
        """Replace the thresholds; queued requests are re-evaluated against them at once."""
        self._thresholds = thresholds
        self._dispatch()
        return thresholds

    # -- the request path ---------------------------------------------------------------------

    async def admit(
        self, request: AdmissionRequest, snapshot_provider: SnapshotProvider
    ) -> Admission:
        """Return once `request` is admitted (its KV blocks reserved), or raise AdmissionRejected.

        Raises at once when the policy rejects, or when a queued request's bounded wait runs
        out. If the caller is cancelled while queued, nothing stays reserved.
        """
        rid = request.request_id
        if rid in self._admitted or rid in self._waiting_ids:
            raise DuplicateRequestId(f"request_id: {rid!r} is already admitted or queued")
        ahead = sum(1 for w in self._waiting if -w.order[0] >= request.priority)
        decision = self._evaluate(request, snapshot_provider(), waiting_ahead=ahead)
        if decision.kind is DecisionKind.ADMIT:
            return self._grant(request, decision, queued_ms=0.0)
        if decision.kind is DecisionKind.REJECT:
            raise self._rejection(decision)

        loop = asyncio.get_running_loop()
        now = loop.time()
        self._seq += 1
        waiter = _Waiter(
            request=request,
            provider=snapshot_provider,
            order=(-request.priority, self._seq),
            enqueued_at=now,
            expires_at=now + decision.max_wait_ms / 1000.0,
            future=loop.create_future(),
            last_decision=decision,
        )
        bisect.insort(self._waiting, waiter, key=lambda w: w.order)
        self._waiting_ids.add(rid)
        self._queued_total += 1
        return await self._wait(waiter)

    def release(self, request_id: str, *, generated_tokens: int | None = None) -> bool:
        """Free an admitted request's reservation (finish, abort or failure); wakes the queue.

        With `generated_tokens`, the tenant is refunded the max_tokens it did not use.
        Returns False for an unknown (or already released) id: releasing twice is harmless.
        """
        reservation = self._admitted.pop(request_id, None)
        if reservation is None:
            return False
        self._tenant_inflight[reservation.tenant] -= 1
        if self._tenant_inflight[reservation.tenant] <= 0:
            del self._tenant_inflight[reservation.tenant]
        self._reserved_blocks -= reservation.blocks
        if generated_tokens is not None:
            unused = max(0, reservation.max_tokens - generated_tokens)
            self.limiter.refund(reservation.tenant, unused)
        self._dispatch()
        return True

    def state(self, request_id: str) -> RequestState | None:
        """QUEUED, ADMITTED, or None (never seen, released, rejected, timed out, cancelled)."""
        if request_id in self._admitted:
            return RequestState.ADMITTED
        if request_id in self._waiting_ids:
            return RequestState.QUEUED
        return None

    def tenant_inflight(self, tenant: str) -> int:
        """The tenant's requests admitted and not yet released."""
        return self._tenant_inflight.get(tenant, 0)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            admitted_now=len(self._admitted),
            waiting_now=len(self._waiting),
            reserved_blocks=self._reserved_blocks,
            admitted_total=self._admitted_total,
            queued_total=self._queued_total,
            rejected_total=dict(self._rejected),
        )

    # -- internals ----------------------------------------------------------------------------

    async def _wait(self, waiter: _Waiter) -> Admission:
        loop = asyncio.get_running_loop()
        recheck_s = self._config.recheck_interval_ms / 1000.0
        try:
            while not waiter.future.done():
                remaining = waiter.expires_at - loop.time()
                if remaining <= 0:
                    break
                await asyncio.wait({waiter.future}, timeout=min(recheck_s, remaining))
                if not waiter.future.done():
                    self._dispatch()
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if waiter.future.done():
            return waiter.future.result()  # an Admission, or raises the AdmissionRejected
        self._remove(waiter)
        waiter.future.cancel()
        waited_ms = (loop.time() - waiter.enqueued_at) * 1000.0
        self._rejected[Reason.QUEUE_TIMEOUT] += 1
        self._dispatch()  # the head left: those behind it may go now
        raise AdmissionRejected(
            self._config.tuning.default_retry_after_ms,
            Reason.QUEUE_TIMEOUT,
            f"not admitted within {waited_ms:.0f} ms of queueing "
            f"(last: {waiter.last_decision.message})",
        )

    def _abandon(self, waiter: _Waiter) -> None:
        """The caller went away while queued: undo whatever happened meanwhile."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(waiter.request.request_id)  # admitted in the same instant
            return
        if not future.done():
            future.cancel()
        self._remove(waiter)
        self._dispatch()

    def _remove(self, waiter: _Waiter) -> None:
        if waiter in self._waiting:
            self._waiting.remove(waiter)
        self._waiting_ids.discard(waiter.request.request_id)

    def _dispatch(self) -> None:
        """Serve the queue head-first until one request must keep waiting."""
        loop_time: float | None = None
        while self._waiting:
            waiter = self._waiting[0]
            if waiter.future.done():
                self._remove(waiter)
                continue
            if loop_time is None:
                loop_time = asyncio.get_running_loop().time()
            queued_ms = (loop_time - waiter.enqueued_at) * 1000.0
            request = waiter.request
            if request.deadline_ms is not None:
                request = replace(request, deadline_ms=request.deadline_ms - queued_ms)
            try:
                decision = self._evaluate(request, waiter.provider(), waiting_ahead=0)
            except Exception as exc:  # a failing provider fails its own request, not release()
                self._remove(waiter)
                waiter.future.set_exception(exc)
                continue
            waiter.last_decision = decision
            if decision.kind is DecisionKind.QUEUE:
                return
            self._remove(waiter)
            if decision.kind is DecisionKind.ADMIT:
                waiter.future.set_result(self._grant(waiter.request, decision, queued_ms))
            else:
                waiter.future.set_exception(self._rejection(decision))

    def _evaluate(
        self, request: AdmissionRequest, snapshot: ClusterSnapshot, *, waiting_ahead: int
    ) -> Decision:
        queued_elsewhere = len(self._waiting) - (request.request_id in self._waiting_ids)
        ledger = AdmissionLedger(
            reserved_blocks=self._reserved_blocks,
            admitted_requests=len(self._admitted),
            waiting_requests=queued_elsewhere,
            waiting_ahead=waiting_ahead,
        )
        return evaluate(
            request,
            snapshot,
            self._thresholds,
            ledger=ledger,
            tenant=self.limiter.allowance(request.tenant, self._tenant_inflight[request.tenant]),
            tuning=self._config.tuning,
        )

    def _grant(self, request: AdmissionRequest, decision: Decision, queued_ms: float) -> Admission:
        charged = request.charged_tokens
        self._admitted[request.request_id] = _Reservation(
            tenant=request.tenant,
            blocks=decision.reserve_blocks,
            charged_tokens=charged,
            max_tokens=request.max_tokens,
        )
        self._tenant_inflight[request.tenant] += 1
        self._reserved_blocks += decision.reserve_blocks
        self.limiter.charge(request.tenant, charged)
        self._admitted_total += 1
        return Admission(
            request_id=request.request_id,
            reserved_blocks=decision.reserve_blocks,
            charged_tokens=charged,
            local_prefill=decision.local_prefill,
            estimated_ttft_ms=decision.estimated_ttft_ms,
            queued_ms=queued_ms,
        )

    def _rejection(self, decision: Decision) -> AdmissionRejected:
        self._rejected[decision.reason] += 1
        return AdmissionRejected(decision.retry_after_ms, decision.reason, decision.message)
