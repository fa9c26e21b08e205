"""The split engine's SM policy: decode gets the fewest SMs that meet its TPOT target, every
SM goes to one side when the other is idle, and the split changes at most once an interval."""

from __future__ import annotations

import pytest

from vocabulary.split_policy import (
    BandwidthCurve,
    DecodeLoad,
    SplitGovernor,
    SplitModel,
    StepCorrection,
    choose_decode_sms,
)

TOTAL = 132
SHARES = (16, 32, 48, 66, 84, 100)
GB = 1e9
# A Llama-3-8B-shaped decode step: 16 GB of weights; HBM peaks at 3000 GB/s from 60 SMs on.
MODEL = SplitModel(16 * 1_000_000_000, BandwidthCurve.saturating(TOTAL, 3000 * GB, knee=60 / 132))


def test_curve_is_linear_below_the_knee_and_flat_above() -> None:
    curve = BandwidthCurve.saturating(TOTAL, 3000 * GB, knee=60 / 132)
    assert curve.at(30) == pytest.approx(1500 * GB)
    assert curve.at(60) == pytest.approx(3000 * GB)
    assert curve.at(132) == pytest.approx(3000 * GB)
    assert curve.at(200) == pytest.approx(3000 * GB)
    with pytest.raises(ValueError, match="increasing"):
        BandwidthCurve(((60, 1.0), (30, 2.0)))


def test_decode_gets_the_fewest_sms_that_meet_its_target() -> None:
    small = DecodeLoad(running=8, kv_bytes=1_000_000_000, prefill_waiting=True)
    # 17 GB a step: 21.6 ms at 16 SMs, 10.9 at 32, 7.4 at 48, 5.97 from 60 SMs on
    assert MODEL.step_s(small, 66) == pytest.approx(0.3e-3 + 17 / 3000, rel=1e-9)
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.025) == 16
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.020) == 32
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.011) == 32
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.008) == 48
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.0062) == 66
    assert choose_decode_sms(small, SHARES, TOTAL, MODEL, tpot_s=0.001) == 100  # none meets it


def test_every_sm_goes_to_the_side_that_has_work() -> None:
    busy = DecodeLoad(running=64, kv_bytes=8_000_000_000, prefill_waiting=False)
    assert choose_decode_sms(busy, SHARES, TOTAL, MODEL, tpot_s=0.020) == TOTAL
    idle = DecodeLoad(running=0, kv_bytes=0, prefill_waiting=True)
    assert choose_decode_sms(idle, SHARES, TOTAL, MODEL, tpot_s=0.020) == 16


def test_governor_changes_the_split_at_most_once_an_interval() -> None:
    g = SplitGovernor(min_interval_s=2.0)
    assert g.decide(66, now_s=0.0) == 66  # the first decision always applies
    assert g.decide(66, now_s=0.5) is None  # no change
    assert g.decide(32, now_s=1.0) is None  # too soon
    assert g.decide(32, now_s=2.0) == 32
    assert g.decide(132, now_s=3.9) is None
    assert g.decide(132, now_s=4.0) == 132
    assert g.current == 132


def test_a_measured_slowdown_beside_prefill_buys_decode_more_sms() -> None:
    """The curve is measured alone; beside a prefill the steps run slower (HBM contention).
    The correction learns measured over predicted, so the split then meets the target."""
    load = DecodeLoad(running=8, kv_bytes=1_000_000_000, prefill_waiting=True)
    assert choose_decode_sms(load, SHARES, TOTAL, MODEL, tpot_s=0.020) == 32
    correction = StepCorrection(weight=0.5)
    for _ in range(16):  # steps on 32 SMs measured twice their prediction
        correction.observe(2.0 * MODEL.step_s(load, 32), MODEL.step_s(load, 32))
    assert correction.factor == pytest.approx(2.0, rel=1e-3)
    slowed = SplitModel(MODEL.weight_bytes, MODEL.curve, slowdown=correction.factor)
    assert slowed.step_s(load, 32) == pytest.approx(2.0 * MODEL.step_s(load, 32), rel=1e-3)
    assert choose_decode_sms(load, SHARES, TOTAL, slowed, tpot_s=0.020) == 48
    assert slowed.step_s(load, 48) <= 0.020 < slowed.step_s(load, 32)


def test_one_stalled_step_cannot_swing_the_correction() -> None:
    correction = StepCorrection(weight=0.1, low=0.5, high=4.0)
    correction.observe(10.0, 0.01)  # a 10 s host stall: counted as 4x at most
    assert correction.factor == pytest.approx(1.0 + 0.1 * 3.0)
    correction.observe(0.0, 0.01)  # nothing measured: ignored
    correction.observe(0.01, 0.0)
    assert correction.samples == 1
    with pytest.raises(ValueError):
        StepCorrection(weight=0.0)
    with pytest.raises(ValueError):
        StepCorrection(low=1.5)
