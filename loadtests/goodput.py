"""Goodput: how many requests per second meet every SLO, and the percentiles behind it. Pure.

SLOs are given vLLM-style, `ttft:MS tpot:MS` (and optionally `e2el:MS`). A request is *good*
when it succeeded and each given SLO holds (a one-token request has no TPOT and passes that
SLO). Goodput is good requests / run duration; attainment is good / all requests sent, failures
included. Across a rate sweep, `max_rate_meeting` finds the highest offered rate at which at
least a target fraction of requests is good.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loadtests.records import RequestRecord
from vocabulary.numeric import percentile


class SLOError(ValueError):
    """An SLO string is malformed (the message shows the accepted form)."""


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def describe(self) -> str:
        parts = [
            f"{name}:{value:g}"
            for name, value in (
                ("ttft", self.ttft_ms),
                ("tpot", self.tpot_ms),
                ("e2el", self.e2e_ms),
            )
            if value is not None
        ]
        return " ".join(parts) or "none"

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft_ms is None or record.ttft_ms > self.ttft_ms):
            return False
        tpot = record.tpot_ms
        if self.tpot_ms is not None and tpot is not None and tpot > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e_ms <= self.e2e_ms


_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms", "e2e": "e2e_ms"}


def parse_slo(spec: str | Sequence[str]) -> SLO:
    """`"ttft:500 tpot:50"` or `["ttft:500", "tpot:50"]` -> SLO(500, 50)."""
    items = spec.split() if isinstance(spec, str) else [p for s in spec for p in s.split()]
    values: dict[str, float] = {}
    for item in items:
        name, sep, number = item.partition(":")
        if not sep or name.lower() not in _KEYS:
            raise SLOError(f"slo: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            value = float(number)
        except ValueError as e:
            raise SLOError(f"slo: {name} needs a number of ms, got {number!r}") from e
        if not value > 0:
            raise SLOError(f"slo: {name} must be > 0 ms, got {value:g}")
        values[_KEYS[name.lower()]] = value
    if not values:
        raise SLOError("slo: give at least one of ttft:MS tpot:MS e2el:MS")
    return SLO(**values)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds; NaN when there were no values."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(0, *([math.nan] * 6))
        return cls(
            count=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p95=percentile(values, 95),
            p99=percentile(values, 99),
            max=max(values),
        )


@dataclass(frozen=True)
class GoodputReport:
    """The outcome of one run at one offered rate."""

    slo: SLO
    offered_rate: float | None
    duration_s: float
    requests: int
    completed: int
    failed: int
    good: int
    goodput_rps: float
    """Requests meeting every SLO per second of run."""
    attainment: float
    """Fraction of all requests that met every SLO."""
    throughput_rps: float
    """Completed requests per second."""
    output_tokens_per_s: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    failures: tuple[tuple[str, int], ...] = ()
    """(gRPC status, count), most frequent first."""


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """First send to last completion."""
    if not records:
        return 0.0
    return max(r.end_s for r in records) - min(r.sent_s for r in records)


def summarize(
    records: Sequence[RequestRecord],
    slo: SLO,
    *,
    duration_s: float | None = None,
    offered_rate: float | None = None,
) -> GoodputReport:
    """Goodput and latency percentiles of one run (duration: first send to last completion)."""
    duration = run_duration_s(records) if duration_s is None else duration_s
    ok = [r for r in records if r.ok]
    good = sum(1 for r in records if slo.met_by(r))
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    failures = Counter(r.status for r in records if not r.ok)
    return GoodputReport(
        slo=slo,
        offered_rate=offered_rate,
        duration_s=duration,
        requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        good=good,
        goodput_rps=per_s(good),
        attainment=good / len(records) if records else 0.0,
        throughput_rps=per_s(len(ok)),
        output_tokens_per_s=per_s(sum(r.output_tokens for r in ok)),
        ttft=LatencyStats.of([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        tpot=LatencyStats.of([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_ms]),
        e2e=LatencyStats.of([r.e2e_ms for r in ok]),
        failures=tuple(sorted(failures.items(), key=lambda kv: (-kv[1], kv[0]))),
    )


def by_rate(reports: Iterable[GoodputReport]) -> list[tuple[float, GoodputReport]]:
    """(offered rate, report) in increasing rate; reports without a rate are left out."""
    rated = [(r.offered_rate, r) for r in reports if r.offered_rate is not None]
    return sorted(rated, key=lambda pair: pair[0])


def max_rate_meeting(reports: Iterable[GoodputReport], attainment: float = 0.9) -> float | None:
    """Highest offered rate at which >= `attainment` of requests met the SLOs, scanning rates
    upward and stopping at the first that fails (a later lucky pass does not count).
    None when even the lowest rate fails."""
    best = None
    for rate, report in by_rate(reports):
        if report.attainment + 1e-12 < attainment:
            break
        best = rate
    return best


def goodput_curve(
    runs: Sequence[tuple[float, Sequence[RequestRecord]]],
    ttft_ms: float,
    tpot_slos_ms: Sequence[float],
    attainment: float = 0.9,
) -> list[float | None]:
    """For each TPOT SLO, the highest rate of a sweep ([(rate, records)]) at which
    `attainment` of requests meet it and TTFT <= `ttft_ms` (`max_rate_meeting`; None where
    even the lowest rate fails)."""
    return [
        max_rate_meeting(
            [
                summarize(records, SLO(ttft_ms=ttft_ms, tpot_ms=tpot), offered_rate=rate)
                for rate, records in runs
            ],
            attainment,
        )
        for tpot in tpot_slos_ms
    ]
