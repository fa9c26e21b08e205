"""Router metrics: Prometheus series (served on the metrics port) and the rolling latency
windows that `pdserve status` reports per worker (p50/p90 of recent TTFT and TPOT)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from admission.decision import Reason
from router.placement import Placement, PrefillReason
from router.worker_metrics import WorkerLoadCollector
from vocabulary.worker_api import WorkerLoad

if TYPE_CHECKING:
    from prefix_index.index import PrefixIndex

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
WINDOW = 512
RECENT = 4096
"""Timestamped samples kept for the controller's planner (`RouterMetrics.recent_samples`)."""
OUTCOMES = ("ok", "invalid", "rejected", "deadline", "cancelled", "unavailable", "internal")
"""Values of `pdserve_requests_total{outcome}` (router/errors.py `GrpcFailure.outcome`)."""


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
    output_tokens: int = 0
    """TTFT samples: the tokens the request generated (the predictive planner's mean)."""


@dataclass(frozen=True)
class Arrivals:
    """Requests a router received since it started (admitted or not) and their prompt tokens:
    counters, so a reader takes the difference between two readings."""

    requests: int = 0
    prompt_tokens: int = 0

    def plus(self, prompt_tokens: int) -> Arrivals:
        return Arrivals(self.requests + 1, self.prompt_tokens + prompt_tokens)


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


@dataclass(frozen=True)
class SloTargets:
    """The latency targets `pdserve_goodput_requests_total` counts against (the defaults are
    the planner's, planner/core.py `PlannerConfig`)."""

    ttft_ms: float = 500.0
    tpot_ms: float = 50.0

    @property
    def ttft_s(self) -> float:
        return self.ttft_ms / 1000

    @property
    def tpot_s(self) -> float:
        return self.tpot_ms / 1000

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Within both (a request of one token has no TPOT: its TTFT decides)."""
        if ttft_s is None or ttft_s > self.ttft_s:
            return False
        return tpot_s is None or tpot_s <= self.tpot_s


class RouterMetrics:
    """All series of one router, in a registry of its own; the per-worker ones come from the
    load polls (router/worker_metrics.py)."""

    def __init__(self, slo: SloTargets | None = None) -> None:
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
        for outcome in OUTCOMES:  # every series exists from the start: rates and ratios work
            self.requests.labels(outcome)
        self.admission.labels("admit", Reason.ADMITTED.value)
        for reason in Reason:
            if reason is not Reason.ADMITTED:
                self.admission.labels("reject", reason.value)
        for how in ("re-prefill", "resume"):
            self.migrations.labels(how)
        self.placements = Counter(
            "pdserve_prefill_placements",
            "Placements by where the prompt is prefilled (local: on its decode worker; remote: "
            "on a prefill worker) and why (router/placement.py PrefillReason)",
            ["site", "reason"],
            registry=r,
        )
        for why in PrefillReason:
            self.placements.labels(_site(why), why.value)
        self.slo = slo or SloTargets()
        self.goodput = Counter(
            "pdserve_goodput_requests",
            "Requests that finished ok within both SLOs (TTFT, and TPOT when it has one)",
            registry=r,
        )
        slo_gauge = Gauge(
            "pdserve_slo_seconds", "The SLOs goodput is counted against", ["metric"], registry=r
        )
        slo_gauge.labels("ttft").set(self.slo.ttft_s)
        slo_gauge.labels("tpot").set(self.slo.tpot_s)
        for source in ("cached", "computed"):
            self.cached_tokens.labels(source)
        self.workers = WorkerLoadCollector()
        r.register(self.workers)
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
        output_tokens: int = 0,
    ) -> None:
        self.requests.labels(outcome).inc()
        self.e2e.observe(e2e_s)
        if outcome == "ok" and self.slo.met(ttft_s, tpot_s):
            self.goodput.inc()
        now = time.time()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if self.workers.knows(first_worker):  # not one `forget_worker` dropped
                self._ttft[first_worker].append(ttft_s * 1000)
            self._recent_ttft.append(TimedSample(first_worker, now, ttft_s * 1000, output_tokens))
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
            if self.workers.knows(decode_worker):
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

    def observe_placement(self, placement: Placement) -> None:
        """One attempt's placement (a retry counts again)."""
        self.placements.labels(_site(placement.reason), placement.reason.value).inc()

    def observe_load(self, load: WorkerLoad) -> None:
        self.workers.observe(load)

    def watch_index(self, index: PrefixIndex) -> None:
        """Export the prefix index client's lookups and how many found Redis unavailable
        (`pdserve_prefix_index_lookups_total`, `..._unavailable_total`), read at scrape."""
        self.registry.register(_IndexCollector(index))

    def forget_worker(self, worker_id: str, role: str) -> None:
        self.workers.forget(worker_id)
        self._ttft.pop(worker_id, None)
        self._tpot.pop(worker_id, None)


def _site(reason: PrefillReason) -> str:
    return "local" if reason.local else "remote"


class _IndexCollector:
    """The router's prefix-index lookups (Redis down shows as lookups answered unavailable)."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "pdserve_prefix_index_lookups", "Prefix-index lookups", value=self._index.num_lookups
        )
        yield CounterMetricFamily(
            "pdserve_prefix_index_unavailable",
            "Prefix-index lookups and calls that found Redis unavailable (routed on load alone)",
            value=self._index.num_unavailable,
        )

    def describe(self) -> list[Metric]:
        return []
