"""`pdserve plan`'s search (simulator/plan.py) over the simulator on the hand-made profile of
tests/sim_profiles.py (prefill 10 ms + 1 ms per token, decode 10 ms a step), and the command."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_profiles import make_profile
from typer.testing import CliRunner

from deploy.cli.app import app
from loadtests.goodput import SLO as SLO_T
from loadtests.goodput import max_rate_meeting, parse_slo
from simulator.plan import (
    Point,
    Simulate,
    geometric_rates,
    gpus_of,
    label,
    pareto,
    plan_for_gpus,
    plan_for_rate,
    shapes_of,
    simulator_for,
)
from simulator.shape import ClusterShape

SLO = parse_slo("ttft:1500 tpot:30")


def run_for(slo: SLO_T = SLO) -> Simulate:
    return simulator_for(make_profile(), "synthetic", 8.0, slo, seed=1)


def test_every_split_of_a_gpu_count_is_a_candidate() -> None:
    shapes = shapes_of(4, ClusterShape().thresholds)
    assert [label(s) for s in shapes] == ["1P3D", "2P2D", "3P1D", "4C"]
    assert {gpus_of(s) for s in shapes} == {4}
    assert [label(s) for s in shapes_of(1, ClusterShape().thresholds)] == ["1C"]


def test_each_chunk_asked_for_is_a_configuration_of_its_own() -> None:
    shapes = shapes_of(2, ClusterShape().thresholds, chunks=(32, 128))
    assert [label(s) for s in shapes] == ["1P1D c32", "1P1D c128", "2C c32", "2C c128"]


def test_a_smaller_chunk_trades_a_colocated_workers_ttft_for_its_tpot() -> None:
    """The profile: a step with prefill costs 10 ms + 1 ms per chunk token, a decode step 10
    ms. At a light load a colocated worker's streams wait less behind small chunks (p90 TPOT
    down) while each prompt pays 10 ms more per chunk (TTFT up); at heavier loads the fixed
    cost of the extra steps wins (both worse: what `pdserve plan --chunk` finds out)."""
    run = run_for(parse_slo("ttft:5000 tpot:200"))
    small = run(ClusterShape(0, 0, 1, chunk_tokens=32), 0.5)
    large = run(ClusterShape(0, 0, 1, chunk_tokens=200), 0.5)
    assert small.tpot.p90 < 0.85 * large.tpot.p90, (small.tpot, large.tpot)
    assert small.ttft.p50 > 1.3 * large.ttft.p50, (small.ttft, large.ttft)
    # so at a TPOT the large chunk misses, the search picks the small one
    tight = parse_slo("ttft:5000 tpot:19")
    found = plan_for_gpus(run_for(tight), 1, [0.5], tight, chunks=(32, 200))
    assert [label(p.shape) for p in found.chosen] == ["1C c32"], [
        (label(p.shape), p.report.tpot.p90) for p in found.points
    ]


def test_the_fewest_gpus_that_meet_the_slo_are_chosen_and_every_smaller_cluster_failed() -> None:
    run = run_for()
    found = plan_for_rate(run, 4.0, SLO, max_gpus=6)
    assert found.chosen, [(label(p.shape), p.report.attainment) for p in found.points]
    fewest = found.chosen[0].gpus
    assert fewest > 2  # the synthetic prompts' prefill (1 ms/token) needs several workers
    assert all(p.gpus == fewest and p.meets(0.9) for p in found.chosen)
    assert all(not p.meets(0.9) for p in found.points if p.gpus < fewest)
    goodputs = [p.goodput_per_gpu for p in found.chosen]
    assert goodputs == sorted(goodputs, reverse=True)
    # the same search again: the same answer (seeded workload, deterministic simulation)
    again = plan_for_rate(run, 4.0, SLO, max_gpus=6)
    assert [label(p.shape) for p in again.chosen] == [label(p.shape) for p in found.chosen]


def test_an_slo_nothing_meets_names_the_closest_configuration_and_the_miss() -> None:
    tight = parse_slo("ttft:5 tpot:30")  # a prefill step alone takes 10 ms
    found = plan_for_rate(run_for(tight), 2.0, tight, max_gpus=2)
    assert found.chosen == ()
    closest = found.closest
    assert closest is not None and closest.gpus == 2
    assert closest.report.attainment == max(p.report.attainment for p in found.points)
    misses = found.misses(closest)
    assert misses[0].startswith("attainment")
    assert any(m.startswith("TTFT p90") and "> 5 ms" in m for m in misses)


def test_a_gpu_budget_gives_each_split_its_highest_rate_within_the_slo() -> None:
    rates = [1.0, 2.0, 4.0, 8.0]
    found = plan_for_gpus(run_for(), 3, rates, SLO)
    assert set(found.max_rate) == {"1P2D", "2P1D", "3C"}
    for name, top in found.max_rate.items():
        reports = [p.report for p in found.points if label(p.shape) == name]
        assert top == max_rate_meeting(reports, 0.9)
    assert [p.rate for p in found.chosen] == [
        found.max_rate[label(p.shape)] for p in found.chosen
    ]  # the chosen point of a split is its highest rate


def test_pareto_keeps_the_points_nothing_beats_on_both_axes() -> None:
    found = plan_for_gpus(run_for(), 2, [1.0, 2.0, 4.0], SLO)
    front = pareto(found.points)
    assert front
    for p in found.points:
        if p in front:
            continue
        assert any(
            q.tokens_per_gpu >= p.tokens_per_gpu and q.tokens_per_user >= p.tokens_per_user
            for q in front
        )
    for p in front:
        assert not any(
            q.tokens_per_gpu > p.tokens_per_gpu and q.tokens_per_user > p.tokens_per_user
            for q in found.points
        )


def test_geometric_rates_span_the_range_on_a_log_scale() -> None:
    assert geometric_rates(1.0, 16.0, 5) == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert geometric_rates(3.0, 3.0, 1) == [3.0]
    with pytest.raises(ValueError, match="low <= high"):
        geometric_rates(4.0, 1.0, 3)


def test_bad_searches_are_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="--rate"):
        plan_for_rate(run_for(), 0.0, SLO, max_gpus=2)
    with pytest.raises(ValueError, match="--max-gpus"):
        plan_for_rate(run_for(), 1.0, SLO, max_gpus=0)
    with pytest.raises(ValueError, match="--gpus"):
        plan_for_gpus(run_for(), 0, [1.0], SLO)


def _profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    make_profile().save(path)
    return path


def test_the_plan_command_prints_the_cheapest_configuration_and_a_pareto_plot(
    tmp_path: Path,
) -> None:
    plot = tmp_path / "pareto.png"
    result = CliRunner().invoke(
        app,
        ["plan", "--profile", str(_profile_file(tmp_path)), "--gpus", "2", "--rate", "1",
         "--rate", "2", "--slo", "ttft:1500", "--slo", "tpot:30", "--duration", "6",
         "--plot", str(plot)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "cheapest:" in result.output and "highest rate meeting the SLO" in result.output
    assert plot.stat().st_size > 1000


def test_the_plan_command_searches_split_workers_when_asked(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["plan", "--profile", str(_profile_file(tmp_path)), "--gpus", "1", "--rate", "1",
         "--slo", "ttft:5000", "--slo", "tpot:200", "--duration", "4", "--split"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "1C" in said and "1S" in said


def test_the_plan_command_exits_1_naming_the_closest_when_nothing_meets(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["plan", "--profile", str(_profile_file(tmp_path)), "--rate", "2", "--max-gpus", "1",
         "--slo", "ttft:5", "--duration", "4"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())  # rich wraps at 80 columns
    assert "closest: 1C" in said and "TTFT p90" in said


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--rate"),
        (["--rate", "1", "--rate", "2"], "--gpus"),
        (["--gpus", "2", "--attainment", "1.5"], "--attainment"),
        (["--rate", "1", "--slo", "ttft"], "ttft"),
        (["--rate", "1", "--chunk", "0"], "--chunk: tokens per step, each >= 1"),
        (["--rate", "1", "--chunk", "512"], "--chunk: 512 tokens is past the profile's largest"),
    ],
)
def test_the_plan_command_refuses_bad_options_with_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["plan", "--profile", str(_profile_file(tmp_path)), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_points_report_per_gpu_and_per_user_rates() -> None:
    found = plan_for_rate(run_for(), 1.0, SLO, max_gpus=1)
    (point,) = found.points
    assert isinstance(point, Point)
    assert point.tokens_per_gpu == pytest.approx(point.report.output_tokens_per_s)
    assert point.tokens_per_user == pytest.approx(1000.0 / point.report.tpot.p50)
