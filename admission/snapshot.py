"""What the admission policy looks at: the request, the cluster's load, and its own commitments.

All values are frozen and validated on construction, so the policy never has to guard against a
negative block count or a zero throughput.

Contract of the decode fields (the router builds them from worker load reports):

- `free_blocks` are blocks a new request could get now, evictable prefix-cache blocks included;
- `reserved_blocks` are blocks the worker has promised but not yet allocated (the growth of its
  running requests up to their max_tokens, handoffs it accepted but has not allocated for);
- `inflight_transfer_blocks` are blocks being pulled from prefill workers right now.

A worker's committed blocks are therefore `total - free + reserved`. The controller's own
reservations (requests it admitted; `AdmissionLedger.reserved_blocks`) are a separate account,
kept because worker reports lag behind admissions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vocabulary.numeric import cdiv


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


@dataclass(frozen=True)
class AdmissionRequest:
    """One request as admission sees it (the router has validated and hashed it already)."""

    request_id: str
    prompt_tokens: int
    """Prompt length in tokens."""
    uncached_prompt_tokens: int
    """Prompt tokens no worker holds in its prefix cache (the router's Redis lookup); the part
    that prefill must compute and decode must pull."""
    max_tokens: int
    tenant: str = ""
    priority: int = 0
    """Higher is more important, in [-10, 10]."""
    deadline_ms: float | None = None
    """Milliseconds left until the caller's deadline when the request arrived; None: none."""

    def __post_init__(self) -> None:
        _check(self.prompt_tokens >= 1, f"prompt_tokens: must be >= 1, got {self.prompt_tokens}")
        _check(
            0 <= self.uncached_prompt_tokens <= self.prompt_tokens,
            "uncached_prompt_tokens: must be in [0, prompt_tokens], "
            f"got {self.uncached_prompt_tokens}",
        )
        _check(self.max_tokens >= 1, f"max_tokens: must be >= 1, got {self.max_tokens}")
        _check(-10 <= self.priority <= 10, f"priority: must be in [-10, 10], got {self.priority}")

    @property
    def charged_tokens(self) -> int:
        """Tokens a tenant's rate limit is charged at admission (the worst case)."""
        return self.prompt_tokens + self.max_tokens

    def kv_blocks(self, block_size: int) -> int:
        """Decode KV blocks this request may hold at its longest (prompt + max_tokens)."""
        return cdiv(self.prompt_tokens + self.max_tokens, block_size)

    def transfer_blocks(self, block_size: int) -> int:
        """KV blocks decode must pull from prefill (the uncached part of the prompt)."""
        return cdiv(self.uncached_prompt_tokens, block_size)


@dataclass(frozen=True)
class PrefillWorkerLoad:
    worker_id: str
    queued_prefill_tokens: int
    """Prompt tokens waiting or running on the worker, not yet prefilled."""
    throughput_tokens_per_s: float
    """Learned prefill throughput (`PrefillThroughputEstimator.tokens_per_s`)."""
    live: bool = True
    """False for dead or draining workers: they take no new work."""

    def __post_init__(self) -> None:
        _check(self.queued_prefill_tokens >= 0, "queued_prefill_tokens: must be >= 0")
        _check(self.throughput_tokens_per_s > 0, "throughput_tokens_per_s: must be > 0")

    def estimated_ttft_ms(self, new_tokens: int) -> float:
        """Time until `new_tokens` more would be prefilled behind this worker's queue."""
        return (self.queued_prefill_tokens + new_tokens) / self.throughput_tokens_per_s * 1000.0


@dataclass(frozen=True)
class DecodeWorkerLoad:
    worker_id: str
    total_blocks: int
    free_blocks: int
    reserved_blocks: int = 0
    inflight_transfer_blocks: int = 0
    live: bool = True
    """False for dead or draining workers: they take no new work."""

    def __post_init__(self) -> None:
        _check(self.total_blocks >= 0, "total_blocks: must be >= 0")
        _check(0 <= self.free_blocks <= self.total_blocks, "free_blocks: must be in [0, total]")
        _check(self.reserved_blocks >= 0, "reserved_blocks: must be >= 0")
        _check(self.inflight_transfer_blocks >= 0, "inflight_transfer_blocks: must be >= 0")

    def headroom_blocks(self, utilization: float) -> int:
        """Blocks a new request may still take without passing `utilization` of the pool."""
        committed = self.total_blocks - self.free_blocks + self.reserved_blocks
        return math.floor(self.total_blocks * utilization) - committed


@dataclass(frozen=True)
class ClusterSnapshot:
    """Load of every worker at one instant, as the router knows it."""

    prefill_workers: tuple[PrefillWorkerLoad, ...]
    decode_workers: tuple[DecodeWorkerLoad, ...]
    transfer_budget_blocks: int
    """In-flight KV-transfer budget of one decode worker's transfer manager, in blocks."""
    router_inflight_requests: int
    """Requests the router is serving (admitted, not finished)."""
    block_size: int
    """Tokens per KV block."""

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, "block_size: must be >= 1")
        _check(self.transfer_budget_blocks >= 1, "transfer_budget_blocks: must be >= 1")
        _check(self.router_inflight_requests >= 0, "router_inflight_requests: must be >= 0")

    @property
    def live_prefill(self) -> tuple[PrefillWorkerLoad, ...]:
        return tuple(w for w in self.prefill_workers if w.live)

    @property
    def live_decode(self) -> tuple[DecodeWorkerLoad, ...]:
        return tuple(w for w in self.decode_workers if w.live)


@dataclass(frozen=True)
class AdmissionLedger:
    """What the admission controller has committed that worker reports may not show yet."""

    reserved_blocks: int = 0
    """Decode KV blocks reserved by admitted, unfinished requests (their worst case)."""
    admitted_requests: int = 0
    """Requests admitted and not yet released."""
    waiting_requests: int = 0
    """Requests in the admission queue (excluding the one being evaluated)."""
    waiting_ahead: int = 0
    """Queued requests that would be served before this one (higher or equal priority, earlier):
    a new request queues behind them rather than overtake."""


@dataclass(frozen=True)
class TenantAllowance:
    """A tenant's limits at the instant of the decision (None: that limit does not apply)."""

    available_tokens: float = math.inf
    """Tokens in the bucket now (negative while repaying an oversized request)."""
    tokens_per_s: float | None = None
    burst_tokens: float | None = None
    inflight_requests: int = 0
    """The tenant's requests admitted and not finished (on this router)."""
    max_inflight_requests: int | None = None


EMPTY_LEDGER = AdmissionLedger()
