"""The predictive planner: Holt's forecast, the capacity model on the hand-made profile (prefill
10 ms + 1 ms per token, decode 10 ms a step whatever the batch, no serving overheads), and the
pure core: targets set ahead of a breach the reactive rules have not seen, the reactive rules
as a guard, drains towards the target, corrections from observed over predicted latency."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest
from sim_profiles import make_profile

from planner.capacity import CapacityModel
from planner.core import LatencySample, PlannerConfig, RoleBounds, TickInput, WorkerView, plan
from planner.forecast import HoltState, LoadForecast
from planner.loop import PlannerLoop, PlannerSettings
from planner.perf_profile import DecodePoint
from planner.predictive import (
    PlannerMode,
    PredictiveConfig,
    PredictiveMemory,
    PredictivePlanner,
    plan_predictive,
)
from vocabulary.worker_api import WorkerRole

MODEL = CapacityModel(make_profile())
CONFIG = PlannerConfig(
    ttft_slo_ms=500.0,
    tpot_slo_ms=50.0,
    prefill=RoleBounds(1, 8),
    decode=RoleBounds(1, 8),
    cooldown_ticks=2,
    min_samples=5,
    max_step=2,
)
PREDICTIVE = PredictiveConfig(startup_s=30.0)


def workers(prefix: str, n: int, *, age: float = 600.0) -> tuple[WorkerView, ...]:
    return tuple(WorkerView(f"{prefix}{i}", age) for i in range(n))


def make_tick(
    tick: int,
    rate: float,
    *,
    prefill: int = 1,
    decode: int = 1,
    ttft: Sequence[LatencySample] = (),
    prompt: float = 100.0,
    output: float = 10.0,
) -> TickInput:
    return TickInput(
        tick=tick,
        now_s=5.0 * tick,
        prefill_workers=workers("p", prefill),
        decode_workers=workers("d", decode),
        ttft_samples=tuple(ttft),
        arrival_rps=rate,
        mean_prompt_tokens=prompt,
        mean_output_tokens=output,
    )


def run_ticks(ticks: Sequence[TickInput]) -> tuple[list, PredictiveMemory]:
    memory = PredictiveMemory()
    out = []
    for t in ticks:
        result = plan_predictive(t, CONFIG, PREDICTIVE, MODEL, memory)
        memory = result.memory
        out.append(result)
    return out, memory


# ---- the forecast ---------------------------------------------------------------------------


def test_holt_sets_the_level_first_then_smooths_level_and_trend_per_second() -> None:
    s = HoltState().observe(10.0, 0.0, alpha=0.5, beta=0.3)
    assert (s.level, s.trend, s.at_s) == (10.0, 0.0, 0.0)
    s = s.observe(20.0, 5.0, alpha=0.5, beta=0.3)
    assert s.level == pytest.approx(15.0)  # 0.5 * 20 + 0.5 * (10 + 0 * 5)
    assert s.trend == pytest.approx(0.3)  # 0.3 * (15 - 10) / 5
    assert s.forecast(10.0) == pytest.approx(18.0)
    assert HoltState(1.0, -1.0, 0.0).forecast(5.0) == 0.0  # never below 0


def test_holt_keeps_the_spread_of_its_one_observation_ahead_errors() -> None:
    s = HoltState().observe(10.0, 0.0, alpha=0.5, beta=0.3)
    assert s.spread() == 0.0  # the first observation had no forecast to miss
    s = s.observe(20.0, 5.0, alpha=0.5, beta=0.3)  # expected 10: an error of 10
    assert s.residual_var == pytest.approx(0.5 * 100.0)
    s = s.observe(16.5, 10.0, alpha=0.5, beta=0.3)  # expected 15 + 0.3 * 5 = 16.5: no error
    assert s.residual_var == pytest.approx(0.5 * 50.0)
    assert s.spread() == pytest.approx(5.0)


# ---- the capacity model ---------------------------------------------------------------------


def test_ttft_is_the_hop_plus_an_md1_wait_plus_the_prompts_step() -> None:
    load = LoadForecast(5.0, 100.0, 10.0)
    # S = 110 ms, rho = 5 * 0.11 = 0.55, wait = 0.55 * 0.11 / (2 * 0.45)
    assert MODEL.prefill_utilization(load, 1) == pytest.approx(0.55)
    assert MODEL.ttft_s(load, 1) == pytest.approx(0.11 + 0.55 * 0.11 / 0.9)
    assert MODEL.ttft_s(LoadForecast(10.0, 100.0, 10.0), 1) == math.inf  # rho 1.1


def test_tpot_is_the_step_at_the_streams_littles_law_gives() -> None:
    load = LoadForecast(5.0, 100.0, 10.0)
    assert MODEL.decode_streams(load, 1) == pytest.approx(0.5)  # 5/s x 10 tokens x 10 ms
    assert MODEL.tpot_s(load, 1) == pytest.approx(0.01)
    # 1000/s x 100 tokens x 10 ms = 1,000 streams: past max_num_seqs (64)
    assert MODEL.tpot_s(LoadForecast(1000.0, 100.0, 100.0), 1) == math.inf
    assert MODEL.tpot_s(LoadForecast(1000.0, 100.0, 100.0), 16) == pytest.approx(0.01)


def test_prefill_steps_recover_from_a_burst_only_below_the_runaway_load() -> None:
    # a step of x tokens takes 10 ms + 1 ms per token; at r tokens/s the next one is
    # r * (0.01 + 0.001 x): below 1,000 tokens/s it shrinks back to one prompt
    assert MODEL.recovers(LoadForecast(9.0, 100.0, 10.0), 1, 800.0)
    assert not MODEL.recovers(LoadForecast(10.5, 100.0, 10.0), 1, 800.0)
    assert MODEL.recovers(LoadForecast(10.5, 100.0, 10.0), 2, 800.0)


def test_prefill_steps_that_settle_batched_below_the_budget_recover() -> None:
    # 80/s of 10-token prompts: 800 tokens/s, the next step 8 + 0.8 x tokens, settling at 40
    # (four prompts a step), well below the 2,048-token budget
    assert MODEL.recovers(LoadForecast(80.0, 10.0, 10.0), 1, 800.0)
    # 1,200 tokens/s: 12 + 1.2 x grows from any step until it is full
    assert not MODEL.recovers(LoadForecast(120.0, 10.0, 10.0), 1, 80.0)


# ---- the pure core --------------------------------------------------------------------------


def test_the_first_tick_observes_nothing_it_has_no_rate_since_a_last_one() -> None:
    (first,), memory = run_ticks([make_tick(0, 50.0)])
    assert memory.arrival.at_s is None and first.forecast.arrival_rps == 0.0


def test_a_rising_rate_adds_prefill_before_the_reactive_rules_see_a_breach() -> None:
    ticks = [make_tick(i, rate) for i, rate in enumerate([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]
    results, memory = run_ticks(ticks)
    last = results[-1]
    # 6/s now and rising: 8.4/s 35 s ahead (the trend damped over 30 s), past what one worker
    # takes at 80 % busy (7.3/s)
    reach = 30.0 * (1.0 - math.exp(-35.0 / 30.0))
    assert last.forecast.arrival_rps == pytest.approx(
        memory.arrival.level + memory.arrival.trend * reach
    )
    assert last.forecast.arrival_rps == pytest.approx(8.4089, abs=1e-4)
    assert last.targets[0] == 2 and last.decision.prefill.add == 1
    assert "forecast" in last.decision.prefill.reasons[0]
    assert plan(ticks[-1], CONFIG).prefill.add == 0  # no samples, no queue: nothing to react to


def test_the_reactive_rules_guard_a_breach_the_forecast_does_not_see() -> None:
    slow = [LatencySample("p0", 19.0, 2000.0)] * 5  # TTFT p90 2 s, SLO 500 ms
    ticks = [make_tick(0, 1.0), make_tick(1, 1.0), make_tick(2, 1.0, prefill=2, ttft=slow)]
    results, _ = run_ticks(ticks)
    decision = results[-1].decision.prefill
    assert results[-1].targets[0] == 1  # the forecast load needs one worker
    assert decision.add == 2  # the reactive rule's step (2 x (2000/500 - 1), capped at max_step)
    assert any(r.startswith("guard: TTFT p90 2000 ms > SLO 500 ms") for r in decision.reasons)


def test_a_role_over_its_target_drains_towards_it_by_drain_step_outside_its_cooldown() -> None:
    ticks = [make_tick(i, 1.0, prefill=7) for i in range(3)]
    results, _ = run_ticks(ticks)
    assert [r.targets[0] for r in results] == [1, 1, 1]
    assert len(results[0].decision.prefill.drain) == 4  # drain_step, not max_step (2)
    assert results[1].decision.prefill.drain == ()  # cooldown: changed at tick 0
    assert "cooldown: changed at tick 0" in results[1].decision.prefill.reasons[-1]
    assert len(results[2].decision.prefill.drain) == 4
    memory = PredictiveMemory()
    for t in ticks[:1]:
        one = plan_predictive(t, CONFIG, replace(PREDICTIVE, drain_step=1), MODEL, memory)
    assert len(one.decision.prefill.drain) == 1


def decode_ticks(rates: Sequence[float], decode: int = 2) -> list[TickInput]:
    """100-token outputs: a decode worker runs rate / n streams (10 ms a token), at most 64."""
    return [make_tick(i, r, decode=decode, output=100.0) for i, r in enumerate(rates)]


def test_decode_is_sized_for_the_forecast_plus_its_residual_spread_a_lead_ahead() -> None:
    steady, _ = run_ticks(decode_ticks([100.0] * 4))
    assert steady[-1].memory.arrival.spread() == 0.0
    assert steady[-1].targets[1] == 2  # 100 streams: two workers of 64
    noisy, memory = run_ticks(decode_ticks([100.0, 100.0, 40.0, 100.0, 40.0]))
    last = noisy[-1]
    headroom = 1.64 * memory.arrival.spread() * math.sqrt(35.0 / 5.0)  # lead 30 s + a tick
    assert headroom > 64.0
    assert last.targets[1] == math.ceil((last.forecast.arrival_rps + headroom) / 64.0)
    bare = PredictiveMemory()
    for t in decode_ticks([100.0, 100.0, 40.0, 100.0, 40.0]):
        result = plan_predictive(t, CONFIG, replace(PREDICTIVE, headroom_z=0.0), MODEL, bare)
        bare = result.memory
    assert result.targets[1] == math.ceil(last.forecast.arrival_rps / 64.0)
    assert result.targets[1] < last.targets[1]


def test_decode_meets_its_tpot_target_at_the_forecast_and_carries_the_margin_as_streams() -> None:
    # a decode step of 5 ms at one stream, 40 ms at 64: TPOT 20 ms (0.8 x 25) holds about 28
    # streams a worker; saturation is 64
    profile = replace(make_profile(), decode=(DecodePoint(1, 100, 0.005),
                                              DecodePoint(64, 100, 0.04)))  # fmt: skip
    model = CapacityModel(profile)
    config = replace(CONFIG, tpot_slo_ms=25.0)
    memory = PredictiveMemory()
    for t in decode_ticks([40.0, 40.0, 24.0, 40.0, 24.0]):
        result = plan_predictive(t, config, PREDICTIVE, model, memory)
        memory = result.memory
    ahead = result.forecast
    margin = 1.64 * memory.arrival.spread() * math.sqrt(35.0 / 5.0)

    def fewest(load: LoadForecast, fits: bool) -> int:
        """The fewest workers whose TPOT fits 20 ms (`fits`), or that do not saturate."""
        ok = (lambda n: model.tpot_s(load, n) <= 0.02) if fits else (
            lambda n: not math.isinf(model.tpot_s(load, n)))  # fmt: skip
        return next(n for n in range(1, 9) if ok(n))

    over = replace(ahead, arrival_rps=ahead.arrival_rps + margin)
    target = max(fewest(ahead, fits=True), fewest(over, fits=False))
    assert result.targets[1] == target
    assert target < fewest(over, fits=True)  # the margin in the TPOT fit would ask for more
    assert f"+ {margin:.1f} margin" in result.decision.decode.reasons[-1]


def test_a_damped_forecast_trusts_a_trend_near_at_hand_and_fades_it_far_ahead() -> None:
    s = HoltState(10.0, 1.0, 0.0)
    assert s.forecast(35.0) == pytest.approx(45.0)  # Holt's straight line
    assert s.forecast(35.0, 30.0) == pytest.approx(10.0 + 30.0 * (1.0 - math.exp(-35.0 / 30.0)))
    assert s.forecast(1.0, 30.0) == pytest.approx(11.0, abs=0.02)  # nearly in full at first
    assert s.forecast(1e6, 30.0) == pytest.approx(40.0)  # never past level + trend x 30 s
    # a step in the rate (10/s to 40/s) is not carried a whole lead ahead
    step = [make_tick(i, r) for i, r in enumerate([10.0, 10.0, 10.0, 40.0])]
    straight = PredictiveMemory()
    for t in step:
        line = plan_predictive(t, CONFIG, replace(PREDICTIVE, trend_damping_s=math.inf), MODEL,
                               straight)  # fmt: skip
        straight = line.memory
    damped, _ = run_ticks(step)
    assert damped[-1].forecast.arrival_rps < line.forecast.arrival_rps
    assert damped[-1].targets[0] < line.targets[0]


def test_decode_drains_only_once_its_target_has_been_lower_for_a_start_up() -> None:
    results, _ = run_ticks(decode_ticks([10.0] * 8, decode=4))
    assert [r.targets[1] for r in results] == [1] * 8
    drains = [len(r.decision.decode.drain) for r in results]
    assert drains == [0, 0, 0, 0, 0, 0, 3, 0]  # below since 0 s; 30 s later, tick 6: to 1
    assert (
        "hold: the target below the count for less than a start-up"
        in (results[5].decision.decode.reasons[-1])
    )
    assert results[6].memory.below_since_s[1] == 0.0


def test_the_correction_is_the_observed_percentile_over_the_predicted_latency_smoothed() -> None:
    # 5/s on one worker: the model predicts a mean TTFT of 177.2 ms; samples at p90 2x that
    predicted_ms = MODEL.ttft_s(LoadForecast(5.0, 100.0, 10.0), 1) * 1000
    seen = [LatencySample("p0", 9.0, 2 * predicted_ms)] * 5
    ticks = [make_tick(0, 5.0), make_tick(1, 5.0), make_tick(2, 5.0, ttft=seen)]
    _, memory = run_ticks(ticks)
    assert memory.ttft_correction == pytest.approx(0.3 * 2.0 + 0.7 * 1.0)
    assert memory.tpot_correction == 1.0  # no TPOT samples


def test_a_backlogs_latency_does_not_move_the_correction() -> None:
    seen = [LatencySample("p0", 9.0, 5000.0)] * 5
    ticks = [make_tick(0, 5.0), make_tick(1, 5.0), replace(make_tick(2, 5.0, ttft=seen),
                                                            queue_depth=20)]  # fmt: skip
    _, memory = run_ticks(ticks)
    assert memory.ttft_correction == 1.0


def test_plan_predictive_is_pure() -> None:
    tick = make_tick(3, 4.0)
    memory = run_ticks([make_tick(i, 2.0) for i in range(3)])[1]
    a = plan_predictive(tick, CONFIG, PREDICTIVE, MODEL, memory)
    b = plan_predictive(tick, CONFIG, PREDICTIVE, MODEL, memory)
    assert a == b


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": 0.0}, {"beta": 1.5}, {"startup_s": -1.0}, {"min_correction": 2.0},
     {"target_ratio": 0.0}, {"max_utilization": 1.0}, {"burst_prompts": 0.5},
     {"headroom_z": -1.0}, {"trend_damping_s": 0.0}, {"drain_step": 0}],
)  # fmt: skip
def test_an_invalid_predictive_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="|".join(kwargs)):
        PredictiveConfig(**kwargs)


# ---- the mode in the loop -------------------------------------------------------------------


class NoHost:
    rebalancing = False


def test_the_loop_runs_the_planner_its_mode_names() -> None:
    reactive = PlannerLoop(PlannerSettings(), NoHost(), WorkerRole.DECODE)  # type: ignore[arg-type]
    assert not isinstance(reactive.planner, PredictivePlanner)
    settings = PlannerSettings(mode=PlannerMode.PREDICTIVE.value)
    loop = PlannerLoop(settings, NoHost(), WorkerRole.DECODE, profile=make_profile())  # type: ignore[arg-type]
    assert isinstance(loop.planner, PredictivePlanner)
    with pytest.raises(ValueError, match=r"planner\.predictive\.profile: required"):
        PlannerLoop(settings, NoHost(), WorkerRole.DECODE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode: one of reactive, predictive"):
        PlannerSettings(mode="psychic")
