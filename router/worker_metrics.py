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

import time
from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from vocabulary.engine_io import EngineLoad
from vocabulary.step_stats import BATCH_REQUESTS_BUCKETS, STEP_SECONDS_BUCKETS
from vocabulary.worker_api import WorkerLoad, WorkerState

LABELS = ["worker", "role"]
F = TypeVar("F", GaugeMetricFamily, CounterMetricFamily)
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

    def collect(self) -> Iterator[Metric]:  # the metrics server's thread
        loads = sorted(self._loads.values(), key=lambda item: item[0].worker_id)
        now = time.monotonic()
        families = _Families()
        for load, seen_at in loads:
            families.add(load, now - seen_at)
        yield from families.all()

    def describe(self) -> list[Metric]:
        return []  # series come and go with workers: nothing to check at registration


class _Families:
    """One scrape's metric families, filled worker by worker."""

    def __init__(self) -> None:
        self._all: list[Metric] = []
        g, c = self._gauge, self._counter
        self.kv_used = g("pdserve_worker_kv_blocks_used", "KV blocks used")
        self.kv_total = g("pdserve_worker_kv_blocks_total", "KV blocks")
        self.queued_tokens = g(
            "pdserve_worker_queued_prefill_tokens", "Prompt tokens not yet computed"
        )
        self.waiting = g("pdserve_worker_waiting_requests", "Requests queued in the engine")
        self.running = g("pdserve_worker_running_requests", "Running")
        self.inflight = g(
            "pdserve_worker_inflight_requests",
            "Requests the worker holds (queued, pulling, running or streaming)",
        )
        self.transfer = g("pdserve_worker_transfer_blocks", "KV blocks being pulled")
        self.leased = g("pdserve_worker_leased_blocks", "Prefill blocks under lease")
        self.leases_held = g("pdserve_worker_leases_held", "Hand-offs held under lease")
        self.leases_expired = c(
            "pdserve_worker_leases_expired", "Leases that expired before decode pulled them"
        )
        self.index_errors = g(
            "pdserve_worker_index_publish_errors",
            "Failed rounds of the worker's KV-event publisher to the Redis prefix index "
            "(since the worker started)",
        )
        self.state = GaugeMetricFamily(
            "pdserve_worker_state",
            "The state the worker reports (1 for the current one)",
            labels=[*LABELS, "state"],
        )
        self._all.append(self.state)
        self.age = g(
            "pdserve_worker_load_age_seconds",
            "Seconds since this router's last answered load poll of the worker",
        )
        self.done = c("pdserve_worker_requests_done", "Requests the worker finished")
        self.preemptions = c("pdserve_worker_preemptions", "Requests preempted (KV pool short)")
        self.cache_query = c(
            "pdserve_worker_prefix_cache_query_tokens",
            "Prompt tokens looked up in the worker's prefix cache",
        )
        self.cache_hit = c(
            "pdserve_worker_prefix_cache_hit_tokens",
            "Prompt tokens found in the worker's prefix cache (not computed)",
        )
        # The host KV tier (engine/kv/host_tier.py), on workers that have one.
        self.host_hit = c(
            "pdserve_worker_host_kv_hit_tokens",
            "Prompt tokens found in the worker's host KV tier (onboarded, not computed)",
        )
        self.host_blocks = g("pdserve_worker_host_kv_blocks", "Blocks of the host KV tier")
        self.host_cached = g(
            "pdserve_worker_host_kv_cached_blocks", "Host KV tier blocks holding a cached block"
        )
        self.host_moved = CounterMetricFamily(
            "pdserve_worker_host_kv_blocks_moved",
            "Blocks copied between the device pool and the host KV tier, by direction",
            labels=[*LABELS, "direction"],
        )
        self._all.append(self.host_moved)
        self.host_moved_bytes = self._by_direction(
            CounterMetricFamily, "pdserve_worker_host_kv_bytes_moved",
            "Bytes copied between the device pool and the host KV tier",
        )  # fmt: skip
        self.host_queued = self._by_direction(
            GaugeMetricFamily, "pdserve_worker_host_kv_queued_blocks",
            "Host KV tier copies waiting for the in-flight budget (onboard: a request's "
            "blocks; offload: blocks offered, not copied yet)",
        )  # fmt: skip
        self.host_inflight = self._by_direction(
            GaugeMetricFamily, "pdserve_worker_host_kv_inflight_blocks",
            "Host KV tier copies queued on the device and holding in-flight budget",
        )  # fmt: skip
        self.host_wait = self._by_direction(
            CounterMetricFamily, "pdserve_worker_host_kv_wait_seconds",
            "Seconds host KV tier copies waited before they started (onboard: for budget; "
            "offload: from the offer)",
        )  # fmt: skip
        self.host_deferred = self._by_direction(
            CounterMetricFamily, "pdserve_worker_host_kv_deferred",
            "Host KV tier copies the in-flight budget held back (onboard: requests; "
            "offload: flushes)",
        )  # fmt: skip
        self.host_lent = c(
            "pdserve_worker_host_kv_handoff_blocks",
            "Hand-off blocks lent from the host KV tier (read by decode from host memory)",
        )
        self.host_pinned = g(
            "pdserve_worker_host_kv_pinned_blocks",
            "Host KV tier blocks pinned (hand-offs lending them, onboards under way)",
        )
        self.host_evicted = c(
            "pdserve_worker_host_kv_evicted_blocks", "Host KV tier blocks reused for newer ones"
        )
        self.prefill_rate = g(
            "pdserve_worker_prefill_tokens_per_second",
            "Observed prefill throughput (prompt tokens per busy second)",
        )
        self.step_seconds = self._histogram(
            "pdserve_worker_engine_step_seconds", "Wall time of one engine step"
        )
        self.batch_requests = self._histogram(
            "pdserve_worker_engine_batch_requests", "Requests in one engine step"
        )
        self.step_tokens = CounterMetricFamily(
            "pdserve_worker_engine_tokens",
            "Tokens computed by engine steps, by kind (prefill: prompt, decode: generated)",
            labels=[*LABELS, "kind"],
        )
        self._all.append(self.step_tokens)
        # Decode side: the KV-transfer endpoint.
        self.xfer_inflight_blocks = g(
            "pdserve_worker_transfer_inflight_blocks", "KV blocks in flight (being read)"
        )
        self.xfer_queued_blocks = g(
            "pdserve_worker_transfer_queued_blocks", "KV blocks queued for the in-flight budget"
        )
        self.xfer_budget_blocks = g(
            "pdserve_worker_transfer_budget_blocks", "In-flight budget of KV blocks"
        )
        self.xfer_inflight_bytes = g(
            "pdserve_worker_transfer_inflight_bytes", "KV bytes in flight (being read)"
        )
        self.xfer_budget_bytes = g(
            "pdserve_worker_transfer_budget_bytes", "In-flight budget of KV bytes (0: none)"
        )
        self.xfer_bytes = c("pdserve_worker_transfer_bytes", "KV bytes pulled")
        self.xfer_blocks = c("pdserve_worker_transfer_pulled_blocks", "KV blocks pulled")
        self.xfer_reused = c(
            "pdserve_worker_transfer_reused_blocks",
            "Hand-off blocks not pulled: the decode worker already cached them",
        )
        self.xfer_descriptors = c("pdserve_worker_transfer_descriptors", "Transfer descriptors")
        self.xfer_seconds = c(
            "pdserve_worker_transfer_seconds", "Seconds spent in completed transfers"
        )
        self.xfer_queue_wait = c(
            "pdserve_worker_transfer_queue_wait_seconds",
            "Seconds transfers waited for the in-flight budget",
        )
        self.xfer_limited = c(
            "pdserve_worker_transfer_budget_limited_passes",
            "Scheduling passes that left transfers queued because the budget was full",
        )
        self.xfer_deferred = c(
            "pdserve_worker_transfer_deferred_requests",
            "Transfers that waited at least one pass for in-flight budget",
        )
        self.xfer_results = CounterMetricFamily(
            "pdserve_worker_transfers", "Finished KV transfers by result",
            labels=[*LABELS, "result"],
        )  # fmt: skip
        self._all.append(self.xfer_results)
        # The KV-event publisher (workers with a prefix index).
        self.index_connected = g(
            "pdserve_worker_index_connected", "The publisher's last round reached Redis (1/0)"
        )
        self.index_resyncs = c(
            "pdserve_worker_index_resyncs", "Full resyncs of the worker's prefix-index entries"
        )
        self.index_pending = g("pdserve_worker_index_pending_events", "KV events waiting for Redis")

    def _gauge(self, name: str, doc: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        self._all.append(family)
        return family

    def _counter(self, name: str, doc: str) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        self._all.append(family)
        return family

    def _by_direction(self, kind: type[F], name: str, doc: str) -> F:
        family = kind(name, doc, labels=[*LABELS, "direction"])
        self._all.append(family)
        return family

    def _histogram(self, name: str, doc: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        self._all.append(family)
        return family

    def all(self) -> list[Metric]:
        return self._all

    def add(self, load: WorkerLoad, age_s: float) -> None:
        labels = [load.worker_id, load.role.value]
        e = load.engine
        self.kv_used.add_metric(labels, e.num_total_blocks - e.num_free_blocks)
        self.kv_total.add_metric(labels, e.num_total_blocks)
        self.queued_tokens.add_metric(labels, e.num_waiting_prefill_tokens)
        self.waiting.add_metric(labels, e.num_waiting)
        self.running.add_metric(labels, e.num_running)
        self.inflight.add_metric(labels, load.inflight_requests)
        self.transfer.add_metric(labels, load.transfer.pending_blocks)
        self.leased.add_metric(labels, load.leased_blocks)
        self.leases_held.add_metric(labels, load.leases_held)
        self.leases_expired.add_metric(labels, load.leases_expired)
        self.index_errors.add_metric(labels, load.index_publish_errors)
        for state in _STATES:
            self.state.add_metric([*labels, state], float(load.state.value == state))
        self.age.add_metric(labels, age_s)
        self.done.add_metric(labels, load.requests_done)
        self.preemptions.add_metric(labels, e.num_preemptions)
        self.cache_query.add_metric(labels, e.num_cache_query_tokens)
        self.cache_hit.add_metric(labels, e.num_cache_hit_tokens)
        self.prefill_rate.add_metric(labels, load.prefill_tokens_per_s)
        self._add_host_tier(labels, e)
        steps = e.steps
        self.step_seconds.add_metric(
            labels,
            _buckets(STEP_SECONDS_BUCKETS, steps.step_seconds_buckets),
            steps.step_seconds,
        )
        self.batch_requests.add_metric(
            labels,
            _buckets(BATCH_REQUESTS_BUCKETS, steps.batch_requests_buckets),
            steps.batch_requests,
        )
        self.step_tokens.add_metric([*labels, "prefill"], steps.prefill_tokens)
        self.step_tokens.add_metric([*labels, "decode"], steps.decode_tokens)
        self._add_transfer(labels, load)
        index = load.index
        if index is not None:
            self.index_connected.add_metric(labels, float(index.connected and index.running))
            self.index_resyncs.add_metric(labels, index.num_resyncs)
            self.index_pending.add_metric(labels, index.pending_events)

    def _add_host_tier(self, labels: list[str], e: EngineLoad) -> None:
        tier = e.host_tier
        if tier is None:
            return
        self.host_hit.add_metric(labels, e.num_host_hit_tokens)
        self.host_blocks.add_metric(labels, tier.num_blocks)
        self.host_cached.add_metric(labels, tier.num_cached)
        self.host_moved.add_metric([*labels, "offload"], tier.num_offloaded)
        self.host_moved.add_metric([*labels, "onboard"], tier.num_onboarded)
        self.host_evicted.add_metric(labels, tier.num_evicted)
        self.host_pinned.add_metric(labels, tier.num_pinned)
        self.host_lent.add_metric(labels, tier.num_lent)
        for direction, moves in (("onboard", tier.onboard), ("offload", tier.offload)):
            by = [*labels, direction]
            self.host_moved_bytes.add_metric(by, moves.done_bytes)
            self.host_queued.add_metric(by, moves.queued_blocks)
            self.host_inflight.add_metric(by, moves.inflight_blocks)
            self.host_wait.add_metric(by, moves.wait_s)
            self.host_deferred.add_metric(by, moves.deferred)

    def _add_transfer(self, labels: list[str], load: WorkerLoad) -> None:
        stats = load.transfer_stats
        if stats is None:
            return
        t = load.transfer
        self.xfer_inflight_blocks.add_metric(labels, t.in_flight_blocks)
        self.xfer_queued_blocks.add_metric(labels, t.queued_blocks)
        self.xfer_budget_blocks.add_metric(labels, t.max_inflight_blocks)
        self.xfer_inflight_bytes.add_metric(labels, t.in_flight_bytes)
        self.xfer_budget_bytes.add_metric(labels, t.max_inflight_bytes)
        self.xfer_bytes.add_metric(labels, stats.bytes_transferred)
        self.xfer_blocks.add_metric(labels, stats.blocks_transferred)
        self.xfer_reused.add_metric(labels, stats.blocks_reused)
        self.xfer_descriptors.add_metric(labels, stats.descriptors)
        self.xfer_seconds.add_metric(labels, stats.transfer_seconds)
        self.xfer_queue_wait.add_metric(labels, stats.queue_wait_seconds)
        self.xfer_limited.add_metric(labels, stats.budget_limited_passes)
        self.xfer_deferred.add_metric(labels, stats.deferred_requests)
        self.xfer_results.add_metric([*labels, "done"], stats.transfers_done)
        self.xfer_results.add_metric([*labels, "failed"], stats.transfers_failed)
        self.xfer_results.add_metric([*labels, "expired"], stats.transfers_expired)


def _buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Prometheus cumulative buckets from per-bucket counts (empty counts: all zero)."""
    out: list[tuple[str, float]] = []
    total = 0
    for i, bound in enumerate((*bounds, float("inf"))):
        total += counts[i] if i < len(counts) else 0
        out.append((floatToGoString(bound), float(total)))
    return out
