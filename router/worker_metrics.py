"""Per-worker Prometheus series, from the load reports this router polls (router/cluster_view.py).

Workers serve no metrics port of their own: every router already polls each worker's
`WorkerLoad` (every 50 ms while busy), and this collector renders the latest one at scrape
time. Cumulative figures of the worker (engine steps, prefix-cache tokens, bytes moved) are
exported as counters and histograms with the worker's own totals, so `rate()` works across
router restarts; gauges are its latest state. Every series has `worker` and `role` labels.
With several router replicas each exports the same series (under its own `instance`):
aggregate with `max by (worker, ...)`, never `sum`.

A worker's series go when it leaves the registry (`forget`). `pdserve_worker_load_age_seconds`
grows while its polls fail (stuck, dead, or its node lost), until the controller removes it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from vocabulary.engine_io import EngineLoad, HostTierStats, TierMoveStats
from vocabulary.kv_events import PublisherStats
from vocabulary.step_stats import BATCH_REQUESTS_BUCKETS, STEP_SECONDS_BUCKETS
from vocabulary.transfer_load import TransferStats
from vocabulary.worker_api import WorkerLoad, WorkerState

LABELS = ["worker", "role"]
_STATES = tuple(s.value for s in WorkerState if s is not WorkerState.DRAINED)
"""States a worker reports itself (DRAINED is the controller's name,
deploy/control/cluster_controller.py)."""


class WorkerLoadCollector:
    """Renders the latest `WorkerLoad` of every worker in view (register in a registry)."""

    def __init__(self) -> None:
        self._loads: dict[str, tuple[WorkerLoad, float]] = {}

    def observe(self, load: WorkerLoad) -> None:
        """A load poll answered (the router's event loop)."""
        self._loads[load.worker_id] = (load, time.monotonic())

    def forget(self, worker_id: str) -> None:
        self._loads.pop(worker_id, None)

    def knows(self, worker_id: str) -> bool:
        """The worker is in view: a load of it was observed and it has not been forgotten."""
        return worker_id in self._loads

    def collect(self) -> Iterator[Metric]:  # the metrics server's thread
        loads = sorted(self._loads.values(), key=lambda item: item[0].worker_id)
        now = time.monotonic()
        families = [(spec, spec.family()) for spec in FAMILIES]
        for load, seen_at in loads:
            report = WorkerReport(load, now - seen_at)
            labels = [load.worker_id, load.role.value]
            for spec, family in families:
                if report.has(spec.part):
                    _add(family, labels, spec.read(report))
        yield from (family for _, family in families)

    def describe(self) -> list[Metric]:
        return []  # series come and go with workers: nothing to check at registration


class Part(enum.Enum):
    """The part of a worker's report a family reads; a worker without it has no such series."""

    WORKER = "worker"
    HOST_TIER = "host_tier"  # workers with a host KV tier (engine/kv/host_tier.py)
    TRANSFER = "transfer"  # decode workers: the KV-transfer endpoint
    INDEX = "index"  # workers with a KV-event publisher to the prefix index


@dataclass(frozen=True)
class WorkerReport:
    """One worker's latest load and the seconds since it was answered: what families read."""

    load: WorkerLoad
    age_s: float

    def has(self, part: Part) -> bool:
        if part is Part.HOST_TIER:
            return self.load.engine.host_tier is not None
        if part is Part.TRANSFER:
            return self.load.transfer_stats is not None
        if part is Part.INDEX:
            return self.load.index is not None
        return True

    @property
    def engine(self) -> EngineLoad:
        return self.load.engine

    @property
    def tier(self) -> HostTierStats:  # Part.HOST_TIER
        assert self.load.engine.host_tier is not None
        return self.load.engine.host_tier

    @property
    def transfer_stats(self) -> TransferStats:  # Part.TRANSFER
        assert self.load.transfer_stats is not None
        return self.load.transfer_stats

    @property
    def index(self) -> PublisherStats:  # Part.INDEX
        assert self.load.index is not None
        return self.load.index


@dataclass(frozen=True)
class Buckets:
    """A histogram's figure: Prometheus cumulative buckets and the sum."""

    buckets: list[tuple[str, float]]
    sum: float


Figure = float | Mapping[str, float] | Buckets
"""What a family reads of one worker: one value, one value per value of the family's extra
label (in exposition order), or a histogram."""
Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


@dataclass(frozen=True)
class FamilySpec:
    """One per-worker metric family: how it is exposed and which figure of a worker fills it."""

    name: str
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily] | type[HistogramMetricFamily]
    help: str
    read: Callable[[WorkerReport], Figure]
    by: str | None = None
    """An extra label after `worker` and `role`; `read` then gives a value per label value."""
    part: Part = Part.WORKER

    def family(self) -> Family:
        return self.kind(self.name, self.help, labels=[*LABELS, self.by] if self.by else LABELS)


def _add(family: Family, labels: list[str], figure: Figure) -> None:
    if isinstance(figure, Buckets):
        assert isinstance(family, HistogramMetricFamily)
        family.add_metric(labels, figure.buckets, figure.sum)
        return
    assert not isinstance(family, HistogramMetricFamily)
    if isinstance(figure, Mapping):
        for label, value in figure.items():
            family.add_metric([*labels, label], value)
    else:
        family.add_metric(labels, figure)


def _moves(
    figure: Callable[[TierMoveStats], float],
) -> Callable[[WorkerReport], Mapping[str, float]]:
    """A host tier figure by direction."""
    return lambda r: {"onboard": figure(r.tier.onboard), "offload": figure(r.tier.offload)}


def _histogram(bounds: Sequence[float], counts: Sequence[int], total: float) -> Buckets:
    """Prometheus cumulative buckets from per-bucket counts (empty counts: all zero)."""
    out: list[tuple[str, float]] = []
    running = 0
    for i, bound in enumerate((*bounds, float("inf"))):
        running += counts[i] if i < len(counts) else 0
        out.append((floatToGoString(bound), float(running)))
    return Buckets(out, total)


GAUGE, COUNTER, HISTOGRAM = GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily
HOST, XFER, INDEX = Part.HOST_TIER, Part.TRANSFER, Part.INDEX

FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("pdserve_worker_kv_blocks_used", GAUGE, "KV blocks used",
               lambda r: r.engine.num_total_blocks - r.engine.num_free_blocks),
    FamilySpec("pdserve_worker_kv_blocks_total", GAUGE, "KV blocks",
               lambda r: r.engine.num_total_blocks),
    FamilySpec("pdserve_worker_queued_prefill_tokens", GAUGE, "Prompt tokens not yet computed",
               lambda r: r.engine.num_waiting_prefill_tokens),
    FamilySpec("pdserve_worker_waiting_requests", GAUGE, "Requests queued in the engine",
               lambda r: r.engine.num_waiting),
    FamilySpec("pdserve_worker_running_requests", GAUGE, "Running",
               lambda r: r.engine.num_running),
    FamilySpec("pdserve_worker_inflight_requests", GAUGE,
               "Requests the worker holds (queued, pulling, running or streaming)",
               lambda r: r.load.inflight_requests),
    FamilySpec("pdserve_worker_transfer_blocks", GAUGE, "KV blocks being pulled",
               lambda r: r.load.transfer.pending_blocks),
    FamilySpec("pdserve_worker_leased_blocks", GAUGE, "Prefill blocks under lease",
               lambda r: r.load.leased_blocks),
    FamilySpec("pdserve_worker_leases_held", GAUGE, "Hand-offs held under lease",
               lambda r: r.load.leases_held),
    FamilySpec("pdserve_worker_leases_expired", COUNTER,
               "Leases that expired before decode pulled them",
               lambda r: r.load.leases_expired),
    FamilySpec("pdserve_worker_index_publish_errors", GAUGE,
               "Failed rounds of the worker's KV-event publisher to the Redis prefix index "
               "(since the worker started)",
               lambda r: r.load.index_publish_errors),
    FamilySpec("pdserve_worker_state", GAUGE,
               "The state the worker reports (1 for the current one)",
               lambda r: {s: float(r.load.state.value == s) for s in _STATES}, by="state"),
    FamilySpec("pdserve_worker_load_age_seconds", GAUGE,
               "Seconds since this router's last answered load poll of the worker",
               lambda r: r.age_s),
    FamilySpec("pdserve_worker_requests_done", COUNTER, "Requests the worker finished",
               lambda r: r.load.requests_done),
    FamilySpec("pdserve_worker_preemptions", COUNTER, "Requests preempted (KV pool short)",
               lambda r: r.engine.num_preemptions),
    FamilySpec("pdserve_worker_prefix_cache_query_tokens", COUNTER,
               "Prompt tokens looked up in the worker's prefix cache",
               lambda r: r.engine.num_cache_query_tokens),
    FamilySpec("pdserve_worker_prefix_cache_hit_tokens", COUNTER,
               "Prompt tokens found in the worker's prefix cache (not computed)",
               lambda r: r.engine.num_cache_hit_tokens),
    FamilySpec("pdserve_worker_host_kv_hit_tokens", COUNTER,
               "Prompt tokens found in the worker's host KV tier (onboarded, not computed)",
               lambda r: r.engine.num_host_hit_tokens, part=HOST),
    FamilySpec("pdserve_worker_host_kv_blocks", GAUGE, "Blocks of the host KV tier",
               lambda r: r.tier.num_blocks, part=HOST),
    FamilySpec("pdserve_worker_host_kv_cached_blocks", GAUGE,
               "Host KV tier blocks holding a cached block",
               lambda r: r.tier.num_cached, part=HOST),
    FamilySpec("pdserve_worker_host_kv_blocks_moved", COUNTER,
               "Blocks copied between the device pool and the host KV tier, by direction",
               lambda r: {"offload": r.tier.num_offloaded, "onboard": r.tier.num_onboarded},
               by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_bytes_moved", COUNTER,
               "Bytes copied between the device pool and the host KV tier",
               _moves(lambda m: m.done_bytes), by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_queued_blocks", GAUGE,
               "Host KV tier copies waiting for the in-flight budget (onboard: a request's "
               "blocks; offload: blocks offered, not copied yet)",
               _moves(lambda m: m.queued_blocks), by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_inflight_blocks", GAUGE,
               "Host KV tier copies queued on the device and holding in-flight budget",
               _moves(lambda m: m.inflight_blocks), by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_wait_seconds", COUNTER,
               "Seconds host KV tier copies waited before they started (onboard: for budget; "
               "offload: from the offer)",
               _moves(lambda m: m.wait_s), by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_deferred", COUNTER,
               "Host KV tier copies the in-flight budget held back (onboard: requests; "
               "offload: flushes)",
               _moves(lambda m: m.deferred), by="direction", part=HOST),
    FamilySpec("pdserve_worker_host_kv_handoff_blocks", COUNTER,
               "Hand-off blocks lent from the host KV tier (read by decode from host memory)",
               lambda r: r.tier.num_lent, part=HOST),
    FamilySpec("pdserve_worker_host_kv_pinned_blocks", GAUGE,
               "Host KV tier blocks pinned (hand-offs lending them, onboards under way)",
               lambda r: r.tier.num_pinned, part=HOST),
    FamilySpec("pdserve_worker_host_kv_evicted_blocks", COUNTER,
               "Host KV tier blocks reused for newer ones",
               lambda r: r.tier.num_evicted, part=HOST),
    FamilySpec("pdserve_worker_prefill_tokens_per_second", GAUGE,
               "Observed prefill throughput (prompt tokens per busy second)",
               lambda r: r.load.prefill_tokens_per_s),
    FamilySpec("pdserve_worker_engine_step_seconds", HISTOGRAM, "Wall time of one engine step",
               lambda r: _histogram(STEP_SECONDS_BUCKETS, r.engine.steps.step_seconds_buckets,
                                    r.engine.steps.step_seconds)),
    FamilySpec("pdserve_worker_engine_batch_requests", HISTOGRAM, "Requests in one engine step",
               lambda r: _histogram(BATCH_REQUESTS_BUCKETS,
                                    r.engine.steps.batch_requests_buckets,
                                    r.engine.steps.batch_requests)),
    FamilySpec("pdserve_worker_engine_tokens", COUNTER,
               "Tokens computed by engine steps, by kind (prefill: prompt, decode: generated)",
               lambda r: {"prefill": r.engine.steps.prefill_tokens,
                          "decode": r.engine.steps.decode_tokens},
               by="kind"),
    FamilySpec("pdserve_worker_transfer_inflight_blocks", GAUGE,
               "KV blocks in flight (being read)",
               lambda r: r.load.transfer.in_flight_blocks, part=XFER),
    FamilySpec("pdserve_worker_transfer_queued_blocks", GAUGE,
               "KV blocks queued for the in-flight budget",
               lambda r: r.load.transfer.queued_blocks, part=XFER),
    FamilySpec("pdserve_worker_transfer_budget_blocks", GAUGE, "In-flight budget of KV blocks",
               lambda r: r.load.transfer.max_inflight_blocks, part=XFER),
    FamilySpec("pdserve_worker_transfer_inflight_bytes", GAUGE,
               "KV bytes in flight (being read)",
               lambda r: r.load.transfer.in_flight_bytes, part=XFER),
    FamilySpec("pdserve_worker_transfer_budget_bytes", GAUGE,
               "In-flight budget of KV bytes (0: none)",
               lambda r: r.load.transfer.max_inflight_bytes, part=XFER),
    FamilySpec("pdserve_worker_transfer_bytes", COUNTER, "KV bytes pulled",
               lambda r: r.transfer_stats.bytes_transferred, part=XFER),
    FamilySpec("pdserve_worker_transfer_pulled_blocks", COUNTER, "KV blocks pulled",
               lambda r: r.transfer_stats.blocks_transferred, part=XFER),
    FamilySpec("pdserve_worker_transfer_reused_blocks", COUNTER,
               "Hand-off blocks not pulled: the decode worker already cached them",
               lambda r: r.transfer_stats.blocks_reused, part=XFER),
    FamilySpec("pdserve_worker_transfer_descriptors", COUNTER, "Transfer descriptors",
               lambda r: r.transfer_stats.descriptors, part=XFER),
    FamilySpec("pdserve_worker_transfer_seconds", COUNTER,
               "Seconds spent in completed transfers",
               lambda r: r.transfer_stats.transfer_seconds, part=XFER),
    FamilySpec("pdserve_worker_transfer_queue_wait_seconds", COUNTER,
               "Seconds transfers waited for the in-flight budget",
               lambda r: r.transfer_stats.queue_wait_seconds, part=XFER),
    FamilySpec("pdserve_worker_transfer_budget_limited_passes", COUNTER,
               "Scheduling passes that left transfers queued because the budget was full",
               lambda r: r.transfer_stats.budget_limited_passes, part=XFER),
    FamilySpec("pdserve_worker_transfer_deferred_requests", COUNTER,
               "Transfers that waited at least one pass for in-flight budget",
               lambda r: r.transfer_stats.deferred_requests, part=XFER),
    FamilySpec("pdserve_worker_transfers", COUNTER, "Finished KV transfers by result",
               lambda r: {"done": r.transfer_stats.transfers_done,
                          "failed": r.transfer_stats.transfers_failed,
                          "expired": r.transfer_stats.transfers_expired},
               by="result", part=XFER),
    FamilySpec("pdserve_worker_index_connected", GAUGE,
               "The publisher's last round reached Redis (1/0)",
               lambda r: float(r.index.connected and r.index.running), part=INDEX),
    FamilySpec("pdserve_worker_index_resyncs", COUNTER,
               "Full resyncs of the worker's prefix-index entries",
               lambda r: r.index.num_resyncs, part=INDEX),
    FamilySpec("pdserve_worker_index_pending_events", GAUGE, "KV events waiting for Redis",
               lambda r: r.index.pending_events, part=INDEX),
)  # fmt: skip
"""Every per-worker family, in exposition order."""
