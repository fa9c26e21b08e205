"""Both load drivers (Locust in its own process, and the asyncio driver) against a tiny fake
`Generation` servicer that lives in this file only: records, Locust events, failures with their
gRPC status, open-loop timing, conversation ordering, and the bench report files."""

from __future__ import annotations

import asyncio
import csv
import json
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from loadtests.bench import run_bench
from loadtests.goodput import SLO
from loadtests.load_driver import run_planned
from loadtests.records import RecordSink, read_records
from loadtests.workload import PlannedRequest, generate, load_profile
from pdserve.v1 import serving_pb2, serving_pb2_grpc

TTFT_S = 0.02
GAP_S = 0.002


class FakeGeneration(serving_pb2_grpc.GenerationServicer):
    """Streams `max_tokens` tokens, one per message; rejects every request whose index ends in
    4 (ids are "<profile>-<seed>-<index>") or whose tenant is "reject", with retry-after."""

    def Generate(self, request, context):
        if request.tenant == "reject" or request.request_id.endswith("4"):
            context.set_trailing_metadata((("retry-after-ms", "250"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "admission: overloaded")
        if not request.ignore_eos or not request.token_ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: required")
        time.sleep(TTFT_S)
        for i in range(request.max_tokens):
            last = i == request.max_tokens - 1
            yield serving_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=[100 + i],
                finish_reason=(
                    serving_pb2.FINISH_REASON_LENGTH
                    if last
                    else serving_pb2.FINISH_REASON_UNSPECIFIED
                ),
                usage=serving_pb2.Usage(
                    prompt_tokens=len(request.token_ids),
                    completion_tokens=request.max_tokens,
                    cached_prompt_tokens=16,
                )
                if last
                else None,
                timings=serving_pb2.Timings(queue_ms=1.5, ttft_ms=TTFT_S * 1000) if last else None,
            )
            time.sleep(GAP_S)


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    serving_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def small_workload(**kw: object) -> list[PlannedRequest]:
    args: dict[str, object] = {"rate": 20.0, "duration_s": 1.0, "seed": 0}
    args.update(kw)
    return generate(load_profile("synthetic"), num_requests=12, **args)  # type: ignore[arg-type]


# -- asyncio driver ----------------------------------------------------------------------------


def test_driver_records_every_request_with_its_timings(target: str, tmp_path: Path) -> None:
    planned = small_workload()
    sink = RecordSink(tmp_path / "records.jsonl")
    records = asyncio.run(run_planned(target, planned, offered_rate=20.0, timeout_s=30, sink=sink))
    sink.close()
    assert sorted(r.index for r in records) == [p.index for p in planned]
    assert read_records(tmp_path / "records.jsonl") == records
    by_index = {r.index: r for r in records}
    for p in planned:
        r = by_index[p.index]
        assert (r.request_id, r.prompt_tokens, r.max_tokens) == (
            p.request_id,
            p.prompt_tokens,
            p.max_tokens,
        )
        if p.request_id.endswith("4"):
            assert (r.status, r.retry_after_ms, r.output_tokens) == ("RESOURCE_EXHAUSTED", 250, 0)
            assert r.error == "admission: overloaded" and r.ttft_ms is None
            continue
        assert r.ok and r.output_tokens == p.max_tokens  # exact output length
        assert r.ttft_ms is not None and r.ttft_ms >= TTFT_S * 1000
        assert r.tpot_ms is not None and r.tpot_ms >= GAP_S * 1000 * 0.9
        assert len(r.itl_ms) == p.max_tokens - 1
        assert r.finish_reason == "FINISH_REASON_LENGTH"
        assert (r.cached_prompt_tokens, r.server_queue_ms, r.offered_rate) == (16, 1.5, 20.0)


def test_driver_is_open_loop_sends_on_schedule(target: str) -> None:
    planned = small_workload(rate=40.0)
    records = asyncio.run(run_planned(target, planned, timeout_s=30))
    lag = [r.sent_s - r.scheduled_s for r in records]
    assert min(lag) >= 0 and max(lag) < 0.1  # not held back by earlier, still-running requests


def test_driver_sends_a_turn_only_after_the_previous_one_completed(target: str) -> None:
    planned = generate(load_profile("multi_turn"), rate=10.0, duration_s=2.0, seed=0)
    assert any(p.after is not None for p in planned)
    records = {r.index: r for r in asyncio.run(run_planned(target, planned, timeout_s=30))}
    for p in planned:
        if p.after is not None:
            previous = records[p.after]
            assert records[p.index].sent_s >= previous.end_s + p.think_s - 0.005


def test_driver_reports_an_unreachable_server_as_unavailable() -> None:
    planned = small_workload()[:2]
    records = asyncio.run(run_planned("127.0.0.1:1", planned, timeout_s=5))
    assert [r.status for r in records] == ["UNAVAILABLE", "UNAVAILABLE"]


# -- Locust and the bench report ---------------------------------------------------------------


def locust_stats(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_locust_run_reports_per_request_events_and_failures(target: str, tmp_path: Path) -> None:
    start = time.monotonic()
    summary = run_bench(
        target,
        "synthetic",
        [20.0],
        "ttft:1000 tpot:100",
        1.0,
        tmp_path,
        use_locust=True,
        seed=0,
        num_requests=12,
        request_timeout_s=30.0,
        console=Console(file=open("/dev/null", "w")),  # noqa: SIM115
    )
    assert time.monotonic() - start < 30  # stopped by itself, not by the run-time limit
    run_dir = tmp_path / "rate-20"
    records = read_records(run_dir / "records.jsonl")
    planned = small_workload()
    assert sorted(r.request_id for r in records) == sorted(p.request_id for p in planned)
    failed = [r for r in records if not r.ok]
    assert {r.status for r in failed} == {"RESOURCE_EXHAUSTED"} and len(failed) == 1

    stats = locust_stats(run_dir / "locust_stats.csv")
    ok = len(records) - len(failed)
    assert int(stats["TTFT"]["Request Count"]) == ok
    assert int(stats["TPOT"]["Request Count"]) == ok
    assert int(stats["E2E"]["Request Count"]) == len(records)
    assert int(stats["E2E"]["Failure Count"]) == 1
    assert int(stats["ITL"]["Request Count"]) == sum(len(r.itl_ms) for r in records)
    tokens = sum(r.output_tokens for r in records)
    assert int(stats["tokens/output"]["Request Count"]) == ok
    assert float(stats["tokens/output"]["Average Response Time"]) == pytest.approx(tokens / ok)
    with (run_dir / "locust_failures.csv").open() as f:
        failures = list(csv.DictReader(f))
    assert [(row["Name"], row["Error"], row["Occurrences"]) for row in failures] == [
        ("E2E", "GrpcStatusError('RESOURCE_EXHAUSTED')", "1")
    ]
    assert (run_dir / "locust.html").stat().st_size > 10_000

    report = summary.reports[0]
    assert (report.requests, report.failed, report.good) == (12, 1, 11)
    assert summary.max_rate == 20.0 and summary.used_locust


def test_bench_with_the_asyncio_driver_writes_the_whole_report(target: str, tmp_path: Path) -> None:
    console = Console(record=True, width=100, file=open("/dev/null", "w"))  # noqa: SIM115
    summary = run_bench(
        target,
        "shared_prefix",
        [10.0, 40.0],
        # a TTFT nobody meets through the router (a TPOT of 1 ms alone was met on a loaded
        # machine, where tokens reach the client several at a time): attainment 0
        ["ttft:1", "tpot:1"],
        2.0,
        tmp_path,
        use_locust=False,
        num_requests=6,
        request_timeout_s=30.0,
        console=console,
    )
    assert summary.slo == SLO(ttft_ms=1.0, tpot_ms=1.0)
    assert [r.rate for r in summary.results] == [10.0, 40.0]
    assert all(r.report.good == 0 for r in summary.results)
    assert summary.max_rate is None
    for name in ("goodput.csv", "summary.json", "summary.txt", "ttft_tpot_cdf.png"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "goodput_vs_rate.png").read_bytes()[:4] == b"\x89PNG"
    assert set(summary.files) >= {tmp_path / "rate-10" / "records.jsonl", tmp_path / "goodput.csv"}
    with (tmp_path / "goodput.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["rate"], row["good"]) for row in rows] == [("10.0", "0"), ("40.0", "0")]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["profile"] == "shared_prefix" and data["max_rate"] is None
    assert data["reports"][0]["requests"] == 6
    text = (tmp_path / "summary.txt").read_text()
    assert "SLO ttft:1 tpot:1" in text and "none of the rates tried" in text
    assert "SLO ttft:1 tpot:1" in console.export_text()


def test_bench_refuses_bad_arguments_before_running(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rate"):
        run_bench("x:1", "synthetic", [], "ttft:1", 1.0, tmp_path)
    with pytest.raises(ValueError, match="slo"):
        run_bench("x:1", "synthetic", 1.0, "ttft=1", 1.0, tmp_path)
    with pytest.raises(ValueError, match="profile"):
        run_bench("x:1", "nonesuch", 1.0, "ttft:1", 1.0, tmp_path)
    assert not list(tmp_path.iterdir())
