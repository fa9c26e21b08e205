"""`pdserve plan` over one profile per TP size (simulator/plan.py): each role searched at each
TP size, GPUs counted by ranks, prefill workers stepping on their own profile
(simulator/cluster.py), and profiles of different models refused. The profiles are made by
hand: TP 1 is tests/sim_profiles.py's (prefill 10 ms + 1 ms per token, decode 10 ms a step,
hand-off 5 ms), TP 2 the same with every step 0.6x as long."""

from __future__ import annotations

from pathlib import Path

import pytest
from sim_profiles import make_profile, scaled_profile
from typer.testing import CliRunner

from admission.config import AdmissionThresholds
from deploy.cli.app import app
from loadtests.goodput import parse_slo
from loadtests.workload import PlannedRequest
from planner.perf_profile import PerfProfile, PerfProfileError
from simulator.cluster import Simulation
from simulator.plan import (
    gpus_of,
    label,
    plan_for_rate,
    profiles_by_tp,
    shapes_of,
    simulator_for,
)
from simulator.report import to_record
from simulator.shape import ClusterShape

TP1 = make_profile()
TP2 = scaled_profile(TP1, 2, 0.6)
NO_LOCAL = AdmissionThresholds(local_prefill_threshold_tokens=0)


def test_each_role_is_searched_at_every_tp_size_and_a_worker_holds_a_gpu_per_rank() -> None:
    shapes = shapes_of(4, NO_LOCAL, tp_sizes=(1, 2))
    assert [label(s) for s in shapes] == [
        "1P3D", "2P2D", "3P1D",  # TP 1 both
        "2P1D(TP2)",  # prefill TP 1, decode TP 2: 2 + 2
        "1P(TP2)2D",  # prefill TP 2, decode TP 1: 2 + 2
        "1P(TP2)1D(TP2)",
        "4C", "2C(TP2)",
    ]  # fmt: skip
    assert {gpus_of(s) for s in shapes} == {4}
    assert gpus_of(ClusterShape(3, 2, prefill_tp=2, decode_tp=4)) == 3 * 2 + 2 * 4
    # a split engine has no TP: split workers only at TP 1, and none from TP 2 alone
    assert [label(s) for s in shapes_of(2, NO_LOCAL, split=True, tp_sizes=(2,))] == ["1C(TP2)"]


def test_prefill_workers_step_on_their_own_profile_the_handoff_is_the_decode_one() -> None:
    prompt = tuple(10 + i for i in range(100))
    shape = ClusterShape(1, 1, thresholds=NO_LOCAL, prefill_tp=2)
    (r,) = Simulation(TP1, shape, prefill_profile=TP2, trace_tokens=True).run(
        [PlannedRequest(0, "r0", 0.0, prompt, 3)]
    )
    record = to_record(r, None)
    assert record.ttft_ms == pytest.approx(0.6 * 110.0)  # TP 2's prefill step
    # the decode profile's hand-off (5 ms), then TP 1's 10 ms decode steps
    assert r.token_times == pytest.approx([0.066, 0.081, 0.091])
    with pytest.raises(
        ValueError, match="prefill workers of TP 1 cannot step on a profile of TP 2"
    ):
        Simulation(TP1, ClusterShape(1, 1), prefill_profile=TP2)


def test_the_plan_picks_tp2_for_the_role_where_it_wins() -> None:
    """TPOT 8 ms: TP 1's 10 ms decode step can never meet it, TP 2's 6 ms can; TTFT is loose,
    so the prefill role stays at TP 1 (one GPU cheaper than TP 2's)."""
    slo = parse_slo("ttft:1500 tpot:8")
    perfs = profiles_by_tp([TP2, TP1])
    assert list(perfs) == [1, 2]
    run = simulator_for(perfs, "synthetic", 8.0, slo, seed=1)
    found = plan_for_rate(run, 2.0, slo, max_gpus=4, tp_sizes=tuple(perfs))
    best = found.chosen[0]
    assert (label(best.shape), best.gpus) == ("1P1D(TP2)", 3), [
        (label(p.shape), p.report.tpot.p90) for p in found.points
    ]
    assert best.report.tpot.p90 < 8.0
    tp1_only = [p for p in found.points if p.shape.decode_tp == 1]
    assert tp1_only and all(p.report.attainment == 0 for p in tp1_only)


@pytest.mark.parametrize(
    ("field", "value"), [("model_id", "another"), ("dtype", "bfloat16"), ("block_size", 32)]
)
def test_profiles_of_different_workers_are_refused_naming_the_field(
    field: str, value: object
) -> None:
    other = scaled_profile(TP1, 2, 0.6, **{field: value})
    with pytest.raises(PerfProfileError, match=f"profile {field}: "):
        profiles_by_tp([TP1, other])
    with pytest.raises(PerfProfileError, match="two profiles of TP 1"):
        profiles_by_tp([TP1, TP1])


def saved(path: Path, profile: PerfProfile) -> str:
    profile.save(path)
    return str(path)


def test_the_plan_command_takes_a_profile_per_tp_size(tmp_path: Path) -> None:
    one, two = saved(tmp_path / "tp1.json", TP1), saved(tmp_path / "tp2.json", TP2)
    common = ("plan", "--slo", "ttft:1500", "--slo", "tpot:8", "--rate", "2", "--max-gpus",
              "3", "--duration", "8", "--attainment", "0.9")  # fmt: skip
    result = CliRunner().invoke(app, [*common, "--profile", one, "--profile", two])
    assert result.exit_code == 0, result.output
    assert "cheapest: 1P1D(TP2) (3 GPUs)" in " ".join(result.output.split())
    other = saved(tmp_path / "other.json", scaled_profile(TP1, 2, 0.6, model_id="another"))
    result = CliRunner().invoke(app, [*common, "--profile", one, "--profile", other])
    assert result.exit_code == 2
    assert "profile model_id: " in result.output and "Traceback" not in result.output


def test_simulate_runs_prefill_workers_on_another_tp_size(tmp_path: Path) -> None:
    one, two = saved(tmp_path / "tp1.json", TP1), saved(tmp_path / "tp2.json", TP2)
    result = CliRunner().invoke(
        app, ["simulate", "--profile", one, "--prefill-profile", two, "--rate", "2",
              "--duration", "3"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "simulated 1P(TP2)1D" in result.output
