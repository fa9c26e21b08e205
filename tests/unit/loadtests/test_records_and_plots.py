"""Per-request measurement (StreamTimer), JSONL records, and the PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtests.goodput import SLO, summarize
from loadtests.plots import plot_goodput_against_tpot_slo, plot_goodput_sweep, plot_latency_cdfs
from loadtests.records import (
    RecordSink,
    RequestRecord,
    StreamTimer,
    read_records,
    write_records,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_stream_timer_measures_ttft_tpot_itl_and_e2e() -> None:
    timer = StreamTimer(sent_at=10.0)
    assert timer.on_message(10.0, 0) is False  # an empty message is not a token
    assert timer.on_message(10.2, 1) is True  # first token: TTFT 200 ms
    assert timer.on_message(10.25, 1) is False
    assert timer.on_message(10.4, 3) is False  # three tokens in one message
    assert timer.on_message(10.5, 0) is False  # the final message with usage only
    assert timer.output_tokens == 5
    assert timer.ttft_ms == pytest.approx(200.0)
    assert timer.tpot_ms == pytest.approx(50.0)  # (10.4 - 10.2) s over 4 tokens after the first
    assert timer.itl_ms == pytest.approx((50.0, 150.0))
    assert timer.e2e_ms(10.5) == pytest.approx(500.0)


def test_stream_timer_without_tokens_or_with_one() -> None:
    timer = StreamTimer(sent_at=0.0)
    assert (timer.ttft_ms, timer.tpot_ms, timer.itl_ms) == (None, None, ())
    timer.on_message(0.1, 1)
    assert timer.ttft_ms == pytest.approx(100.0) and timer.tpot_ms is None


def make_record(i: int, **kw: object) -> RequestRecord:
    values: dict[str, object] = dict(
        request_id=f"r{i}", index=i, sent_s=i * 0.5, scheduled_s=i * 0.5, prompt_tokens=10,
        max_tokens=5, output_tokens=5, e2e_ms=300.0 + 10 * i, ttft_ms=50.0 + 5 * i,
        tpot_ms=20.0 + i, itl_ms=(20.0, 21.0), offered_rate=2.0,
    )  # fmt: skip
    values.update(kw)
    return RequestRecord(**values)  # type: ignore[arg-type]


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    records = [
        make_record(0),
        make_record(1, status="RESOURCE_EXHAUSTED", error="busy", retry_after_ms=250.0,
                    ttft_ms=None, tpot_ms=None, itl_ms=(), output_tokens=0),
        make_record(2, conversation=3, turn=1, finish_reason="FINISH_REASON_LENGTH"),
    ]  # fmt: skip
    path = tmp_path / "r.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    assert records[0].ok and not records[1].ok
    assert records[0].end_s == pytest.approx(0.3)


def test_reading_ignores_unknown_fields_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    line = make_record(0).to_json().replace("{", '{"future_field":1,', 1)
    path.write_text(line + "\n\n")
    assert read_records(path) == [make_record(0)]


def test_sink_appends_one_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    for i in range(2):
        sink = RecordSink(path)
        sink.write(make_record(i))
        sink.close()
    assert [r.index for r in read_records(path)] == [0, 1]
    RecordSink(None).write(make_record(0))  # no path: records go nowhere


def test_cdf_and_sweep_plots_are_written_as_png(tmp_path: Path) -> None:
    slo = SLO(ttft_ms=60.0, tpot_ms=22.0)
    low = [make_record(i) for i in range(10)]
    high = [make_record(i, ttft_ms=80.0 + i, offered_rate=4.0) for i in range(10)]
    cdf = plot_latency_cdfs([("2 req/s", low), ("4 req/s", high)], slo, tmp_path / "cdf.png")
    reports = [summarize(low, slo, offered_rate=2.0), summarize(high, slo, offered_rate=4.0)]
    sweep = plot_goodput_sweep(reports, tmp_path / "sweep.png", 0.5)
    series = [("a", [(2.0, low), (4.0, high)]), ("b (fails everywhere)", [(4.0, high)])]
    against = plot_goodput_against_tpot_slo(
        series, 60.0, [10.0, 22.0, 40.0], tmp_path / "against.png", "title"
    )
    for path in (cdf, sweep, against):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plots_survive_runs_where_everything_failed(tmp_path: Path) -> None:
    failed = [make_record(0, status="UNAVAILABLE", ttft_ms=None, tpot_ms=None)]
    slo = SLO(ttft_ms=1.0)
    plot_latency_cdfs([("1 req/s", failed)], slo, tmp_path / "cdf.png")
    report = summarize(failed, slo, offered_rate=1.0)
    assert math.isnan(report.ttft.p50)
    plot_goodput_sweep([report], tmp_path / "sweep.png")
    plot_goodput_sweep([], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").read_bytes().startswith(PNG_MAGIC)
