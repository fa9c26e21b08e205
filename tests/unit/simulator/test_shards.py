"""A sharded simulation (simulator/shards.py): the shard's shape, the report scaled back, and
its agreement with the whole cluster where the approximation holds (a pool of 8 + 8 workers,
not saturated) and where it does not (a shard of one prefill worker near saturation)."""

from __future__ import annotations

import re

import pytest
from sim_profiles import make_profile, tiny_cpu_profile

from admission.config import AdmissionThresholds
from loadtests.goodput import parse_slo
from simulator.plan import simulator_for
from simulator.report import simulate
from simulator.shape import ClusterShape
from simulator.shards import largest_shards, scale_report, shard_shape

SLO = parse_slo("ttft:60 tpot:12")


def test_a_shard_holds_each_role_and_the_in_flight_limit_over_k() -> None:
    shape = ClusterShape(8, 16, 4, thresholds=AdmissionThresholds(max_inflight_requests=30))
    shard = shard_shape(shape, 4)
    assert (shard.prefill, shard.decode, shard.colocated) == (2, 4, 1)
    assert shard.thresholds.max_inflight_requests == 8  # 30 / 4, rounded up
    assert shard_shape(shape, 1) == shape


@pytest.mark.parametrize(
    ("shape", "k", "message"),
    [
        (ClusterShape(4, 6), 4, re.escape("--shards: 4 does not divide every role's workers "
                                          "(prefill 4, decode 6)")),
        (ClusterShape(0, 0, 3), 2, r"\(colocated 3\)"),
        (ClusterShape(2, 2), 0, "--shards: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_a_k_that_does_not_divide_the_roles_is_refused(
    shape: ClusterShape, k: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        shard_shape(shape, k)


def test_the_report_scales_counts_and_rates_and_keeps_latencies_and_attainment() -> None:
    one = simulate(make_profile(), ClusterShape(1, 1), "synthetic", 4.0, 10.0, SLO).report
    scaled = scale_report(one, 8)
    assert (scaled.requests, scaled.good, scaled.completed) == (
        8 * one.requests, 8 * one.good, 8 * one.completed)  # fmt: skip
    assert scaled.goodput_rps == 8 * one.goodput_rps
    assert scaled.output_tokens_per_s == 8 * one.output_tokens_per_s
    assert (scaled.ttft, scaled.tpot, scaled.attainment) == (one.ttft, one.tpot, one.attainment)


def test_plan_shards_only_what_keeps_enough_workers_a_shard() -> None:
    assert largest_shards(ClusterShape(128, 128), 16, 4) == 16
    assert largest_shards(ClusterShape(128, 128), 64, 4) == 32
    assert largest_shards(ClusterShape(12, 20), 16, 4) == 2  # 4 would leave 3 prefill
    assert largest_shards(ClusterShape(3, 5), 16, 4) == 1


def test_a_shard_of_a_pool_agrees_with_the_whole_cluster() -> None:
    shape = ClusterShape(8, 8)
    whole = simulate(tiny_cpu_profile(), shape, "synthetic", 80.0, 60.0, SLO, seed=1,
                     keep_records=False).report  # fmt: skip
    half = simulate(tiny_cpu_profile(), shape, "synthetic", 80.0, 60.0, SLO, seed=1,
                    keep_records=False, shards=2).report  # fmt: skip
    assert half.requests == pytest.approx(whole.requests, rel=0.002)
    for stats in ("ttft", "tpot"):
        for p in ("p50", "p90"):
            got, want = getattr(getattr(half, stats), p), getattr(getattr(whole, stats), p)
            assert got == pytest.approx(want, rel=0.06), (stats, p)
    assert half.goodput_rps == pytest.approx(whole.goodput_rps, rel=0.03)
    assert 0.5 < whole.attainment < 0.95  # the SLO is not met by every request


def test_a_shard_of_one_prefill_worker_near_saturation_does_not_agree() -> None:
    run = simulator_for(tiny_cpu_profile(), "synthetic", 60.0, SLO, seed=1, shards=4)
    whole = simulate(tiny_cpu_profile(), ClusterShape(4, 8), "synthetic", 60.0, 60.0, SLO,
                     seed=1, keep_records=False).report  # fmt: skip
    sharded = simulate(tiny_cpu_profile(), ClusterShape(4, 8), "synthetic", 60.0, 60.0, SLO,
                       seed=1, keep_records=False, shards=4).report  # fmt: skip
    assert sharded.ttft.p50 > 10 * whole.ttft.p50  # a pool of one queues where four did not
    # plan keeps 4 workers of each role a shard: this shape is simulated whole
    assert run(ClusterShape(4, 8), 60.0) == whole
