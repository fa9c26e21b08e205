"""`python -m benchmarks simulator --goodput DIR` in the split and shared-device modes, on a
small record set fabricated by the simulator itself (as a goodput run writes them: DIR/records-
MODE-WORKLOAD-RATE.jsonl, every rate with one seed): with the server's prefill time equal to
the TTFT and no decode overhead left to fit, the fitted prediction is the measured run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from sim_profiles import make_profile

from benchmarks.suites.goodput import THRESHOLDS
from benchmarks.suites.simulator import main
from loadtests.goodput import parse_slo
from loadtests.records import write_records
from planner.perf_profile import load_perf_profile
from simulator.report import simulate
from simulator.shape import ClusterShape

RATES = (2.0, 4.0)
SLO = "ttft:2000 tpot:200"


def fabricate(directory: Path, mode: str, shape: ClusterShape) -> Path:
    """A goodput run's records of `shape` at RATES (seed 0, 3 s), and its profile."""
    profile = make_profile()
    path = directory / "profile.json"
    profile.save(path)
    for rate in RATES:
        result = simulate(profile, shape, "synthetic", rate, 3.0, parse_slo(SLO), seed=0)
        records = [replace(r, server_prefill_ms=r.ttft_ms) for r in result.records]
        write_records(directory / f"records-{mode}-synthetic-{rate:g}.jsonl", records)
    return path


@pytest.mark.parametrize(
    ("mode", "flags", "shape"),
    [
        ("split", [], ClusterShape(0, 0, 0, 1, thresholds=THRESHOLDS)),
        ("pd", ["--shared-device"], ClusterShape(1, 1, thresholds=THRESHOLDS, shared_device=True)),
    ],
)
def test_agreement_of_a_split_worker_and_a_shared_device_pair_with_their_own_records(
    tmp_path: Path, mode: str, flags: list[str], shape: ClusterShape
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    profile = fabricate(run, mode, shape)
    out = tmp_path / "out"
    code = main([
        "--goodput", str(run), "--profile", str(profile), "--mode", mode, *flags,
        "--workload", "synthetic", "--rates", *map(str, RATES), "--duration", "3",
        "--slo", SLO, "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    fitted = load_perf_profile(out / "profile-fitted.json").serving
    assert (fitted.request_s, fitted.prefill_factor, fitted.decode_step_s) == (0.0, 1.0, 0.0)
    results = json.loads((out / "agreement.json").read_text())
    assert [r["rate"] for r in results] == list(RATES)
    for r in results:
        assert r["measured"]["requests"] > 3
        for name in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "goodput_rps"):
            assert r["fitted"][name] == pytest.approx(r["measured"][name]), name


def test_split_and_shared_device_need_a_goodput_run_and_the_right_mode(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--mode split / --shared-device: against a goodput"):
        main(["--mode", "split", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--shared-device: a PD pair on one GPU"):
        main(["--mode", "colocated", "--shared-device", "--out", str(tmp_path)])
