"""Every inter-token gap of a simulated run (the load driver's ITL samples), kept without a
list of token times per request: a request holds its first and last token time and its token
count (all TTFT, TPOT and E2E read), and the run's gaps are counted here.

Most gaps are a decode step: every request of a step that also ran in the step before it has
that step's duration as its gap, so a plain worker's step adds its duration once with the
count of those requests (`add_many`, keyed by the duration: the distinct durations are the
distinct (batch, context) a curve was read at, not the steps). The others (a request's first
decode token after its hand-off, one that waited out steps, a split or shared-device worker's
step) are added one by one (`add`, 8 bytes each). The duration stands in for the difference of
the two token times it separates: the same up to float rounding.
"""

from __future__ import annotations

from array import array

import numpy as np

from loadtests.goodput import LatencyStats


class TokenGaps:
    """The multiset of a run's inter-token gaps (seconds)."""

    def __init__(self) -> None:
        self.weighted: dict[float, int] = {}
        """gap → how many times it occurred."""
        self.single = array("d")
        """Gaps counted once each."""

    def add(self, gap_s: float) -> None:
        self.single.append(gap_s)

    def add_many(self, gap_s: float, count: int) -> None:
        weighted = self.weighted
        weighted[gap_s] = weighted.get(gap_s, 0) + count

    @property
    def count(self) -> int:
        return len(self.single) + sum(self.weighted.values())

    def stats_ms(self) -> LatencyStats:
        """`LatencyStats.of` over every gap in milliseconds (its percentiles: linear
        interpolation between ranks), computed over (value, count) pairs."""
        singles = np.frombuffer(self.single, dtype=np.float64) if self.single else np.empty(0)
        values = np.concatenate([singles, np.fromiter(self.weighted, np.float64)]) * 1000.0
        counts = np.concatenate([np.ones(len(singles), np.int64),
                                 np.fromiter(self.weighted.values(), np.int64)])  # fmt: skip
        if not len(values):
            return LatencyStats.of([])
        order = np.argsort(values, kind="stable")
        values, counts = values[order], counts[order]
        ends = np.cumsum(counts)
        n = int(ends[-1])

        def at_rank(k: int) -> float:
            return float(values[int(np.searchsorted(ends, k, side="right"))])

        def percentile(q: float) -> float:
            rank = (n - 1) * q / 100.0
            low = int(np.floor(rank))
            high = min(low + 1, n - 1)
            lo = at_rank(low)
            return lo + (at_rank(high) - lo) * (rank - low)

        return LatencyStats(
            count=n,
            mean=float(np.dot(values, counts)) / n,
            p50=percentile(50),
            p90=percentile(90),
            p95=percentile(95),
            p99=percentile(99),
            max=float(values[-1]),
        )
