"""The predictive planner's claim (issue 43), held on the simulated ramp-and-burst trace of
`python -m benchmarks planner` at 40 req/s (seed 0; docs/benchmarks.md, "Planner"): at most half
the SLO-violating requests of the reactive rules, at no more worker-seconds."""

from __future__ import annotations

import pytest

from benchmarks.suites.planner import PROFILE, compare, starting_shape, trace
from loadtests.goodput import parse_slo
from planner.perf_profile import load_perf_profile
from planner.predictive import PlannerMode


def test_the_predictive_planner_halves_the_violations_at_no_more_worker_seconds() -> None:
    got = compare(
        load_perf_profile(PROFILE), trace(40.0, 0), parse_slo(["ttft:200", "tpot:20"]),
        starting_shape(1, 1),
    )  # fmt: skip
    reactive, predictive = got[PlannerMode.REACTIVE], got[PlannerMode.PREDICTIVE]
    assert reactive.requests == predictive.requests == 9343
    assert 2 * predictive.violating <= reactive.violating
    assert predictive.worker_seconds <= reactive.worker_seconds
    # the figures docs/benchmarks.md gives
    assert (reactive.violating, predictive.violating) == (2101, 102)
    assert reactive.worker_seconds == pytest.approx(3067, abs=1)
    assert predictive.worker_seconds == pytest.approx(2272, abs=1)
