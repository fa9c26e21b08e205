"""What admission answers: a `Decision` from the pure policy, an `Admission` ticket or an
`AdmissionRejected` error from the controller.

The router maps a rejection's `Reason` to its gRPC status, in one place (router/errors.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DecisionKind(enum.Enum):
    ADMIT = "admit"  # start now; the controller reserves `reserve_blocks`
    QUEUE = "queue"  # wait up to `max_wait_ms` for capacity, then re-evaluate
    REJECT = "reject"  # answer at once; retry after `retry_after_ms` (None: retrying won't help)


class Reason(enum.Enum):
    """Why a decision was taken; for QUEUE and REJECT the first limit that blocked."""

    ADMITTED = "admitted"
    NO_LIVE_WORKER = "no_live_worker"  # no live decode worker
    REQUEST_TOO_LARGE = "request_too_large"  # prompt + max_tokens exceed any worker's limit
    DEADLINE_UNREACHABLE = "deadline_unreachable"  # estimated TTFT is past the caller's deadline
    TENANT_RATE_LIMITED = "tenant_rate_limited"  # the tenant's token bucket is short
    TENANT_INFLIGHT_LIMIT = "tenant_inflight_limit"  # the tenant's max_inflight_requests
    INFLIGHT_LIMIT = "inflight_limit"  # max_inflight_requests reached
    DECODE_KV_FULL = "decode_kv_full"  # no decode worker (or the reservation budget) has room
    TRANSFER_BUDGET = "transfer_budget"  # every decode worker's transfer budget is in use
    TTFT_OVER_BUDGET = "ttft_over_budget"  # queued prefill work would push TTFT past the limit
    WAITING_AHEAD = "waiting_ahead"  # earlier or more important requests are queued
    QUEUE_FULL = "queue_full"  # overloaded and the admission queue is at its bound
    QUEUE_TIMEOUT = "queue_timeout"  # queued, and the bounded wait ran out (controller only)


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one request against one snapshot."""

    kind: DecisionKind
    reason: Reason
    message: str
    """One human sentence naming the limit and the numbers, fit for a gRPC status message."""
    retry_after_ms: float | None = None
    """REJECT only: when retrying may succeed; None when it will not."""
    max_wait_ms: float = 0.0
    """QUEUE only: longest the request may wait before it is rejected."""
    reserve_blocks: int = 0
    """Decode KV blocks to reserve on admission (prompt + max_tokens, worst case)."""
    estimated_ttft_ms: float = 0.0
    """Estimated TTFT on the best prefill worker (0 when prefilled locally)."""
    local_prefill: bool = False
    """The decode worker will prefill: the uncached prompt is at most the local-prefill
    threshold, or no prefill worker is live (degraded). A hint: placement decides per worker."""


@dataclass(frozen=True)
class Admission:
    """Ticket of an admitted request; hand `request_id` back to `AdmissionController.release`."""

    request_id: str
    reserved_blocks: int
    charged_tokens: int
    """Tokens charged to the tenant's rate limit."""
    local_prefill: bool
    estimated_ttft_ms: float
    queued_ms: float
    """Time spent in the admission queue (0 when admitted at once)."""


class AdmissionRejected(Exception):
    """The request was not admitted: the policy rejected it, or its bounded wait ran out."""

    def __init__(self, retry_after_ms: float | None, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        self.reason = reason
        self.message = message

    def __repr__(self) -> str:
        return (
            f"AdmissionRejected(retry_after_ms={self.retry_after_ms!r}, "
            f"reason={self.reason}, message={self.message!r})"
        )


class DuplicateRequestId(ValueError):
    """A request id is already admitted or queued in this controller."""
