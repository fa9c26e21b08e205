"""The admission policy: one pure function from (request, snapshot, limits) to a `Decision`.

Order of the checks (the first that fails names the reason):

1. hard refusals, where waiting cannot help: no live decode worker, a request larger
   than any decode worker may hold, a deadline the estimated TTFT already misses;
2. the tenant's limits: requests in flight (rejected with the default retry-after) and token
   rate (rejected with the time until its bucket refills), each message naming the limit; a
   rejection, never a queue, so a tenant over its limits never blocks the queue's head;
3. overload: in-flight requests, decode KV (the controller's reservation budget and a worker with
   room), the KV-transfer budget, the estimated TTFT, and earlier queued requests;
4. on overload, QUEUE when the bounded wait could see it clear, REJECT with retry-after when not.

Priorities act twice: a priority-p request sees every limit scaled by 1 + p * priority_step
(low priorities are shed first), and the controller serves its queue by priority, then FCFS
(`AdmissionLedger.waiting_ahead` makes a newcomer queue behind them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from admission.config import AdmissionThresholds, PolicyTuning
from admission.decision import Decision, DecisionKind, Reason
from admission.snapshot import (
    EMPTY_LEDGER,
    AdmissionLedger,
    AdmissionRequest,
    ClusterSnapshot,
    TenantAllowance,
)

DEFAULT_TUNING = PolicyTuning()


@dataclass(frozen=True)
class ScaledLimits:
    """The thresholds as a request of one priority sees them."""

    max_ttft_ms: float
    max_queue_wait_ms: float
    max_inflight: int
    max_kv_utilization: float

    @classmethod
    def for_priority(
        cls, thresholds: AdmissionThresholds, priority: int, tuning: PolicyTuning
    ) -> ScaledLimits:
        scale = 1.0 + priority * tuning.priority_step
        return cls(
            max_ttft_ms=thresholds.max_estimated_ttft_ms * scale,
            max_queue_wait_ms=thresholds.max_queue_wait_ms * scale,
            max_inflight=max(1, math.floor(thresholds.max_inflight_requests * scale)),
            max_kv_utilization=min(1.0, thresholds.max_decode_kv_utilization * scale),
        )


@dataclass(frozen=True)
class _Blocker:
    reason: Reason
    message: str
    clears_in_ms: float | None = None  # known time until this limit clears, if any


def evaluate(
    request: AdmissionRequest,
    snapshot: ClusterSnapshot,
    thresholds: AdmissionThresholds,
    *,
    ledger: AdmissionLedger = EMPTY_LEDGER,
    tenant: TenantAllowance | None = None,
    tuning: PolicyTuning = DEFAULT_TUNING,
) -> Decision:
    """Decide whether `request` starts now, waits, or is refused. Pure: no clock, no I/O."""
    limits = ScaledLimits.for_priority(thresholds, request.priority, tuning)
    block_size = snapshot.block_size
    need = request.kv_blocks(block_size)
    decode = snapshot.live_decode
    prefill = snapshot.live_prefill
    # With no live prefill worker the decode worker prefills (degraded, not failed), as placement
    # does; its TTFT is then unknown here and not checked.
    local = request.uncached_prompt_tokens <= thresholds.local_prefill_threshold_tokens
    local = local or not prefill
    estimated_ttft_ms = 0.0

    def reject(reason: Reason, message: str, retry_after_ms: float | None) -> Decision:
        return Decision(
            kind=DecisionKind.REJECT,
            reason=reason,
            message=message,
            retry_after_ms=None
            if retry_after_ms is None
            else tuning.clamp_retry_after(retry_after_ms),
            reserve_blocks=need,
            estimated_ttft_ms=estimated_ttft_ms,
            local_prefill=local,
        )

    # 1. Hard refusals.
    if not decode:
        return reject(Reason.NO_LIVE_WORKER, "no live decode worker", tuning.default_retry_after_ms)
    largest = max(math.floor(w.total_blocks * limits.max_kv_utilization) for w in decode)
    if need > largest:
        return reject(
            Reason.REQUEST_TOO_LARGE,
            f"prompt_tokens + max_tokens = {request.prompt_tokens + request.max_tokens} tokens "
            f"need {need} KV blocks; the largest decode worker may hold {largest}",
            None,
        )
    if not local:
        estimated_ttft_ms = min(
            w.estimated_ttft_ms(request.uncached_prompt_tokens) for w in prefill
        )
    if request.deadline_ms is not None and estimated_ttft_ms >= request.deadline_ms:
        return reject(
            Reason.DEADLINE_UNREACHABLE,
            f"estimated TTFT {estimated_ttft_ms:.0f} ms is past the deadline "
            f"({request.deadline_ms:.0f} ms left)",
            None,
        )

    # 2. Tenant limits. An oversized request needs only a full bucket, then runs into debt.
    if tenant is not None:
        refusal = _tenant_refusal(request, tenant, tuning)
        if refusal is not None:
            reason, message, retry_ms = refusal
            return reject(reason, message, retry_ms)

    # 3. Overload.
    blockers = _overload(request, snapshot, limits, ledger, need, local, estimated_ttft_ms)
    if not blockers:
        return Decision(
            kind=DecisionKind.ADMIT,
            reason=Reason.ADMITTED,
            message="admitted",
            reserve_blocks=need,
            estimated_ttft_ms=estimated_ttft_ms,
            local_prefill=local,
        )

    # 4. Queue when the bounded wait could see the overload clear, else reject.
    message = "; ".join(b.message for b in blockers)
    known = [b.clears_in_ms for b in blockers if b.clears_in_ms is not None]
    retry_ms = max(known) if known else tuning.default_retry_after_ms
    max_wait_ms = limits.max_queue_wait_ms
    if request.deadline_ms is not None:
        max_wait_ms = min(max_wait_ms, request.deadline_ms - estimated_ttft_ms)
    if max_wait_ms <= 0:
        return reject(blockers[0].reason, message, retry_ms)
    too_slow = [b for b in blockers if b.clears_in_ms is not None and b.clears_in_ms > max_wait_ms]
    if too_slow:
        return reject(too_slow[0].reason, message, retry_ms)
    if ledger.waiting_requests >= tuning.max_waiting_requests:
        return reject(
            Reason.QUEUE_FULL,
            f"{message}; admission queue is full ({ledger.waiting_requests} waiting)",
            retry_ms,
        )
    return Decision(
        kind=DecisionKind.QUEUE,
        reason=blockers[0].reason,
        message=message,
        max_wait_ms=max_wait_ms,
        reserve_blocks=need,
        estimated_ttft_ms=estimated_ttft_ms,
        local_prefill=local,
    )


def _tenant_refusal(
    request: AdmissionRequest, tenant: TenantAllowance, tuning: PolicyTuning
) -> tuple[Reason, str, float] | None:
    """Why the tenant's own limits refuse `request` (reason, message, retry-after), if they do."""
    limit = tenant.max_inflight_requests
    if limit is not None and tenant.inflight_requests >= limit:
        return (
            Reason.TENANT_INFLIGHT_LIMIT,
            f"tenant {request.tenant!r} has {tenant.inflight_requests} requests in flight, its "
            f"limit (tenant_limits max_inflight_requests {limit}); retry when one finishes",
            tuning.default_retry_after_ms,
        )
    if tenant.tokens_per_s is None or tenant.burst_tokens is None:
        return None
    needed = min(float(request.charged_tokens), tenant.burst_tokens)
    if tenant.available_tokens >= needed:
        return None
    refill_ms = (needed - tenant.available_tokens) / tenant.tokens_per_s * 1000.0
    return (
        Reason.TENANT_RATE_LIMITED,
        f"tenant {request.tenant!r} is over its rate of {tenant.tokens_per_s:g} tokens/s "
        f"(tenant_limits tokens_per_s {tenant.tokens_per_s:g}, burst_tokens "
        f"{tenant.burst_tokens:g}): {tenant.available_tokens:.0f} of {needed:.0f} tokens "
        "available",
        refill_ms,
    )


def _overload(
    request: AdmissionRequest,
    snapshot: ClusterSnapshot,
    limits: ScaledLimits,
    ledger: AdmissionLedger,
    need: int,
    local: bool,
    estimated_ttft_ms: float,
) -> list[_Blocker]:
    """Every transient limit the request is over, in check order."""
    blockers: list[_Blocker] = []
    decode = snapshot.live_decode

    inflight = max(snapshot.router_inflight_requests, ledger.admitted_requests)
    if inflight >= limits.max_inflight:
        blockers.append(
            _Blocker(
                Reason.INFLIGHT_LIMIT,
                f"{inflight} requests in flight (limit {limits.max_inflight})",
            )
        )

    budget = math.floor(limits.max_kv_utilization * sum(w.total_blocks for w in decode))
    best_headroom = max(w.headroom_blocks(limits.max_kv_utilization) for w in decode)
    if ledger.reserved_blocks + need > budget:
        blockers.append(
            _Blocker(
                Reason.DECODE_KV_FULL,
                f"decode KV reservations {ledger.reserved_blocks} + {need} blocks exceed "
                f"{budget} ({limits.max_kv_utilization:.0%} of the live pool)",
            )
        )
    elif best_headroom < need:
        blockers.append(
            _Blocker(
                Reason.DECODE_KV_FULL,
                f"no decode worker has {need} free KV blocks under "
                f"{limits.max_kv_utilization:.0%} utilization (best has {max(best_headroom, 0)})",
            )
        )

    if not local:
        pull = request.transfer_blocks(snapshot.block_size)
        budget_blocks = snapshot.transfer_budget_blocks
        # As in the transfer manager: an oversized pull may start only when nothing is in flight.
        if not any(
            w.inflight_transfer_blocks == 0 or w.inflight_transfer_blocks + pull <= budget_blocks
            for w in decode
        ):
            least = min(w.inflight_transfer_blocks for w in decode)
            blockers.append(
                _Blocker(
                    Reason.TRANSFER_BUDGET,
                    f"KV transfer budget in use ({least} + {pull} blocks > {budget_blocks} "
                    "on every decode worker)",
                )
            )

    if estimated_ttft_ms > limits.max_ttft_ms:
        blockers.append(
            _Blocker(
                Reason.TTFT_OVER_BUDGET,
                f"estimated TTFT {estimated_ttft_ms:.0f} ms exceeds {limits.max_ttft_ms:.0f} ms",
                clears_in_ms=estimated_ttft_ms - limits.max_ttft_ms,
            )
        )

    if ledger.waiting_ahead > 0:
        blockers.append(
            _Blocker(Reason.WAITING_AHEAD, f"{ledger.waiting_ahead} queued requests go first")
        )
    return blockers
