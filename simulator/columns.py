"""A simulated run's records kept as they end, as numbers: what `loadtests.goodput.summarize`
reads of each record, in compact columns (8 bytes a number) rather than a `RequestRecord`
each (~1 KB with its request), so an hour of traffic fits in memory; the report is the one
`summarize` gives over the records, bit for bit (the latencies are summarized in the records'
order, by index, as the run's records list them)."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import replace

import numpy as np

from loadtests.goodput import SLO, GoodputReport, LatencyStats, summarize
from loadtests.records import RequestRecord

NONE = math.nan
"""A latency a record does not have (not served, no first token, one token: no TPOT)."""


class RecordColumns:
    """The records of one run at one offered rate, against one SLO."""

    def __init__(self, slo: SLO, offered_rate: float | None) -> None:
        self.slo = slo
        self.offered_rate = offered_rate
        self._index = array("q")
        self._ttft = array("d")
        self._tpot = array("d")
        self._e2e = array("d")
        """Served requests' latencies, ms (others: NONE)."""
        self._first_sent_s = math.inf
        self._last_end_s = -math.inf
        self._good = 0
        self._completed = 0
        self._output_tokens = 0
        self._failures: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._index)

    def add(self, record: RequestRecord) -> None:
        self._index.append(record.index)
        self._first_sent_s = min(self._first_sent_s, record.sent_s)
        self._last_end_s = max(self._last_end_s, record.end_s)
        self._good += self.slo.met_by(record)
        if not record.ok:
            self._failures[record.status] += 1
            for column in (self._ttft, self._tpot, self._e2e):
                column.append(NONE)
            return
        self._completed += 1
        self._output_tokens += record.output_tokens
        self._ttft.append(NONE if record.ttft_ms is None else record.ttft_ms)
        self._tpot.append(NONE if record.tpot_ms is None else record.tpot_ms)
        self._e2e.append(record.e2e_ms)

    def report(self, itl: LatencyStats) -> GoodputReport:
        """`summarize` over the records added, with the run's inter-token gaps' `itl` (a
        simulated record carries none: simulator/gaps.py)."""
        requests = len(self._index)
        duration = self._last_end_s - self._first_sent_s if requests else 0.0
        base = summarize([], self.slo, duration_s=duration, offered_rate=self.offered_rate)
        per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
        order = np.argsort(np.frombuffer(self._index, dtype=np.int64), kind="stable")
        return replace(
            base,
            requests=requests,
            completed=self._completed,
            failed=requests - self._completed,
            good=self._good,
            goodput_rps=per_s(self._good),
            attainment=self._good / requests if requests else 0.0,
            throughput_rps=per_s(self._completed),
            output_tokens_per_s=per_s(self._output_tokens),
            ttft=_stats(self._ttft, order),
            tpot=_stats(self._tpot, order),
            itl=itl,
            e2e=_stats(self._e2e, order),
            failures=tuple(sorted(self._failures.items(), key=lambda kv: (-kv[1], kv[0]))),
        )


def _stats(column: array, order: np.ndarray) -> LatencyStats:
    values = np.frombuffer(column, dtype=np.float64)[order]
    return LatencyStats.of(values[~np.isnan(values)].tolist())
