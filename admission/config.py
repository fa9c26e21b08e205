"""Admission configuration: the run-time thresholds (mirrors the Admin API) and the static tuning.

`AdmissionThresholds` has exactly the fields of `pdserve.v1.AdmissionThresholds`, with the same
names and units, so the admin service maps one to the other field by field. Everything else the
policy needs (priority scaling, queue bound, retry-after hints, tenant limits, the throughput
prior) is static and lives in `AdmissionConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace


class InvalidAdmissionConfig(ValueError):
    """A threshold or config field is out of its documented range (the message names it)."""


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidAdmissionConfig(f"{name}: must be {rule}, got {value!r}")


@dataclass(frozen=True)
class AdmissionThresholds:
    """Limits that operators change at run time (`Admin.SetThresholds`)."""

    max_estimated_ttft_ms: float = 2000.0
    """Reject (or queue) a request whose estimated TTFT would exceed this, in ms."""
    max_queue_wait_ms: float = 1000.0
    """Longest a request may wait in the admission queue before RESOURCE_EXHAUSTED, in ms.
    0 disables queueing: every overload is rejected at once."""
    max_inflight_requests: int = 256
    """Most requests admitted but not finished, per router."""
    max_decode_kv_utilization: float = 0.95
    """Fraction of decode KV blocks that admission may reserve, in (0, 1]."""
    local_prefill_threshold_tokens: int = 64
    """Uncached prompt tokens at or below which the decode worker prefills locally."""

    def __post_init__(self) -> None:
        _require(
            self.max_estimated_ttft_ms > 0,
            "max_estimated_ttft_ms",
            "> 0",
            self.max_estimated_ttft_ms,
        )
        _require(self.max_queue_wait_ms >= 0, "max_queue_wait_ms", ">= 0", self.max_queue_wait_ms)
        _require(
            self.max_inflight_requests >= 1,
            "max_inflight_requests",
            ">= 1",
            self.max_inflight_requests,
        )
        _require(
            0.0 < self.max_decode_kv_utilization <= 1.0,
            "max_decode_kv_utilization",
            "in (0, 1]",
            self.max_decode_kv_utilization,
        )
        _require(
            self.local_prefill_threshold_tokens >= 0,
            "local_prefill_threshold_tokens",
            ">= 0",
            self.local_prefill_threshold_tokens,
        )

    def with_changes(self, **changes: float) -> AdmissionThresholds:
        """A copy with the given fields replaced (validated; 0 is a value like any other).

        These are the semantics of `Admin.SetThresholds`: the fields present in the request
        replace the current ones, absent fields keep theirs.
        """
        unknown = set(changes) - set(THRESHOLD_FIELDS)
        if unknown:
            raise InvalidAdmissionConfig(f"unknown threshold fields: {sorted(unknown)}")
        return replace(self, **changes)  # type: ignore[arg-type]


THRESHOLD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(AdmissionThresholds))
"""Field names shared with the proto message `pdserve.v1.AdmissionThresholds`, in proto order."""


@dataclass(frozen=True)
class TenantLimit:
    """What one tenant may take: a token rate (prompt + max_tokens are charged per request)
    and requests in flight. A limit left unset (None) does not apply; one must be set."""

    tenant: str
    """Tenant name: the one its API key maps to (or `GenerateRequest.tenant` with keys off;
    "" is the default tenant)."""
    tokens_per_s: float | None = None
    """Sustained rate the tenant's token bucket refills at (with `burst_tokens`)."""
    burst_tokens: float | None = None
    """Bucket capacity: the most tokens a tenant may spend at once after being idle."""
    max_inflight_requests: int | None = None
    """Requests of the tenant admitted and not finished, per router; one more is rejected
    (RESOURCE_EXHAUSTED) while other tenants are served."""

    def __post_init__(self) -> None:
        if (self.tokens_per_s is None) != (self.burst_tokens is None):
            given, missing = ("tokens_per_s", "burst_tokens")
            if self.tokens_per_s is None:
                given, missing = missing, given
            raise InvalidAdmissionConfig(f"{missing}: must be set with {given}")
        if self.tokens_per_s is None and self.max_inflight_requests is None:
            raise InvalidAdmissionConfig(
                "tokens_per_s: set a rate (tokens_per_s, burst_tokens), max_inflight_requests "
                "or both"
            )
        if self.tokens_per_s is not None and self.burst_tokens is not None:
            _require(self.tokens_per_s > 0, "tokens_per_s", "> 0", self.tokens_per_s)
            _require(self.burst_tokens > 0, "burst_tokens", "> 0", self.burst_tokens)
        if self.max_inflight_requests is not None:
            _require(
                self.max_inflight_requests >= 1,
                "max_inflight_requests",
                ">= 1",
                self.max_inflight_requests,
            )

    @property
    def has_rate(self) -> bool:
        return self.tokens_per_s is not None


@dataclass(frozen=True)
class PolicyTuning:
    """Static knobs of the pure policy (not exposed through the admin API)."""

    priority_step: float = 0.05
    """A priority-p request sees every limit multiplied by 1 + p * priority_step (p in
    [-10, 10]): low priorities are shed first, high ones may use the headroom. The KV
    utilization limit is capped at 1."""
    max_waiting_requests: int = 1024
    """Admission queue bound; a request that would queue beyond it is rejected (QUEUE_FULL)."""
    default_retry_after_ms: float = 1000.0
    """retry-after hint when the time until capacity frees is unknown (KV, in-flight, queue)."""
    min_retry_after_ms: float = 50.0
    """Floor of every retry-after hint."""
    max_retry_after_ms: float = 30_000.0
    """Ceiling of every retry-after hint."""

    def __post_init__(self) -> None:
        _require(0 <= self.priority_step < 0.1, "priority_step", "in [0, 0.1)", self.priority_step)
        _require(
            self.max_waiting_requests >= 0,
            "max_waiting_requests",
            ">= 0",
            self.max_waiting_requests,
        )
        _require(
            0 < self.min_retry_after_ms <= self.max_retry_after_ms,
            "min_retry_after_ms",
            "in (0, max_retry_after_ms]",
            self.min_retry_after_ms,
        )

    def clamp_retry_after(self, ms: float) -> float:
        if math.isnan(ms):
            return self.default_retry_after_ms
        return min(self.max_retry_after_ms, max(self.min_retry_after_ms, ms))


@dataclass(frozen=True)
class AdmissionConfig:
    """Everything the admission controller is built from (one per router)."""

    thresholds: AdmissionThresholds = field(default_factory=AdmissionThresholds)
    """Initial run-time thresholds; `AdmissionController.set_thresholds` replaces them."""
    tuning: PolicyTuning = field(default_factory=PolicyTuning)
    """Static policy knobs."""
    tenant_limits: tuple[TenantLimit, ...] = ()
    """Per-tenant limits (token rate, requests in flight); tenants not listed get
    `default_tenant_limit`."""
    default_tenant_limit: TenantLimit | None = None
    """Limit applied to every unlisted tenant (its `tenant` name is ignored); None: unlimited."""
    max_tracked_tenants: int = 10000
    """Most tenant buckets kept at once (only buckets that are not full take memory); past
    it the fullest one is forgotten, so a flood of tenant names cannot grow the tables."""
    recheck_interval_ms: float = 20.0
    """How often queued requests re-evaluate the snapshot when no release or threshold change
    woke them (the snapshot also changes as prefill queues drain)."""
    prior_prefill_tokens_per_s: float = 10_000.0
    """Prefill throughput assumed for a worker before any prefill was observed on it."""
    throughput_ewma_alpha: float = 0.2
    """Weight of the newest observation in the prefill-throughput EWMA, in (0, 1]."""

    def __post_init__(self) -> None:
        _require(
            self.recheck_interval_ms > 0, "recheck_interval_ms", "> 0", self.recheck_interval_ms
        )
        _require(
            self.prior_prefill_tokens_per_s > 0,
            "prior_prefill_tokens_per_s",
            "> 0",
            self.prior_prefill_tokens_per_s,
        )
        _require(
            0 < self.throughput_ewma_alpha <= 1,
            "throughput_ewma_alpha",
            "in (0, 1]",
            self.throughput_ewma_alpha,
        )
        names = [limit.tenant for limit in self.tenant_limits]
        _require(len(names) == len(set(names)), "tenant_limits", "unique per tenant", names)
