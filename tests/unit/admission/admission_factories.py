"""Small factories for admission tests: a request and a cluster that admits it, by default."""

from __future__ import annotations

from admission.config import AdmissionThresholds
from admission.snapshot import (
    AdmissionRequest,
    ClusterSnapshot,
    DecodeWorkerLoad,
    PrefillWorkerLoad,
)

BLOCK_SIZE = 16

# Generous defaults: a 1000-token prompt on an idle 10k tok/s prefill estimates 100 ms TTFT.
THRESHOLDS = AdmissionThresholds(
    max_estimated_ttft_ms=1000.0,
    max_queue_wait_ms=500.0,
    max_inflight_requests=100,
    max_decode_kv_utilization=0.9,
    local_prefill_threshold_tokens=32,
)


def make_request(
    request_id: str = "r1",
    *,
    prompt_tokens: int = 1000,
    uncached: int | None = None,
    max_tokens: int = 200,
    tenant: str = "",
    priority: int = 0,
    deadline_ms: float | None = None,
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        uncached_prompt_tokens=prompt_tokens if uncached is None else uncached,
        max_tokens=max_tokens,
        tenant=tenant,
        priority=priority,
        deadline_ms=deadline_ms,
    )


def prefill(
    worker_id: str = "p0", *, queued: int = 0, tps: float = 10_000.0, live: bool = True
) -> PrefillWorkerLoad:
    return PrefillWorkerLoad(worker_id, queued, tps, live)


def decode(
    worker_id: str = "d0",
    *,
    total: int = 1000,
    free: int | None = None,
    reserved: int = 0,
    transfer: int = 0,
    live: bool = True,
) -> DecodeWorkerLoad:
    return DecodeWorkerLoad(
        worker_id,
        total_blocks=total,
        free_blocks=total if free is None else free,
        reserved_blocks=reserved,
        inflight_transfer_blocks=transfer,
        live=live,
    )


def make_snapshot(
    *,
    prefills: tuple[PrefillWorkerLoad, ...] | None = None,
    decodes: tuple[DecodeWorkerLoad, ...] | None = None,
    transfer_budget: int = 256,
    inflight: int = 0,
    block_size: int = BLOCK_SIZE,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        prefill_workers=(prefill(),) if prefills is None else prefills,
        decode_workers=(decode(),) if decodes is None else decodes,
        transfer_budget_blocks=transfer_budget,
        router_inflight_requests=inflight,
        block_size=block_size,
    )
