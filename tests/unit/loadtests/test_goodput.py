"""Goodput, SLO parsing and latency summaries on hand-made samples (the percentile helper
itself is planner.core's, tested there)."""

from __future__ import annotations

import math

import pytest

from loadtests.goodput import (
    SLO,
    GoodputReport,
    LatencyStats,
    SLOError,
    by_rate,
    goodput_curve,
    max_rate_meeting,
    parse_slo,
    run_duration_s,
    summarize,
)
from loadtests.records import RequestRecord


def rec(
    i: int,
    *,
    ttft: float | None = 100.0,
    tpot: float | None = 10.0,
    sent: float = 0.0,
    e2e: float = 1000.0,
    out: int = 50,
    status: str = "OK",
    itl: tuple[float, ...] = (),
) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{i}",
        index=i,
        sent_s=sent,
        scheduled_s=sent,
        prompt_tokens=100,
        max_tokens=out,
        output_tokens=out if status == "OK" else 0,
        e2e_ms=e2e,
        ttft_ms=ttft,
        tpot_ms=tpot,
        itl_ms=itl,
        status=status,
    )


# -- SLO parsing -------------------------------------------------------------------------------


def test_parse_slo_vllm_style() -> None:
    assert parse_slo("ttft:500 tpot:50") == SLO(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_slo(["ttft:500", "tpot:50"]) == SLO(500.0, 50.0)
    assert parse_slo(["TTFT:200.5"]) == SLO(ttft_ms=200.5)
    assert parse_slo("e2el:3000 tpot:20") == SLO(tpot_ms=20.0, e2e_ms=3000.0)
    assert parse_slo("ttft:500 tpot:50").describe() == "ttft:500 tpot:50"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ttft500", "expected ttft:MS"),
        ("latency:5", "expected ttft:MS"),
        ("ttft:fast", "needs a number"),
        ("ttft:0", "must be > 0"),
        ("tpot:-3", "must be > 0"),
        ("", "at least one"),
    ],
)
def test_bad_slo_is_refused_with_the_accepted_form(spec: str, message: str) -> None:
    with pytest.raises(SLOError, match=message):
        parse_slo(spec)


# -- one request against an SLO ----------------------------------------------------------------


def test_request_meets_the_slo_only_if_every_limit_holds() -> None:
    slo = SLO(ttft_ms=100.0, tpot_ms=10.0)
    assert slo.met_by(rec(0, ttft=100.0, tpot=10.0))  # limits are inclusive
    assert not slo.met_by(rec(0, ttft=100.1, tpot=5.0))
    assert not slo.met_by(rec(0, ttft=50.0, tpot=10.1))
    assert not slo.met_by(rec(0, status="RESOURCE_EXHAUSTED"))
    assert not slo.met_by(rec(0, ttft=None))  # no token ever arrived


def test_single_token_request_has_no_tpot_and_passes_that_limit() -> None:
    assert SLO(ttft_ms=100.0, tpot_ms=10.0).met_by(rec(0, tpot=None, out=1))


def test_unset_limits_are_not_checked() -> None:
    assert SLO(tpot_ms=10.0).met_by(rec(0, ttft=10_000.0))
    assert not SLO(e2e_ms=999.0).met_by(rec(0, e2e=1000.0))


# -- summaries ---------------------------------------------------------------------------------


def test_latency_stats_of_hand_made_values() -> None:
    stats = LatencyStats.of([4.0, 1.0, 3.0, 2.0])
    assert (stats.count, stats.mean, stats.p50, stats.max) == (4, 2.5, 2.5, 4.0)
    assert (stats.p90, stats.p95, stats.p99) == pytest.approx((3.7, 3.85, 3.97))
    empty = LatencyStats.of([])
    assert empty.count == 0 and math.isnan(empty.p50)


def test_goodput_of_a_hand_made_run() -> None:
    slo = SLO(ttft_ms=200.0, tpot_ms=20.0)
    records = [
        rec(0, ttft=100.0, tpot=10.0, sent=0.0, e2e=1000.0, itl=(10.0, 10.0)),  # good
        rec(1, ttft=150.0, tpot=15.0, sent=1.0, e2e=1000.0, itl=(20.0,)),  # good
        rec(2, ttft=300.0, tpot=10.0, sent=2.0, e2e=1500.0),  # TTFT too slow
        rec(3, ttft=100.0, tpot=25.0, sent=3.0, e2e=2000.0, out=10),  # TPOT too slow
        rec(4, sent=4.0, e2e=5.0, ttft=None, tpot=None, status="RESOURCE_EXHAUSTED"),
        rec(5, sent=4.5, e2e=500.0, ttft=180.0, tpot=None, out=1),  # one token: good
        rec(6, sent=4.6, e2e=3.0, ttft=None, tpot=None, status="RESOURCE_EXHAUSTED"),
        rec(7, sent=4.7, e2e=10.0, ttft=None, tpot=None, status="UNAVAILABLE"),
    ]
    report = summarize(records, slo, offered_rate=1.5)
    assert run_duration_s(records) == 5.0  # first send 0.0 -> last completion 3.0 + 2.0
    assert (report.requests, report.completed, report.failed, report.good) == (8, 5, 3, 3)
    assert report.duration_s == 5.0
    assert report.goodput_rps == pytest.approx(0.6)
    assert report.attainment == pytest.approx(3 / 8)
    assert report.throughput_rps == pytest.approx(1.0)
    assert report.output_tokens_per_s == pytest.approx((50 + 50 + 50 + 10 + 1) / 5.0)
    assert report.ttft == LatencyStats.of([100.0, 150.0, 300.0, 100.0, 180.0])
    assert report.tpot == LatencyStats.of([10.0, 15.0, 10.0, 25.0])
    assert report.itl == LatencyStats.of([10.0, 10.0, 20.0])
    assert report.e2e.max == 2000.0
    assert report.failures == (("RESOURCE_EXHAUSTED", 2), ("UNAVAILABLE", 1))
    assert report.offered_rate == 1.5 and report.slo == slo


def test_explicit_duration_overrides_the_measured_one() -> None:
    report = summarize([rec(0), rec(1)], SLO(ttft_ms=500.0), duration_s=4.0)
    assert report.goodput_rps == 0.5


def test_empty_run_reports_zeros_not_errors() -> None:
    report = summarize([], SLO(ttft_ms=1.0))
    assert (report.requests, report.goodput_rps, report.attainment) == (0, 0.0, 0.0)


# -- sweeps ------------------------------------------------------------------------------------


def report_at(rate: float | None, attainment: float) -> GoodputReport:
    empty = LatencyStats.of([])
    return GoodputReport(
        SLO(ttft_ms=1.0), rate, 1.0, 100, 100, 0, round(attainment * 100),
        attainment * rate if rate else 0.0, attainment, 1.0, 1.0, empty, empty, empty, empty,
    )  # fmt: skip


def test_max_rate_is_the_highest_rate_before_the_first_failing_one() -> None:
    sweep = [report_at(8, 0.95), report_at(1, 1.0), report_at(4, 0.85), report_at(2, 0.9)]
    assert max_rate_meeting(sweep, 0.9) == 2  # 8 passes again, but after 4 failed
    assert max_rate_meeting(sweep, 0.8) == 8
    assert max_rate_meeting(sweep, 0.99) == 1
    assert max_rate_meeting([report_at(1, 0.5)], 0.9) is None
    assert max_rate_meeting([], 0.9) is None


def test_reports_without_a_rate_are_left_out_of_sweeps() -> None:
    sweep = [report_at(None, 1.0), report_at(3, 1.0)]
    assert [rate for rate, _ in by_rate(sweep)] == [3]
    assert max_rate_meeting(sweep) == 3


def test_goodput_curve_is_the_highest_rate_meeting_each_tpot_slo() -> None:
    # rate 2: TPOT 12 ms for all; rate 4: 18 ms for 9 of 10 and 30 ms for one; rate 8: TTFT
    # over the SLO for half
    runs = [
        (2.0, [rec(i, tpot=12.0) for i in range(10)]),
        (4.0, [rec(i, tpot=18.0 if i else 30.0) for i in range(10)]),
        (8.0, [rec(i, tpot=18.0, ttft=3000.0 if i % 2 else 100.0) for i in range(10)]),
    ]
    assert goodput_curve(runs, 1000.0, [10.0, 15.0, 20.0, 40.0]) == [None, 2.0, 4.0, 4.0]
    assert goodput_curve(runs, 5000.0, [20.0, 40.0]) == [8.0, 8.0]  # TTFT no longer binds
    assert goodput_curve(runs, 1000.0, [20.0], attainment=1.0) == [2.0]  # 9 of 10 is not all
