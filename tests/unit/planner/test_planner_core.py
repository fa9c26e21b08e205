"""plan(): bounds, cooldown, SLO percentiles with cold-start exclusion, queue depth, rate match,
drain-before-stop and the reasons every decision carries."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from planner.core import (
    LatencySample,
    Planner,
    PlannerConfig,
    PlannerMemory,
    Role,
    RoleBounds,
    RoleDecision,
    ScalingDecision,
    TickInput,
    WorkerView,
    plan,
    warm_samples,
)
from vocabulary.numeric import percentile

NOW = 1000.0
CONFIG = PlannerConfig(
    ttft_slo_ms=500.0,
    tpot_slo_ms=50.0,
    slo_percentile=90.0,
    prefill=RoleBounds(1, 4),
    decode=RoleBounds(1, 4),
    cooldown_ticks=2,
    cold_start_s=30.0,
    min_samples=5,
    max_step=2,
)


def workers(prefix: str, n: int, *, age: float = 600.0, inflight: int = 0) -> list[WorkerView]:
    return [WorkerView(f"{prefix}{i}", age, inflight) for i in range(n)]


def samples(worker_id: str, values: Sequence[float], at: float = NOW - 1) -> list[LatencySample]:
    return [LatencySample(worker_id, at, v) for v in values]


def make_tick(
    *,
    tick: int = 10,
    prefill: Sequence[WorkerView] | None = None,
    decode: Sequence[WorkerView] | None = None,
    ttft: Sequence[LatencySample] = (),
    tpot: Sequence[LatencySample] = (),
    queue: int = 0,
    prefill_rate: float = 0.0,
    decode_rate: float = 0.0,
) -> TickInput:
    return TickInput(
        tick=tick,
        now_s=NOW,
        prefill_workers=tuple(workers("p", 2) if prefill is None else prefill),
        decode_workers=tuple(workers("d", 2) if decode is None else decode),
        ttft_samples=tuple(ttft),
        tpot_samples=tuple(tpot),
        queue_depth=queue,
        prefill_tokens_per_s=prefill_rate,
        decode_tokens_per_s=decode_rate,
    )


# Latencies in the middle band: neither over the SLO nor under half of it.
STEADY_TTFT = samples("p0", [300.0] * 5)
STEADY_TPOT = samples("d0", [30.0] * 5)


def steady(**kw: object) -> TickInput:
    kw.setdefault("ttft", STEADY_TTFT)
    kw.setdefault("tpot", STEADY_TPOT)
    return make_tick(**kw)  # type: ignore[arg-type]


def test_percentile_interpolates_linearly_between_ranks_like_numpy() -> None:
    assert percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 0.0, 20.0, 30.0, 40.0], 90) == pytest.approx(36.0)
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(values, 0) == 15.0
    assert percentile(values, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    with pytest.raises(ValueError):
        percentile([], 50)


def test_steady_load_holds_both_roles_and_says_why() -> None:
    d = plan(steady(), CONFIG)
    assert d.prefill == RoleDecision(Role.PREFILL, reasons=(d.prefill.reasons[0],))
    assert not d.prefill.changes and not d.decode.changes
    assert d.prefill.reasons[0].startswith("TTFT p90 300 ms; no scale-down: TTFT p90 300 ms")
    assert d.decode.reasons[0].startswith("TPOT p90 30 ms; no scale-down")
    assert d.memory == PlannerMemory()


# -- bounds ------------------------------------------------------------------------------------


def test_below_min_adds_up_to_min_even_in_cooldown() -> None:
    config = PlannerConfig(prefill=RoleBounds(3, 5), cooldown_ticks=5)
    memory = PlannerMemory().changed(Role.PREFILL, 9)
    d = plan(steady(), config, memory)
    assert d.prefill.add == 1
    assert d.prefill.reasons == ("2 active < min 3",)


def test_above_max_drains_the_least_busy_down_to_max() -> None:
    config = PlannerConfig(decode=RoleBounds(1, 2))
    decode = [WorkerView("d0", 600, 4), WorkerView("d1", 600, 0), WorkerView("d2", 500, 1)]
    d = plan(steady(decode=decode), config)
    assert d.decode.drain == ("d1",)
    assert d.decode.reasons == ("3 active > max 2",)


def test_scale_up_is_capped_at_max_workers() -> None:
    config = PlannerConfig(prefill=RoleBounds(1, 3), max_step=5, min_samples=5)
    d = plan(steady(ttft=samples("p0", [5000.0] * 5)), config)
    assert d.prefill.add == 1
    d = plan(steady(prefill=workers("p", 3), ttft=samples("p0", [5000.0] * 5)), config)
    assert d.prefill.add == 0
    assert d.prefill.reasons == ("TTFT p90 5000 ms > SLO 500 ms", "at max 3")


def test_never_scales_below_min() -> None:
    idle = make_tick(prefill=workers("p", 1), decode=workers("d", 1))
    d = plan(idle, CONFIG)
    assert not d.prefill.changes and not d.decode.changes
    assert d.prefill.reasons == ("TTFT p90 n/a (0 warm samples)",)


def test_min_zero_scales_from_zero_when_work_arrives() -> None:
    config = PlannerConfig(prefill=RoleBounds(0, 2), decode=RoleBounds(0, 2))
    d = plan(make_tick(prefill=[], decode=[], queue=3), config)
    assert d.prefill.add == 1 and d.prefill.reasons == ("work arriving and no active worker",)
    assert d.decode.add == 1
    d = plan(make_tick(prefill=[], decode=[]), config)
    assert not d.prefill.changes and not d.decode.changes


# -- latency SLOs ------------------------------------------------------------------------------


def test_ttft_over_slo_adds_prefill_in_proportion_to_the_overshoot() -> None:
    d = plan(steady(ttft=samples("p0", [600.0] * 5)), CONFIG)  # 1.2x SLO, 2 workers
    assert d.prefill.add == 1
    assert d.prefill.reasons == ("TTFT p90 600 ms > SLO 500 ms",)
    assert not d.decode.changes
    d = plan(steady(ttft=samples("p0", [900.0] * 5)), CONFIG)  # 1.8x: ceil(2 * 0.8) = 2
    assert d.prefill.add == 2
    d = plan(steady(ttft=samples("p0", [5000.0] * 5)), CONFIG)  # bounded by max_step
    assert d.prefill.add == 2


def test_tpot_over_slo_adds_decode() -> None:
    d = plan(steady(tpot=samples("d1", [60.0] * 5)), CONFIG)
    assert d.decode.add == 1 and not d.prefill.changes
    assert d.decode.reasons == ("TPOT p90 60 ms > SLO 50 ms",)


def test_the_configured_percentile_is_compared_not_the_mean() -> None:
    # 8 fast, 2 slow: p90 = 1000 + 0.1 * (1000 - 100) ... interpolated between ranks 8 and 9.
    values = [100.0] * 8 + [1000.0] * 2
    assert plan(steady(ttft=samples("p0", values)), CONFIG).prefill.add == 2
    median = PlannerConfig(slo_percentile=50.0, min_samples=5)
    assert plan(steady(ttft=samples("p0", values)), median).prefill.add == 0


def test_scale_up_ratio_gives_the_slo_a_margin() -> None:
    config = PlannerConfig(scale_up_ratio=1.2, min_samples=5)
    assert plan(steady(ttft=samples("p0", [590.0] * 5)), config).prefill.add == 0
    assert plan(steady(ttft=samples("p0", [610.0] * 5)), config).prefill.add == 1


def test_a_reported_percentile_is_used_when_no_samples_are_given() -> None:
    reported = make_tick(tpot=STEADY_TPOT)
    hot = TickInput(**{**reported.__dict__, "ttft_percentile_ms": 600.0})
    d = plan(hot, CONFIG)
    assert d.prefill.add == 1 and d.prefill.reasons == ("TTFT p90 600 ms > SLO 500 ms",)
    both = TickInput(**{**hot.__dict__, "ttft_samples": tuple(STEADY_TTFT)})
    assert plan(both, CONFIG).prefill.add == 0  # samples win over the reported value


def test_too_few_samples_are_not_acted_on() -> None:
    d = plan(steady(ttft=samples("p0", [5000.0] * 4)), CONFIG)
    assert d.prefill.add == 0
    assert "TTFT p90 n/a (4 warm samples)" in d.prefill.reasons[0]


# -- cold start --------------------------------------------------------------------------------


def test_samples_from_a_workers_cold_start_are_excluded() -> None:
    prefill = [WorkerView("p0", 600.0), WorkerView("new", 20.0)]  # "new" started at NOW - 20
    cold = samples("new", [5000.0] * 5, at=NOW - 1)  # 19 s after its start
    d = plan(steady(prefill=prefill, ttft=[*STEADY_TTFT, *cold]), CONFIG)
    assert d.prefill.add == 0


def test_samples_after_the_cold_start_window_count() -> None:
    prefill = [WorkerView("p0", 600.0), WorkerView("w", 100.0)]  # started at NOW - 100
    warm = samples("w", [5000.0] * 5, at=NOW - 60)  # 40 s after start
    d = plan(steady(prefill=prefill, ttft=[*STEADY_TTFT, *warm]), CONFIG)
    assert d.prefill.add == 2


def test_warm_samples_keeps_samples_of_workers_no_longer_listed() -> None:
    kept = warm_samples(samples("gone", [7.0]), [WorkerView("p0", 1.0)], NOW, 30.0)
    assert kept == [7.0]
    dropped = warm_samples(samples("p0", [7.0], at=NOW), [WorkerView("p0", 29.9)], NOW, 30.0)
    assert dropped == []


# -- queue depth and rate matching -------------------------------------------------------------


def test_queue_per_prefill_worker_over_the_bound_adds_prefill() -> None:
    assert plan(steady(queue=16), CONFIG).prefill.add == 0  # 8 per worker: at the bound
    d = plan(steady(queue=17), CONFIG)
    assert d.prefill.add == 1
    assert d.prefill.reasons == ("queue 17 > 8 per worker",)
    assert not d.decode.changes


def test_rate_match_sizes_each_role_to_its_demand() -> None:
    config = PlannerConfig(
        prefill_capacity_tokens_per_s=10_000.0,
        decode_capacity_tokens_per_s=1_000.0,
        target_utilization=0.5,
        prefill=RoleBounds(1, 8),
        decode=RoleBounds(1, 8),
        max_step=4,
        min_samples=5,
    )
    # prefill: 15000 / 5000 = 3 workers; decode: 3500 / 500 = 7 workers (step capped at 4).
    d = plan(steady(prefill_rate=15_000.0, decode_rate=3_500.0), config)
    assert (d.prefill.add, d.decode.add) == (1, 4)
    assert d.prefill.reasons == ("rate match: 15000 tok/s needs 3 workers at 50% of 10000 tok/s",)
    assert d.decode.reasons == ("rate match: 3500 tok/s needs 7 workers at 50% of 1000 tok/s",)


def test_largest_step_asked_by_any_signal_wins_and_all_reasons_are_kept() -> None:
    config = PlannerConfig(prefill_capacity_tokens_per_s=1000.0, max_step=3, min_samples=5)
    tick = steady(ttft=samples("p0", [600.0] * 5), queue=40, prefill_rate=3500.0)  # needs 5
    d = plan(tick, config)
    assert d.prefill.add == 3
    assert [r.split()[0] for r in d.prefill.reasons] == ["TTFT", "queue", "rate"]


# -- scale down --------------------------------------------------------------------------------


def test_slack_drains_one_worker_the_least_busy_youngest_first() -> None:
    prefill = [WorkerView("p0", 900, 2), WorkerView("p1", 300, 0), WorkerView("p2", 200, 0)]
    d = plan(make_tick(prefill=prefill, ttft=samples("p0", [100.0] * 5)), CONFIG)
    assert d.prefill.drain == ("p2",)
    assert d.prefill.reasons == ("slack: TTFT p90 100 ms, queue 0",)
    assert d.memory.last_change(Role.PREFILL) == 10


def test_busy_worker_may_be_drained_but_is_never_stopped_while_busy() -> None:
    prefill = [WorkerView("p0", 900, 3), WorkerView("p1", 900, 5)]
    d = plan(make_tick(prefill=prefill, ttft=samples("p0", [100.0] * 5)), CONFIG)
    assert d.prefill.drain == ("p0",) and d.prefill.stop == ()
    prefill = [WorkerView("p0", 900, 3, draining=True), WorkerView("p1", 900, 5)]
    d = plan(make_tick(prefill=prefill), CONFIG)
    assert d.prefill.stop == ()
    prefill = [WorkerView("p0", 900, 0, 2, draining=True), WorkerView("p1", 900, 5)]
    assert plan(make_tick(prefill=prefill), CONFIG).prefill.stop == ()  # transfers in flight


def test_drained_idle_worker_is_listed_to_stop() -> None:
    decode = [WorkerView("d0", 900, 1), WorkerView("d1", 900, 0, draining=True)]
    d = plan(steady(decode=decode), CONFIG)
    assert d.decode.stop == ("d1",)
    assert d.decode.reasons[0] == "d1 drained, no in-flight work: stop"
    assert not d.decode.changes  # stopping an already-drained worker is not a new change


@pytest.mark.parametrize(
    ("changes", "blocker"),
    [
        ({"ttft": samples("p0", [250.0] * 5)}, "TTFT p90 250 ms >= 0.5 x SLO"),
        ({"queue": 1}, "queue 1"),
        ({"prefill": [WorkerView("p0", 900), WorkerView("p1", 10)]}, "a worker is warming up"),
        (
            {"prefill": [*workers("p", 2), WorkerView("px", 900, 1, draining=True)]},
            "a drain is under way",
        ),
    ],
)
def test_scale_down_needs_every_signal_to_show_slack(changes: dict, blocker: str) -> None:
    tick = make_tick(**{"ttft": samples("p0", [100.0] * 5), **changes})
    d = plan(tick, CONFIG)
    assert not d.prefill.changes
    assert d.prefill.reasons[-1].endswith(blocker)


def test_rate_match_holds_workers_the_demand_needs() -> None:
    config = PlannerConfig(
        decode_capacity_tokens_per_s=1000.0, target_utilization=1.0, min_samples=5
    )
    quiet = samples("d0", [5.0] * 5)
    d = plan(make_tick(decode=workers("d", 3), tpot=quiet, decode_rate=2500.0), config)
    assert not d.decode.changes and d.decode.reasons[-1].endswith("rate needs 3")
    d = plan(make_tick(decode=workers("d", 3), tpot=quiet, decode_rate=1500.0), config)
    assert len(d.decode.drain) == 1


def test_no_samples_and_no_work_counts_as_slack() -> None:
    d = plan(make_tick(prefill=workers("p", 3)), CONFIG)
    assert d.prefill.drain == ("p0",)  # equally idle and old: ties go by id
    assert d.prefill.reasons == ("slack: TTFT p90 n/a (0 warm samples), queue 0",)


# -- cooldown and memory -----------------------------------------------------------------------


def test_cooldown_holds_a_role_for_cooldown_ticks_after_a_change() -> None:
    hot = steady(ttft=samples("p0", [900.0] * 5))
    first = plan(hot, CONFIG)
    assert first.prefill.add == 2
    assert first.memory.last_change(Role.PREFILL) == 10
    assert first.memory.last_change(Role.DECODE) is None
    again = plan(steady(tick=11, ttft=samples("p0", [900.0] * 5)), CONFIG, first.memory)
    assert again.prefill.add == 0
    assert again.prefill.reasons == ("cooldown: changed at tick 10",)
    later = plan(steady(tick=12, ttft=samples("p0", [900.0] * 5)), CONFIG, first.memory)
    assert later.prefill.add == 2


def test_cooldown_is_per_role() -> None:
    memory = PlannerMemory().changed(Role.PREFILL, 10)
    d = plan(steady(tick=11, tpot=samples("d0", [60.0] * 5)), CONFIG, memory)
    assert d.decode.add == 1
    assert d.memory.last_change(Role.PREFILL) == 10
    assert d.memory.last_change(Role.DECODE) == 11


def test_plan_is_pure() -> None:
    tick = steady(ttft=samples("p0", [900.0] * 5))
    memory = PlannerMemory().changed(Role.DECODE, 3)
    assert plan(tick, CONFIG, memory) == plan(tick, CONFIG, memory)
    assert memory == PlannerMemory().changed(Role.DECODE, 3)


# -- config, logging, actuation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slo_percentile": 0.0},
        {"ttft_slo_ms": 0.0},
        {"scale_down_ratio": 1.0},
        {"target_utilization": 0.0},
        {"max_step": 0},
        {"prefill": "bounds"},
    ],
)
def test_invalid_config_is_refused(kwargs: dict) -> None:
    if kwargs.get("prefill") == "bounds":
        with pytest.raises(ValueError, match="min_workers"):
            RoleBounds(3, 2)
        return
    with pytest.raises(ValueError):
        PlannerConfig(**kwargs)


def test_planner_threads_memory_and_logs_every_decision(caplog: pytest.LogCaptureFixture) -> None:
    planner = Planner(CONFIG)
    hot = [steady(tick=t, ttft=samples("p0", [900.0] * 5)) for t in (1, 2, 3)]
    with caplog.at_level("INFO", logger="planner.core"):
        adds = [planner.tick(t).prefill.add for t in hot]
    assert adds == [2, 0, 2]
    assert len(caplog.records) == 3
    assert "tick 2: prefill: hold (cooldown: changed at tick 1)" in caplog.records[1].getMessage()


class RecordingActuator:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Role, object]] = []

    def add_workers(self, role: Role, count: int) -> None:
        self.calls.append(("add", role, count))

    def drain_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        self.calls.append(("drain", role, tuple(worker_ids)))

    def stop_workers(self, role: Role, worker_ids: Sequence[str]) -> None:
        self.calls.append(("stop", role, tuple(worker_ids)))


def test_apply_hands_stops_drains_and_adds_to_the_actuator() -> None:
    decision = ScalingDecision(
        tick=1,
        prefill=RoleDecision(Role.PREFILL, add=2, stop=("p9",)),
        decode=RoleDecision(Role.DECODE, drain=("d1",)),
        memory=PlannerMemory(),
    )
    actuator = RecordingActuator()
    Planner(CONFIG).apply(decision, actuator)
    assert actuator.calls == [
        ("stop", Role.PREFILL, ("p9",)),
        ("add", Role.PREFILL, 2),
        ("drain", Role.DECODE, ("d1",)),
    ]
    assert decision.describe() == "tick 1: prefill: +2 stop p9 () | decode: drain d1 ()"
