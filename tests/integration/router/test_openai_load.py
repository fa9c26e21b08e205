"""`pdserve bench --api openai` against the real cluster's HTTP API: the Locust HTTP user
(SSE streaming, TTFT at the first content chunk, TPOT over the tokens the chunks carry) and
the asyncio driver write the same records as over gRPC, every request served exactly."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from router_harness import RouterCluster
from typer.testing import CliRunner

from loadtests.records import read_records

REQUESTS = 6


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tiny", "kind": "synthetic", "seed": 0, "vocab": {"low": 10, "high": 500},
        "prompt_tokens": {"median": 24, "sigma": 0.3, "min": 8, "max": 64},
        "output_tokens": {"median": 6, "sigma": 0.2, "min": 4, "max": 10},
        "arrival": {"process": "poisson"}, "temperature": 0.0,
    }))  # fmt: skip
    return path


def bench(rc: RouterCluster, profile: Path, out: Path, *extra: str) -> dict[str, object]:
    from deploy.cli.app import app

    args = ["bench", "--api", "openai", "--target", rc.targets[0],
            "--admin-target", rc.admin_targets[0], "--profile", str(profile),
            "--rate", "4", "--duration", "2", "--num-requests", str(REQUESTS),
            "--slo", "ttft:5000", "--slo", "tpot:1000", "--out", str(out), *extra]  # fmt: skip
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "openai API" in result.output
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    assert summary["api"] == "openai"
    (report,) = summary["reports"]  # type: ignore[misc]
    assert (report["requests"], report["completed"], report["failed"]) == (REQUESTS,) * 2 + (0,)
    records = read_records(out / "rate-4" / "records.jsonl")
    assert len(records) == REQUESTS
    for r in records:
        assert r.ok and r.output_tokens == r.max_tokens, r
        assert r.finish_reason == "FINISH_REASON_LENGTH", r
        assert r.ttft_ms is not None and 0 < r.ttft_ms < r.e2e_ms, r
        assert r.tpot_ms is not None, r
    # each chunk timed as it arrived: a client that buffered the stream would see ~0 for all
    # (one stream on a busy machine may arrive in one burst: most must not)
    spaced = [r for r in records if r.tpot_ms is not None and r.tpot_ms > 1.0]
    assert len(spaced) * 2 >= len(records), [r.tpot_ms for r in records]
    return summary


def test_locust_http_user_streams_and_measures_ttft_and_tpot(
    router_cluster: RouterCluster, profile: Path, tmp_path: Path
) -> None:
    summary = bench(router_cluster, profile, tmp_path / "locust")
    assert summary["used_locust"] is True
    with (tmp_path / "locust" / "rate-4" / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    for name in ("TTFT", "TPOT", "E2E"):
        assert rows[name]["Type"] == "openai"
        assert int(rows[name]["Request Count"]) == REQUESTS, rows[name]
        assert int(rows[name]["Failure Count"]) == 0
    router_cluster.wait_idle()


def test_asyncio_driver_sends_the_same_workload_over_http(
    router_cluster: RouterCluster, profile: Path, tmp_path: Path
) -> None:
    summary = bench(router_cluster, profile, tmp_path / "asyncio", "--no-locust")
    assert summary["used_locust"] is False
    router_cluster.wait_idle()
