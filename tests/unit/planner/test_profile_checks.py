"""planner/profile_checks.py: a profile point slower than a larger step is named as suspect,
and `pdserve simulate` warns when it loads such a profile."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sim_profiles import tiny_cpu_profile
from typer.testing import CliRunner

from deploy.cli.app import app
from planner.perf_profile import DecodePoint, PrefillPoint
from planner.profile_checks import suspect_points


def test_a_measured_profile_has_no_suspect_point() -> None:
    assert suspect_points(tiny_cpu_profile()) == []


def test_a_small_batch_slower_than_a_larger_one_is_named() -> None:
    """The H100's anomaly: decode 1 x 1024 at 81 ms beside 8 x 1024 at 7.85 ms."""
    p = tiny_cpu_profile()
    decode = tuple(
        replace(d, step_s=0.081) if (d.batch_size, d.context_tokens) == (1, 1024) else d
        for d in p.decode
    )
    found = suspect_points(replace(p, decode=decode))
    assert found == ["decode 1 x 1024: 81.00 ms, over 1.5x the larger 4 x 1024 (5.00 ms)"]
    # a shorter context slower than a longer one at the same batch
    decode = (*p.decode, DecodePoint(1, 32, 0.010))
    assert suspect_points(replace(p, decode=decode)) == [
        "decode 1 x 32: 10.00 ms, over 1.5x the larger 1 x 64 (1.50 ms)"
    ]
    prefill = (*p.prefill, PrefillPoint(32, 0.050))
    assert suspect_points(replace(p, prefill=prefill)) == [
        "prefill 32 tokens: 50.00 ms, over 1.5x the larger 64 tokens (3.70 ms)"
    ]


def test_simulate_warns_about_a_suspect_profile(tmp_path: Path) -> None:
    p = tiny_cpu_profile()
    decode = tuple(
        replace(d, step_s=0.081) if (d.batch_size, d.context_tokens) == (1, 1024) else d
        for d in p.decode
    )
    path = tmp_path / "suspect.json"
    replace(p, decode=decode).save(path)
    result = CliRunner().invoke(
        app, ["simulate", "--profile", str(path), "--rate", "1", "--duration", "2"]
    )
    assert result.exit_code == 0, result.output
    assert "suspect point (re-measure it): decode 1 x 1024: 81.00 ms" in result.output
