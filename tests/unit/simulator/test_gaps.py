"""The run's gap count (simulator/gaps.py) holds every inter-token gap the requests' traced
token times give, and its statistics are `LatencyStats.of` over them (float tolerance 1e-9
relative: a step's duration stands in for the difference of two token times)."""

from __future__ import annotations

import itertools

import pytest
from golden import SCENARIOS
from sim_profiles import tiny_cpu_profile

from loadtests.goodput import LatencyStats
from loadtests.workload import generate, load_profile
from simulator.cluster import Simulation
from simulator.gaps import TokenGaps


def test_weighted_and_single_gaps_give_the_statistics_of_the_whole_list() -> None:
    gaps = TokenGaps()
    for g in (0.004, 0.001, 0.009):
        gaps.add(g)
    gaps.add_many(0.002, 3)
    gaps.add_many(0.007, 2)
    gaps.add_many(0.002, 1)
    listed = [4.0, 1.0, 9.0] + [2.0] * 4 + [7.0] * 2
    assert gaps.count == 9
    assert gaps.stats_ms() == pytest.approx(LatencyStats.of(listed))


def test_no_gaps_give_the_empty_statistics() -> None:
    assert TokenGaps().stats_ms().count == 0


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_runs_gaps_are_the_traced_token_times_gaps(name: str) -> None:
    workload, rate, duration, shape = SCENARIOS[name]
    planned = generate(load_profile(workload), rate=rate, duration_s=duration, seed=0)
    sim = Simulation(tiny_cpu_profile(), shape, trace_tokens=True)
    done = sim.run(planned)
    traced = [(b - a) * 1000.0 for r in done for a, b in itertools.pairwise(r.token_times or ())]
    assert len(traced) > 100
    assert sim.gaps.count == len(traced)
    got, want = sim.gaps.stats_ms(), LatencyStats.of(traced)
    for field in ("mean", "p50", "p90", "p95", "p99", "max"):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-9), field
