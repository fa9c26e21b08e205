"""Router metrics: Prometheus series (served on the metrics port) and the rolling latency
windows that `pdserve status` reports per worker (p50/p90 of recent TTFT and TPOT)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker_runtime.api import WorkerLoad

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
WINDOW = 512
RECENT = 4096
"""Timestamped samples kept for the controller's planner (`RouterMetrics.recent_samples`)."""


@dataclass(frozen=True)
class LatencySummary:
    ttft_p50_ms: float = 0.0
    ttft_p90_ms: float = 0.0
    tpot_p50_ms: float = 0.0
    tpot_p90_ms: float = 0.0


@dataclass(frozen=True)
class TimedSample:
    """One finished request's TTFT (attributed to the worker that produced the first token) or
    TPOT (the decode worker), stamped with the wall-clock time it was recorded."""

    worker_id: str
    at_s: float
    """`time.time()` when the request finished."""
    value_ms: float


@dataclass(frozen=True)
class RecentSamples:
    """What one router measured since a given time (the planner's latency input)."""

    ttft: tuple[TimedSample, ...]
    tpot: tuple[TimedSample, ...]


def _pct(values: deque[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class RouterMetrics:
    """All series of one router, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.admission = Counter(
            "pdserve_admission_decisions", "Admission results", ["decision", "reason"], registry=r
        )
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "pdserve_tpot_seconds", "Mean time per output token after the first",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "pdserve_queue_seconds", "Admission queue wait", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfer = Histogram(
            "pdserve_transfer_seconds", "KV transfer time", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds", "End-to-end latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.cached_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens by source", ["source"], registry=r
        )
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=r)
        self.migrations = Counter(
            "pdserve_migrations",
            "Running requests moved to other workers after their decode worker failed, by how "
            "they went on (re-prefill on a new pair, or resume on a decode worker alone)",
            ["how"],
            registry=r,
        )
        labels = ["worker", "role"]
        self.w_kv_used = Gauge(
            "pdserve_worker_kv_blocks_used", "KV blocks used", labels, registry=r
        )
        self.w_kv_total = Gauge("pdserve_worker_kv_blocks_total", "KV blocks", labels, registry=r)
        self.w_queued = Gauge(
            "pdserve_worker_queued_prefill_tokens", "Prompt tokens not yet computed", labels,
            registry=r,
        )  # fmt: skip
        self.w_running = Gauge("pdserve_worker_running_requests", "Running", labels, registry=r)
        self.w_transfer = Gauge(
            "pdserve_worker_transfer_blocks", "KV blocks being pulled", labels, registry=r
        )
        self.w_leased = Gauge(
            "pdserve_worker_leased_blocks", "Prefill blocks under lease", labels, registry=r
        )
        self.w_index_errors = Gauge(
            "pdserve_worker_index_publish_errors",
            "Failed rounds of the worker's KV-event publisher to the Redis prefix index "
            "(since the worker started)",
            labels,
            registry=r,
        )
        self._ttft: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
        self._tpot: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=WINDOW))
        self._recent_ttft: deque[TimedSample] = deque(maxlen=RECENT)
        self._recent_tpot: deque[TimedSample] = deque(maxlen=RECENT)

    def observe_request(
        self,
        outcome: str,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
        first_worker: str,
        decode_worker: str,
    ) -> None:
        self.requests.labels(outcome).inc()
        self.e2e.observe(e2e_s)
        now = time.time()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self._ttft[first_worker].append(ttft_s * 1000)
            self._recent_ttft.append(TimedSample(first_worker, now, ttft_s * 1000))
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            self._tpot[decode_worker].append(tpot_s * 1000)
            self._recent_tpot.append(TimedSample(decode_worker, now, tpot_s * 1000))

    def recent_samples(self, since_s: float) -> RecentSamples:
        """TTFT and TPOT samples recorded at or after wall-clock time `since_s` (at most the
        last RECENT of each)."""
        return RecentSamples(
            ttft=tuple(s for s in self._recent_ttft if s.at_s >= since_s),
            tpot=tuple(s for s in self._recent_tpot if s.at_s >= since_s),
        )

    def latency(self, worker_id: str) -> LatencySummary:
        ttft, tpot = self._ttft.get(worker_id, deque()), self._tpot.get(worker_id, deque())
        return LatencySummary(_pct(ttft, 50), _pct(ttft, 90), _pct(tpot, 50), _pct(tpot, 90))

    def observe_load(self, load: WorkerLoad) -> None:
        labels = (load.worker_id, load.role.value)
        e = load.engine
        self.w_kv_used.labels(*labels).set(e.num_total_blocks - e.num_free_blocks)
        self.w_kv_total.labels(*labels).set(e.num_total_blocks)
        self.w_queued.labels(*labels).set(e.num_waiting_prefill_tokens)
        self.w_running.labels(*labels).set(e.num_running)
        self.w_transfer.labels(*labels).set(load.transfer.pending_blocks)
        self.w_leased.labels(*labels).set(load.leased_blocks)
        self.w_index_errors.labels(*labels).set(load.index_publish_errors)

    def forget_worker(self, worker_id: str, role: str) -> None:
        for g in (self.w_kv_used, self.w_kv_total, self.w_queued, self.w_running,
                  self.w_transfer, self.w_leased, self.w_index_errors):  # fmt: skip
            with contextlib.suppress(KeyError):
                g.remove(worker_id, role)
        self._ttft.pop(worker_id, None)
        self._tpot.pop(worker_id, None)
