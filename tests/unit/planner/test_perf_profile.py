"""The profile file: a round trip, interpolation, and refusals that name the field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from sim_profiles import make_profile

from planner.perf_profile import (
    PerfProfileError,
    PrefillPoint,
    ServingOverhead,
    load_perf_profile,
)


def test_a_profile_survives_a_round_trip(tmp_path: Path) -> None:
    profile = make_profile()
    profile.save(tmp_path / "p.json")
    assert load_perf_profile(tmp_path / "p.json") == profile


def test_step_times_are_interpolated_and_extended_along_the_ends() -> None:
    profile = make_profile()
    assert profile.prefill_step_s(150) == pytest.approx(0.16)
    assert profile.prefill_step_s(400) == pytest.approx(0.41)
    assert profile.prefill_step_s(0) == pytest.approx(0.011)  # never below the smallest
    assert profile.decode_step_s(4, 3000) == pytest.approx(0.01)


def test_a_cached_prefix_adds_its_measured_cost_per_cached_token() -> None:
    points = (*make_profile().prefill, PrefillPoint(100, 0.13, 200))
    profile = replace(make_profile(), prefill=points)
    assert profile.prefill_step_s(100, cached_tokens=100) == pytest.approx(0.12)


def test_the_prefill_cost_model_reads_the_profile_with_its_serving_overheads() -> None:
    points = (*make_profile().prefill, PrefillPoint(100, 0.13, 200))
    serving = ServingOverhead(request_s=0.01, prefill_factor=2.0, decode_step_s=0.001)
    profile = replace(make_profile(), prefill=points, serving=serving)
    model = profile.prefill_cost_model()
    assert model.source == "synthetic float32 TP1 on cpu"
    for tokens in (1, 50, 150, 400):
        assert model.prefill_seconds(tokens) == pytest.approx(2 * profile.prefill_step_s(tokens))
    assert model.prefill_seconds(100, cached=100) == pytest.approx(
        2 * profile.prefill_step_s(100, cached_tokens=100)
    )
    assert model.decode_step_seconds(4, 3000) == pytest.approx(
        profile.decode_step_s(4, 3000) + 0.001
    )
    assert model.handoff_seconds(10) == profile.handoff.seconds(10) == 0.005
    assert model.token_budget == profile.header.max_num_batched_tokens


@pytest.mark.parametrize(("field", "value"), [("model_id", "llama-3-8b"), ("dtype", "bfloat16")])
def test_a_profile_of_another_model_or_dtype_is_refused_by_name(
    tmp_path: Path, field: str, value: str
) -> None:
    make_profile().save(tmp_path / "p.json")
    with pytest.raises(PerfProfileError, match=f"profile {field}: made for .* but '{value}'"):
        load_perf_profile(tmp_path / "p.json", **{field: value})


def test_a_file_that_is_not_a_profile_is_refused_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PerfProfileError, match="is not JSON"):
        load_perf_profile(bad)
    data = make_profile().to_dict()
    del data["decode"]
    bad.write_text(json.dumps(data))
    with pytest.raises(PerfProfileError, match=r"^decode: required"):
        load_perf_profile(bad)
    data = make_profile().to_dict()
    data["prefill"][0]["step_s"] = "fast"
    bad.write_text(json.dumps(data))
    with pytest.raises(PerfProfileError, match="step_s: must be a number > 0, got 'fast'"):
        load_perf_profile(bad)
    with pytest.raises(PerfProfileError, match="cannot read"):
        load_perf_profile(tmp_path / "missing.json")
