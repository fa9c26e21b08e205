"""A run pulled from the lazy workload and summarized as requests end: the same requests as a
run over the whole workload list, and the same report as `summarize` over every record."""

from __future__ import annotations

import math

import pytest
from golden import SCENARIOS, outcome
from golden import run as run_listed
from sim_profiles import tiny_cpu_profile

from admission.config import AdmissionThresholds
from loadtests.goodput import parse_slo, summarize
from loadtests.workload import load_profile, stream
from simulator.cluster import Simulation
from simulator.report import run_summarized
from simulator.shape import ClusterShape
from simulator.workers import SimRequest


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_streamed_run_serves_every_request_as_the_listed_run(name: str) -> None:
    workload, rate, duration, shape = SCENARIOS[name]
    planned = stream(load_profile(workload), rate=rate, duration_s=duration, seed=0)
    sim = Simulation(tiny_cpu_profile(), shape, trace_tokens=True)
    ended: list[SimRequest] = []
    assert sim.run(planned, on_end=ended.append) == []
    assert sim.requests == [] and sim.finished == []
    streamed = [outcome(r) for r in sorted(ended, key=lambda r: r.planned.index)]
    assert streamed == run_listed(name)


@pytest.mark.parametrize(
    ("workload", "rate", "shape"),
    [
        # refusals: a small in-flight limit and a short queue
        ("synthetic", 60.0, ClusterShape(1, 1, kv_blocks=256, thresholds=AdmissionThresholds(
            max_inflight_requests=8, max_queue_wait_ms=50))),
        ("multi_turn", 15.0, ClusterShape(1, 2, kv_blocks=256)),
    ],
)  # fmt: skip
def test_the_summary_of_the_columns_is_summarize_over_the_records(
    workload: str, rate: float, shape: ClusterShape
) -> None:
    slo = parse_slo("ttft:300 tpot:40")
    sim = Simulation(tiny_cpu_profile(), shape)
    planned = stream(load_profile(workload), rate=rate, duration_s=8.0, seed=2)
    result = run_summarized(sim, planned, slo, rate, keep_records=True)
    records = list(result.records)
    assert [r.index for r in records] == sorted(r.index for r in records)
    want = summarize(records, slo, offered_rate=rate)
    assert 0 < want.good < want.requests  # the SLO splits the requests
    if workload == "synthetic":
        assert want.failures and want.failures[0][0] == "RESOURCE_EXHAUSTED"
    got = result.report
    assert got.itl == sim.gaps.stats_ms()
    for name in ("slo", "offered_rate", "duration_s", "requests", "completed", "failed",
                 "good", "goodput_rps", "attainment", "throughput_rps",
                 "output_tokens_per_s", "ttft", "tpot", "e2e", "failures"):  # fmt: skip
        assert getattr(got, name) == getattr(want, name), name
    assert not math.isnan(got.tpot.mean)
