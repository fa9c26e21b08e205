"""Per-tenant token-rate limits: token buckets with a pure core and an injectable clock.

(A tenant's in-flight limit, the other half of `TenantLimit`, is counted by the admission
controller, which knows what it admitted.)

A tenant's bucket holds up to `burst_tokens` and refills at `tokens_per_s`. Admission charges
prompt + max_tokens when it admits a request and may refund the unused part when the request
finishes. A request larger than the bucket is admitted from a full bucket and leaves it in debt
(negative), so large requests are possible but the long-run rate still holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from admission.config import TenantLimit
from admission.snapshot import TenantAllowance

Clock = Callable[[], float]


@dataclass(frozen=True)
class BucketState:
    level: float
    """Tokens available (negative while in debt)."""
    updated_at: float
    """Clock reading (s) the level is valid at."""


def refilled(state: BucketState, limit: TenantLimit, now: float) -> BucketState:
    """The bucket at `now`: refilled for the elapsed time, capped at the burst size."""
    assert limit.tokens_per_s is not None and limit.burst_tokens is not None
    elapsed = max(0.0, now - state.updated_at)
    level = min(limit.burst_tokens, state.level + elapsed * limit.tokens_per_s)
    return BucketState(level=level, updated_at=max(now, state.updated_at))


def charged(state: BucketState, tokens: float, limit: TenantLimit) -> BucketState:
    """The bucket after `tokens` are taken (negative) or refunded (positive tokens < 0)."""
    assert limit.burst_tokens is not None
    return BucketState(
        level=min(limit.burst_tokens, state.level - tokens), updated_at=state.updated_at
    )


class TenantRateLimiter:
    """Token buckets for every tenant that has a rate limit; full buckets are forgotten."""

    def __init__(
        self,
        limits: Iterable[TenantLimit] = (),
        default: TenantLimit | None = None,
        clock: Clock = time.monotonic,
        max_tracked: int = 10000,
    ) -> None:
        self._limits = {limit.tenant: limit for limit in limits}
        self._default = default
        self._clock = clock
        self._buckets: dict[str, BucketState] = {}
        self.max_tracked = max(1, max_tracked)

    def limit_for(self, tenant: str) -> TenantLimit | None:
        """The tenant's limits (rate, in flight), or None when it has none."""
        return self._limits.get(tenant, self._default)

    def _rate_limit(self, tenant: str) -> TenantLimit | None:
        limit = self.limit_for(tenant)
        return limit if limit is not None and limit.has_rate else None

    def allowance(self, tenant: str, inflight_requests: int = 0) -> TenantAllowance | None:
        """The tenant's bucket now and its in-flight limit (with the `inflight_requests` it
        has now), or None when the tenant has no limit."""
        limit = self.limit_for(tenant)
        if limit is None:
            return None
        if not limit.has_rate:
            return TenantAllowance(
                inflight_requests=inflight_requests,
                max_inflight_requests=limit.max_inflight_requests,
            )
        state = self._state(tenant, limit)
        return TenantAllowance(
            available_tokens=state.level,
            tokens_per_s=limit.tokens_per_s,
            burst_tokens=limit.burst_tokens,
            inflight_requests=inflight_requests,
            max_inflight_requests=limit.max_inflight_requests,
        )

    def charge(self, tenant: str, tokens: float) -> None:
        """Take `tokens` from the tenant's bucket (no-op for tenants without a rate)."""
        limit = self._rate_limit(tenant)
        if limit is None:
            return
        self._store(tenant, limit, charged(self._state(tenant, limit), tokens, limit))

    def refund(self, tenant: str, tokens: float) -> None:
        """Give back tokens charged but not used (capped at the burst size)."""
        if tokens > 0:
            self.charge(tenant, -tokens)

    def _state(self, tenant: str, limit: TenantLimit) -> BucketState:
        now = self._clock()
        assert limit.burst_tokens is not None
        state = self._buckets.get(tenant, BucketState(limit.burst_tokens, now))
        state = refilled(state, limit, now)
        self._store(tenant, limit, state)
        return state

    def _store(self, tenant: str, limit: TenantLimit, state: BucketState) -> None:
        assert limit.burst_tokens is not None
        if state.level >= limit.burst_tokens:
            self._buckets.pop(tenant, None)  # a full bucket is the same as a fresh one
        else:
            if tenant not in self._buckets and len(self._buckets) >= self.max_tracked:
                # Forget the fullest bucket: the one closest to the fresh state it returns to.
                fullest = max(self._buckets, key=lambda t: self._buckets[t].level)
                del self._buckets[fullest]
            self._buckets[tenant] = state

    @property
    def num_tracked_tenants(self) -> int:
        """Tenants whose bucket is not full (the rest take no memory)."""
        return len(self._buckets)
